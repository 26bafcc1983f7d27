"""weights_cmds: the commands that prepare weights — `ninfer-gen convert` (an HF checkpoint quantised once
into a container) and `ninfer-gen draft-vocab` (the N most frequent tokens of text files, for a reduced
MTP head)."""
from __future__ import annotations


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


CONVERT_DESCRIPTION = ("Streams the checkpoint one tensor at a time through the spec's quantisation recipe (on the "
                       "GPU when there is one) into the planes the kernels read, and writes them as safetensors "
                       "shards with spec.yaml, the tokenizer, chat template and generation config, and a manifest "
                       "holding a sha256 per tensor. `run --weights OUT` and `bench --weights OUT` load it.")


def cmd_convert(args) -> int:
    from compiler.spec import load_spec
    from ninfer_gen.executor.memory_plan import parse_bytes
    from ninfer_gen.weights.convert import convert_checkpoint

    spec = load_spec(args.spec) if args.spec else None
    r = convert_checkpoint(args.source, args.out, spec=spec, device=args.device, shard_bytes=parse_bytes(args.shard_size),
                           overwrite=args.force, progress=True)
    print(f"{r['out']}: {r['tensors']} planes of spec {r['spec']} in {r['shards']} shard(s), "
          f"{fmt_bytes(r['written_bytes'])} from {fmt_bytes(r['read_bytes'])} read, quantised on {r['device']}, "
          f"{r['seconds']:.1f} s ({r['read_bytes'] / max(r['seconds'], 1e-9) / 1e9:.2f} GB/s)")
    print(f"  MTP layer: {'yes' if r['mtp'] else 'no (the source has no mtp.* tensors: no drafting)'}; "
          f"copied: {', '.join(r['files']) or 'nothing'}")
    return 0


DRAFT_VOCAB_SUFFIXES = (".py", ".md", ".txt", ".json", ".rst", ".c", ".h", ".js", ".ts", ".rs", ".go", ".java")


def cmd_draft_vocab(args) -> int:
    from pathlib import Path

    from ninfer_gen.api import resolve_tokenizer
    from ninfer_gen.weights.draft_vocab import rank, save

    tok, vocab = resolve_tokenizer(args.weights)
    files = []
    for name in args.files:
        path = Path(name)
        if path.is_dir():
            files += sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in DRAFT_VOCAB_SUFFIXES)
        elif path.is_file():
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or folder")
    if not files:
        raise ValueError("no text files found in " + ", ".join(args.files))
    texts = (f.read_text(errors="replace") for f in tqdm_files(files))
    ids, counted = rank(tok.encode, texts, args.size, vocab)
    save(Path(args.out), ids, counted, [str(f) for f in files])
    print(f"{args.out}: the {len(ids)} most frequent of {vocab} token ids over {counted:,} tokens in {len(files)} files")
    return 0


def tqdm_files(files):
    from tqdm import tqdm
    return tqdm(files, desc="counting tokens", unit="file", leave=False)
