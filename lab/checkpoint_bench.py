"""checkpoint_bench: full-size checkpoint loading, measured in one process (lab/gpu_checkpoints.sh): a
synthetic HF checkpoint of a spec (tools/synth_checkpoint), a cold `dd` of its files for the disk's own
speed, the streaming load from HF layout, `convert`, the container's load (hashes checked, then not), host
RSS growth of each (lab/rss), and the two loads compared plane for plane and by greedy tokens. Page-cache
residency (mincore) is evicted (fadvise) and reported before every cold read. Prints a summary, writes
JSON. Without a GPU it runs the same steps on the CPU (tokens from the reference backend), for a tiny spec.

    PYTHONPATH=. python3 -m lab.checkpoint_bench --spec lab/qwen3.8-9b.yaml --work /tmp/ckpt --json out.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from compiler.spec import load_spec, tensor_table
from lab.rss import PeakRSS, rss
from ninfer_gen.weights.planes import plane_table
from ninfer_gen.weights.safetensors_io import DTYPES

GB = 1e9


def shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def evict(paths: list[Path]) -> None:
    """Drop the files' pages from the page cache (written back first), so the next read is cold."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_fraction(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache: mincore over a mapping that touches no page."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    cached = total = 0
    for p in paths:
        size = p.stat().st_size
        if not size:
            continue
        n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = (ctypes.c_ubyte * n)()
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                return float("nan")
            try:
                if libc.mincore(addr, size, vec) != 0:
                    return float("nan")
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        cached += sum(b & 1 for b in vec)
        total += n
    return cached / total if total else 0.0


def dd_read(paths: list[Path]) -> dict:
    """Cold sequential read of the files with dd (16 MiB blocks): the disk's speed in this run."""
    evict(paths)
    before = cached_fraction(paths)
    nbytes = sum(p.stat().st_size for p in paths)
    t0 = time.perf_counter()
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "status=none"], check=True)
    s = time.perf_counter() - t0
    return {"bytes": nbytes, "s": s, "GBps": nbytes / s / GB, "cached_before": before}


def timed(fn, paths: list[Path], nbytes: int, bound: int) -> tuple[object, dict]:
    """fn() after evicting `paths`: seconds, GB/s over `nbytes`, host RSS growth against `bound`."""
    evict(paths)
    before = cached_fraction(paths)
    with PeakRSS() as peak:
        t0 = time.perf_counter()
        out = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
    return out, {"s": s, "GBps": nbytes / s / GB, "cached_before": before, "rss_start": peak.start,
                 "rss_growth": peak.growth, "rss_method": peak.method, "rss_bound": bound,
                 "rss_within_bound": peak.growth < bound}


def same_planes(a, b) -> dict:
    pairs = [(f"{n}#{p}", t, b.matrices[n][p]) for n, planes in a.matrices.items() for p, t in planes.items()]
    pairs += [(f"{n}#tensor", t, b.tensors[n]) for n, t in a.tensors.items()]
    pairs += [("embed#rows", a.embed_codes, b.embed_codes)]
    if a.embed_scales is not None:
        pairs.append(("embed#row_scales", a.embed_scales, b.embed_scales))
    differ = [k for k, x, y in pairs if x.dtype != y.dtype or not torch.equal(x, y)]
    return {"compared": len(pairs), "differ": differ[:10], "equal": not differ}


