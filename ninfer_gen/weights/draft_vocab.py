"""draft_vocab: the reduced draft vocabulary — the N most frequent token ids of a text corpus, ranked by
`ninfer-gen draft-vocab` and stored as `draft_vocab.json` ({"format", "size", "ids", "counted_tokens",
"sources"}). The MTP head then projects onto those N rows of the LM head only (compiler.spec.DRAFT_HEAD);
verification always uses the full head, so output is unchanged: a draft outside the N ids is simply
never proposed.
"""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

FORMAT = "ninfer-gen draft vocabulary 1"
FILE = "draft_vocab.json"


class DraftVocabError(ValueError):
    """A draft vocabulary that cannot be built or read; the message names the file and the problem."""


def rank(encode, texts, size: int, vocab_size: int) -> tuple[list[int], int]:
    """The `size` most frequent ids over the encoded texts (ties: lower id first), topped up with the
    lowest unseen ids when the corpus has fewer distinct tokens → (ids, tokens counted)."""
    if not 0 < size <= vocab_size:
        raise DraftVocabError(f"draft vocabulary size {size}: expected 1..{vocab_size} (the vocabulary)")
    counts: Counter = Counter()
    for text in texts:
        counts.update(encode(text))
    ids = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if 0 <= t < vocab_size][:size]
    seen = set(ids)
    ids += [t for t in range(vocab_size) if t not in seen][:size - len(ids)]
    return ids, sum(counts.values())


def save(path: Path, ids: list[int], counted: int, sources: list[str]) -> None:
    Path(path).write_text(json.dumps({"format": FORMAT, "size": len(ids), "ids": ids, "counted_tokens": counted,
                                      "sources": sources}))


def load(path, vocab_size: int) -> list[int]:
    """The ids of a `draft_vocab.json` (a file, or a folder holding one), checked against the vocabulary."""
    path = Path(path)
    if path.is_dir():
        path = path / FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DraftVocabError(f"draft vocabulary not found: {path}") from None
    except json.JSONDecodeError as err:
        raise DraftVocabError(f"{path}: not JSON ({err})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DraftVocabError(f"{path}: not a draft vocabulary (format {data.get('format') if isinstance(data, dict) else None!r}, "
                              f"expected {FORMAT!r})")
    ids = data.get("ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise DraftVocabError(f"{path}: ids must be a non-empty list of token ids below {vocab_size}")
    if len(set(ids)) != len(ids):
        raise DraftVocabError(f"{path}: ids repeat")
    return ids
