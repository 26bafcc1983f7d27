"""tokenizer: text ↔ ids — the checkpoint's `tokenizer.json` (HF `tokenizers`) or, for models with
none, a byte-level fallback (id = byte value) that is honest about what it is."""
from __future__ import annotations

from pathlib import Path


class ByteTokenizer:
    name = "bytes"

    def __init__(self, vocab_size: int):
        if vocab_size < 256:
            raise ValueError(f"byte-level fallback needs a vocabulary of ≥ 256 ids, the model has {vocab_size}")

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self.name = str(path)
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=False)


def load_tokenizer(folder: Path | None, vocab_size: int):
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        return HFTokenizer(Path(folder) / "tokenizer.json")
    return ByteTokenizer(vocab_size)