def greedy_tokens(spec, weights, source: Path, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens of the weights on the GPU backend (a small profile); on the CPU, of `source` loaded
    by the reference backend (its quantise-at-load or container path)."""
    import ninfer_gen
    if not torch.cuda.is_available():
        return ninfer_gen.load(source, quantize=True, device="cpu").generate(prompt, n)
    from ninfer_gen.cli.env import build_root
    from ninfer_gen.api import Model
    from ninfer_gen.executor.gpu_backend import GpuBackend

    backend = GpuBackend(spec, weights, max_context=256, draft=0, prefill_chunk=64, build_root=build_root(),
                         progress=False)
    try:
        return Model(spec, backend, None, "").generate(prompt, n)
    finally:
        del backend
        torch.cuda.empty_cache()


def plane_bytes(spec) -> int:
    return sum(math.prod(shape) * DTYPES[dtype][1] for _, dtype, shape in plane_table(spec))


def run(args) -> dict:
    from ninfer_gen.executor.device_weights import from_checkpoint, from_container
    from ninfer_gen.weights.convert import convert_checkpoint
    from tools.synth_checkpoint import write_synthetic

    device = "cuda" if torch.cuda.is_available() else "cpu"
    spec = load_spec(args.spec)
    work = Path(args.work)
    hf, box = work / "hf", work / "converted"
    work.mkdir(parents=True, exist_ok=True)
    hf_bytes = sum(2 * t.numel for t in tensor_table(spec))          # bf16, MTP included
    box_bytes = plane_bytes(spec)
    r: dict = {"spec": spec.name, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
               "work": str(work), "checkpoint_bytes_estimate": hf_bytes, "container_bytes_estimate": box_bytes}
    reuse = args.reuse and (hf / "config.json").is_file()
    free = shutil.disk_usage(work).free + (sum(p.stat().st_size for p in shards(hf)) if reuse else 0)
    r["disk_free_bytes"] = free
    if hf_bytes + (0 if args.no_convert else box_bytes) + 2 * 2**30 > free:
        raise SystemExit(f"not enough disk in {work}: {free / GB:.1f} GB free, need {(hf_bytes + box_bytes) / GB:.1f} "
                         "GB (+2 GiB); use NO_CONVERT=1 or a smaller SPEC")
    if not reuse:
        shutil.rmtree(hf, ignore_errors=True)
        r["write"] = write_synthetic(spec, hf, seed=0, shard_bytes=int(args.shard_size), device=device, progress=True)
        print(f"[wrote {r['write']['bytes'] / GB:.2f} GB in {r['write']['shards']} shards, {r['write']['seconds']:.1f} s]",
              flush=True)
    files = shards(hf)
    largest = max(2 * t.numel for t in tensor_table(spec))
    r["largest_tensor_bytes"] = largest
    bound = largest + 2**30                       # the acceptance bound on host RSS growth
    r["dd_hf"] = dd_read(files)
    if device == "cuda":
        torch.zeros(1, device=device)             # the CUDA context's host memory is not the loader's
    r["rss_before_loads"] = rss()
    w_hf, r["load_hf"] = timed(lambda: from_checkpoint(hf, device=device, progress=True), files, hf_bytes, bound)
    print(f"[HF load {r['load_hf']['s']:.1f} s, RSS +{r['load_hf']['rss_growth'] / 2**20:.0f} MiB]", flush=True)
    prompt = list(range(3, 3 + args.prompt_len))
    if not args.no_convert:
        shutil.rmtree(box, ignore_errors=True)
        report, r["convert"] = timed(lambda: convert_checkpoint(hf, box, device=device, progress=True), files,
                                     hf_bytes, bound)
        r["convert"].update(written_bytes=report["written_bytes"], shards=report["shards"])
        box_files = shards(box)
        r["dd_container"] = dd_read(box_files)
        w_box, r["load_container"] = timed(lambda: from_container(box, device=device, progress=True), box_files,
                                           report["written_bytes"], bound)
        again, r["load_container_no_verify"] = timed(lambda: from_container(box, device=device, verify=False),
                                                     box_files, report["written_bytes"], bound)
        del again
        r["planes"] = same_planes(w_hf, w_box)
        t_box = greedy_tokens(spec, w_box, box, prompt, args.tokens)
        del w_box
        r["tokens"] = {"container": t_box}
    t_hf = greedy_tokens(spec, w_hf, hf, prompt, args.tokens)
    r.setdefault("tokens", {})["hf"] = t_hf
    r["tokens"]["equal"] = r["tokens"].get("container", t_hf) == t_hf
    return r


def summary(r: dict) -> str:
    rows = [f"{r['spec']} on {r['device']}: checkpoint {r['checkpoint_bytes_estimate'] / GB:.2f} GB, largest tensor "
            f"{r['largest_tensor_bytes'] / GB:.3f} GB, RSS bound (largest + 1 GiB) {(r['largest_tensor_bytes'] + 2**30) / GB:.2f} GB"]

    def line(name, m, extra=""):
        cached = f", {m['cached_before']:.0%} cached before" if "cached_before" in m else ""
        rs = f", RSS +{m['rss_growth'] / 2**20:.0f} MiB ({'within' if m['rss_within_bound'] else 'OVER'} bound)" \
            if "rss_growth" in m else ""
        rows.append(f"  {name:<28} {m['s']:7.1f} s  {m['GBps']:6.2f} GB/s{rs}{cached}{extra}")
    line("dd HF shards (cold)", r["dd_hf"])
    line("load from HF layout", r["load_hf"])
    if "convert" in r:
        line("convert", r["convert"], f", wrote {r['convert']['written_bytes'] / GB:.2f} GB")
        line("dd container (cold)", r["dd_container"])
        line("load container (verify)", r["load_container"])
        line("load container (no verify)", r["load_container_no_verify"])
        rows.append(f"  planes equal: {r['planes']['equal']} ({r['planes']['compared']} compared)")
    rows.append(f"  greedy tokens equal: {r['tokens']['equal']} {r['tokens']['hf']}")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="lab/qwen3.8-9b.yaml")
    p.add_argument("--work", default="/tmp/ninfer-ckpt", help="scratch folder for the checkpoint and container")
    p.add_argument("--json", default=None)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--shard-size", type=float, default=4e9)
    p.add_argument("--reuse", action="store_true", help="keep an HF checkpoint already in --work")
    p.add_argument("--no-convert", action="store_true", help="HF load only (a disk too small for both)")
    args = p.parse_args(argv)
    r = run(args)
    text = summary(r)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps({**r, "summary": text}, indent=2))
    ok = r["tokens"]["equal"] and r.get("planes", {"equal": True})["equal"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
