"""small_data: the small model's corpus (the running Python's standard library sources), its byte-level
BPE tokenizer and the token streams the trainer samples from.

Owns corpus selection (which files are training data, which are held out) and tokenisation only;
knows nothing about the model.
"""
from __future__ import annotations

import hashlib
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
HELDOUT_DIRS = ("json", "email")
# Top-level folders that are never training data: installed packages, the test suite, IDLE, and the
# held-out packages (collected separately).
EXCLUDED_TOP = {"site-packages", "dist-packages", "test", "idlelib", *HELDOUT_DIRS}
# Test suites and their data at any depth (lib2to3/tests/data holds deliberately broken files).
TEST_DIRS = {"test", "tests"}


@dataclass(frozen=True)
class Document:
    path: str      # relative to the standard library root
    text: str

    @property
    def n_bytes(self) -> int:
        return len(self.text.encode("utf-8"))


@dataclass(frozen=True)
class Corpus:
    root: str
    train: list[Document]
    heldout: list[Document]

    def stats(self) -> dict:
        return {"root": self.root,
                "train_files": len(self.train), "train_bytes": sum(d.n_bytes for d in self.train),
                "heldout_files": len(self.heldout), "heldout_bytes": sum(d.n_bytes for d in self.heldout)}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _read_utf8(path: Path) -> str | None:
    try:
        return path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _role(rel: Path) -> str | None:
    """"train", "heldout" or None (skipped) for a path relative to the stdlib root."""
    parts = rel.parts
    if len(parts) > 1 and parts[0] in HELDOUT_DIRS:
        return "heldout"
    if len(parts) > 1 and parts[0] in EXCLUDED_TOP:
        return None
    if any(p in TEST_DIRS for p in parts[:-1]):
        return None
    return "train"


def collect_corpus(root: Path | None = None) -> Corpus:
    """Every UTF-8 `*.py` file under the stdlib, split into train and held-out, deduplicated by content.

    Held-out files are taken first so that a training file identical to a held-out one is dropped
    (no leakage). Files with only whitespace are skipped. Order is the sorted relative path.
    """
    root = Path(root or stdlib_root())
    if not root.is_dir():
        raise FileNotFoundError(f"standard library folder not found: {root}")
    split: dict[str, list[Document]] = {"train": [], "heldout": []}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        role = _role(rel)
        if role is None or not path.is_file():
            continue
        text = _read_utf8(path)
        if text is not None and text.strip():
            split[role].append(Document(rel.as_posix(), text))
    seen: set[str] = set()
    kept: dict[str, list[Document]] = {"heldout": [], "train": []}
    for role in ("heldout", "train"):
        for doc in split[role]:
            digest = hashlib.sha256(doc.text.encode("utf-8")).hexdigest()
            if digest not in seen:
                seen.add(digest)
                kept[role].append(doc)
    if not kept["train"] or not kept["heldout"]:
        raise RuntimeError(f"corpus under {root} is empty: {len(kept['train'])} training files, "
                           f"{len(kept['heldout'])} held-out files")
    return Corpus(str(root), kept["train"], kept["heldout"])


def slice_docs(docs: list[Document], max_bytes: int, seed: int = 0) -> list[Document]:
    """A random subset of whole documents totalling at most max_bytes (else the smallest document)."""
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    out, total = [], 0
    for i in order:
        if total + docs[i].n_bytes <= max_bytes:
            out.append(docs[i])
            total += docs[i].n_bytes
    if not out and docs:
        out = [min(docs, key=lambda d: d.n_bytes)]
    return sorted(out, key=lambda d: d.path)


def split_validation(docs: list[Document], every: int = 40) -> tuple[list[Document], list[Document]]:
    """(train, validation): about 1/every of the training files, chosen by a hash of the path, are
    kept aside to watch over-fitting; the held-out json/ and email/ sources are never used for that."""
    def is_valid(doc: Document) -> bool:
        return int(hashlib.sha1(doc.path.encode()).hexdigest()[:8], 16) % every == 0
    return [d for d in docs if not is_valid(d)], [d for d in docs if is_valid(d)]


# ---------------------------------------------------------------- tokenizer

def train_tokenizer(docs: list[Document], vocab_size: int, sample_bytes: int, seed: int = 0) -> Tokenizer:
    """Byte-level BPE with `<|endoftext|>` as id 0, trained on a random sample of whole documents."""
    sample = slice_docs(docs, sample_bytes, seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((d.text for d in sample), trainer=trainer, length=len(sample))
    if tok.token_to_id(EOT) != 0:
        raise RuntimeError(f"expected {EOT} at id 0, got {tok.token_to_id(EOT)}")
    return tok


def encode_docs(tok: Tokenizer, docs: list[Document]) -> list[list[int]]:
    return [e.ids for e in tok.encode_batch([d.text for d in docs], add_special_tokens=False)]


def token_stream(tok: Tokenizer, docs: list[Document]) -> torch.Tensor:
    """All documents as one int64 stream: EOT doc EOT doc ... EOT (each document follows an EOT)."""
    eot = tok.token_to_id(EOT)
    flat = [eot]
    for ids in encode_docs(tok, docs):
        flat.extend(ids)
        flat.append(eot)
    return torch.tensor(flat, dtype=torch.long)


def build_data(train_docs: list[Document], vocab_size: int, tokenizer_sample_bytes: int, seed: int = 0):
    """(tokenizer, training stream, timings) with the tokenizer trained on the training documents."""
    t0 = time.perf_counter()
    tok = train_tokenizer(train_docs, vocab_size, tokenizer_sample_bytes, seed)
    t1 = time.perf_counter()
    stream = token_stream(tok, train_docs)
    t2 = time.perf_counter()
    return tok, stream, {"tokenizer_train_s": round(t1 - t0, 2), "encode_s": round(t2 - t1, 2)}


class BatchSampler:
    """Random windows of seq_len + 1 tokens from a stream kept on the training device."""

    def __init__(self, stream: torch.Tensor, seq_len: int, batch: int, device: torch.device, seed: int):
        if stream.numel() < seq_len + 2:
            raise ValueError(f"token stream of {stream.numel()} tokens is shorter than a window ({seq_len + 1})")
        self.stream = stream.to(device)
        self.seq_len, self.batch = seq_len, batch
        # A generator on the training device: drawing offsets needs no host round trip (no sync per step).
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.span = torch.arange(seq_len + 1, device=device)

    def next(self) -> torch.Tensor:
        hi = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, hi + 1, (self.batch,), generator=self.gen, device=self.stream.device)
        return self.stream[starts[:, None] + self.span]
