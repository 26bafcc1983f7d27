"""synth_gguf: writes a random llama.cpp-style GGUF of a spec's shape (arch qwen35) in the Q4_K_M mix llama.cpp
gives this architecture (gguf_synth.q4_k_m; Q8_0 where a row does not fit a k-quant, as its quantiser falls
back), with its metadata and a tiny BPE vocabulary, so loading, converting and benching a GGUF can be measured
at full size without a download. Matrices are random blocks with valid fp16 scales at `random_weights`' scale
per tensor; float tensors (norms, A_log, conv, GDN a/b) are drawn by `draw_tensor` and stored as llama.cpp's
converter stores them. Streams: the tensor table goes first (add_tensor_info), then each tensor is drawn,
written and freed in turn — never more than one tensor in memory; each is seeded by its name. The written file
is opened with `gguf_load.open_gguf` and its spec compared with the spec's text model.

    python -m tools.synth_gguf /scratch/qwen3.8-27b-q4_k_m.gguf        [--spec model_specs/qwen3.8-27b.yaml]
    python -m tools.synth_gguf /tmp/tiny.gguf --spec model_specs/qwen3.8-tiny.yaml --device cuda
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import resource
import sys
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compiler.spec import ArchSpec, ModelSpec, load_spec, tensor_table
from ninfer_gen.weights.gguf_names import gguf_name, stored_shape
from ninfer_gen.weights.gguf_synth import (add_metadata, layer_of, q4_k_m, random_blocks, row_bytes, stored_float,
                                           with_fallback)
from ninfer_gen.weights.random_weights import draw_tensor

DEFAULT_SPEC = Path(__file__).resolve().parents[1] / "model_specs" / "qwen3.8-27b.yaml"
Q4_K_M = with_fallback(q4_k_m)
MOSTLY_Q4_K_M, QUANTIZATION_VERSION = 15, 2        # general.file_type and the k-quant layout version llama.cpp writes
FLOAT_BYTES = {"F32": 4, "BF16": 2}


@dataclass(frozen=True)
class Entry:
    """One tensor of the file: canonical and GGUF names, GGML type, shape as stored (numpy order), bytes."""
    name: str
    gguf: str
    kind: str
    shape: tuple[int, ...]
    canonical_shape: tuple[int, ...]
    nbytes: int


def plan(spec: ModelSpec, kind_of=Q4_K_M) -> list[Entry]:
    """The file's tensors in tensor-table order, with their types and sizes (nothing drawn)."""
    n, out = spec.model.layers.count, []
    for t in tensor_table(spec):
        kind, shape = kind_of(t.name, t.shape, layer_of(t.name), n), stored_shape(t.shape, t.name)
        if kind in FLOAT_BYTES:
            nbytes = FLOAT_BYTES[kind] * math.prod(shape)
        else:
            nbytes = shape[0] * row_bytes(kind, shape[1])
        out.append(Entry(t.name, gguf_name(t.name, n), kind, shape, tuple(t.shape), nbytes))
    return out


def matrix_std(spec: ModelSpec, name: str, k: int) -> float:
    """The std `random_weights` draws matrix `name` at (the LM head's logits ×2)."""
    head = "embed_tokens.weight" if spec.model.tie_word_embeddings else "lm_head.weight"
    std = 1.0 if name == "embed_tokens.weight" else 1.0 / math.sqrt(k)
    return std * (2.0 if name == head else 1.0)


def draw(spec: ModelSpec, e: Entry, seed: int = 0, device="cpu") -> np.ndarray:
    """Tensor `e` as the file stores it, from its own generator (seeded by its name)."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(e.name.encode()))
    if e.kind in FLOAT_BYTES:
        w = stored_float(spec, e.name, draw_tensor(e.name, e.canonical_shape, gen)).cpu()
        if e.kind == "BF16":
            return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return w.to(torch.float32).numpy()
    n, k = e.shape
    return random_blocks(e.kind, n, k, matrix_std(spec, e.name, k), gen).cpu().numpy()


def _add_info(w, e: Entry) -> None:
    from gguf import GGMLQuantizationType

    if e.kind == "F32":
        w.add_tensor_info(e.gguf, e.shape, np.dtype(np.float32), e.nbytes)
    elif e.kind == "BF16":
        w.add_tensor_info(e.gguf, e.shape, np.dtype(np.uint16), e.nbytes, raw_dtype=GGMLQuantizationType.BF16)
    else:                                    # uint8 rows of blocks: the writer turns the byte shape into values
        w.add_tensor_info(e.gguf, (e.shape[0], e.nbytes // e.shape[0]), np.dtype(np.uint8), e.nbytes,
                          raw_dtype=GGMLQuantizationType[e.kind])


def write_gguf(spec: ModelSpec, out, seed: int = 0, device="cpu", arch: str = "qwen35", progress: bool = False) -> dict:
    """Write the file to `out`; returns its size, tensor count, largest tensor, bytes per type and seconds."""
    import gguf
    from tqdm import tqdm

    t0, out = time.perf_counter(), Path(out)
    entries = plan(spec)
    w = gguf.GGUFWriter(str(out), arch)
    add_metadata(w, spec, arch)
    w.add_file_type(MOSTLY_Q4_K_M)
    w.add_quantization_version(QUANTIZATION_VERSION)
    for e in entries:
        _add_info(w, e)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(e.nbytes for e in entries)
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"writing {out.name}",
              disable=None if progress else True) as bar:
        for e in entries:
            w.write_tensor_data(draw(spec, e, seed, device))
            bar.update(e.nbytes)
    w.close()
    largest = max(entries, key=lambda e: e.nbytes)
    types = Counter()
    for e in entries:
        types[e.kind] += e.nbytes
    return {"out": str(out), "spec": spec.name, "bytes": out.stat().st_size, "tensor_bytes": total,
            "tensors": len(entries), "largest_tensor": largest.gguf, "largest_tensor_bytes": largest.nbytes,
            "bytes_per_type": dict(types.most_common()), "seconds": time.perf_counter() - t0,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _shape_fields(a: ArchSpec) -> dict:
    d = dataclasses.asdict(a)
    d["layers"] = list(a.layers.kinds)
    d["linear_attention"].pop("out_head_order")         # a file's k-quant out_proj keeps llama.cpp's tiled order
    return d


def shape_mismatches(got: ArchSpec, want: ArchSpec) -> list[str]:
    """The fields where two text models differ in shape (not in formats or out_proj's head order)."""
    g, w = _shape_fields(got), _shape_fields(want)
    return [f"{k}: {g.get(k)!r} != {w.get(k)!r}" for k in sorted(set(g) | set(w)) if g.get(k) != w.get(k)]


def check(path, spec: ModelSpec) -> list[str]:
    """Open the written file with our reader (header and tensor table only); what differs from the spec."""
    from ninfer_gen.weights.gguf_load import open_gguf

    return shape_mismatches(open_gguf(path).spec.model, spec.model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the .gguf file to write (replaced)")
    p.add_argument("--spec", default=str(DEFAULT_SPEC), help="model spec YAML giving the shape (default: the 27B); "
                   "its text model only")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where to draw: cpu or cuda")
    args = p.parse_args(argv)
    spec = load_spec(args.spec)
    r = write_gguf(spec, args.out, args.seed, args.device, progress=True)
    r["mismatches"] = check(args.out, spec)
    print(json.dumps(r))
    return 1 if r["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
