"""gguf_tokenizer: a GGUF file's tokenizer and chat template as the model folder the rest of ninfer-gen reads
(engine.tokenizer, serve.chat): `tokenizer.json` rebuilt from `tokenizer.ggml.*` (byte-level BPE, the
Qwen split regex of `tokenizer.ggml.pre`, NFC as the HF tokenizer has), `tokenizer_config.json` with the
chat template(s) and named special tokens, `generation_config.json` with the end-of-generation ids.

The folder is written once per file content (keyed by a hash of the file's metadata region), atomically.
Owns no tokenisation itself; refuses vocabularies it cannot rebuild with a GGUFError naming the key.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from .gguf_file import GGUFError, GGUFFile

# llama.cpp's pre-tokenizer split of each `tokenizer.ggml.pre` we rebuild (LLAMA_VOCAB_PRE_TYPE_*):
# qwen35 is qwen2's with combining marks (\p{M}) kept with their letters and out of punctuation runs.
SPLITS = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
CONTROL, USER_DEFINED = 3, 4              # tokenizer.ggml.token_type values of added tokens
TEMPLATE_PREFIX = "tokenizer.chat_template"


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "ninfer-gen" / "gguf"


def metadata_digest(g: GGUFFile) -> str:
    """sha256 (16 hex) of the file's header: metadata, vocabulary and tensor infos."""
    head = g.meta.reader.data[:g.meta.reader.data_offset]
    return hashlib.sha256(memoryview(head)).hexdigest()[:16]


def build_tokenizer(g: GGUFFile):
    """The file's tokenizer as an HF `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    meta = g.meta
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "qwen2")
    if model != "gpt2":
        raise GGUFError(f"{g.path}: tokenizer.ggml.model {model!r} is not supported (ninfer-gen rebuilds 'gpt2', "
                        "byte-level BPE)")
    if pre not in SPLITS:
        raise GGUFError(f"{g.path}: tokenizer.ggml.pre {pre!r} is not supported (expected one of: {', '.join(SPLITS)})")
    tokens, types = meta.need("tokenizer.ggml.tokens"), meta.need("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in meta.need("tokenizer.ggml.merges")]
    if len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise GGUFError(f"{g.path}: tokenizer.ggml.token_type or tokenizer.ggml.merges is malformed")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    return tok


def _templates(g: GGUFFile) -> str | list | None:
    named = {key[len(TEMPLATE_PREFIX) + 1:]: g.meta.get(key) for key in g.meta.reader.fields
             if key.startswith(TEMPLATE_PREFIX + ".")}
    default = g.meta.get(TEMPLATE_PREFIX)
    if not named:
        return default
    entries = ([{"name": "default", "template": default}] if default else [])
    return entries + [{"name": n, "template": t} for n, t in sorted(named.items())]


def _configs(g: GGUFFile) -> tuple[dict, dict]:
    meta, tokens = g.meta, g.meta.need("tokenizer.ggml.tokens")
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id") for name in ("bos", "eos", "padding", "eot", "eom")}
    config: dict = {"add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False))}
    for name, key in (("bos", "bos_token"), ("eos", "eos_token"), ("padding", "pad_token")):
        if ids[name] is not None and 0 <= ids[name] < len(tokens):
            config[key] = tokens[ids[name]]
    templates = _templates(g)
    if templates:
        config["chat_template"] = templates
    ends = [ids[n] for n in ("eos", "eot", "eom") if ids[n] is not None]
    generation = {"eos_token_id": sorted(set(ends))} if ends else {}
    return config, generation


def tokenizer_folder(g: GGUFFile, cache_dir: str | Path | None = None) -> Path:
    """The model folder of the file's tokenizer and chat template (written on first use)."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    folder = root / f"{g.path.stem}-{metadata_digest(g)}"
    if (folder / "tokenizer.json").is_file():
        return folder
    tok = build_tokenizer(g)
    config, generation = _configs(g)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
    try:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1))
        (tmp / "generation_config.json").write_text(json.dumps(generation))
        try:
            os.rename(tmp, folder)
        except OSError:                     # another process wrote it first: theirs is the same
            if not (folder / "tokenizer.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
