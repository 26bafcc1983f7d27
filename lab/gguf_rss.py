"""gguf_rss: host RSS growth of a GGUF file's host-side paths against issue 34's bound (largest tensor + 1 GiB),
each mode in a fresh subprocess, cold (the file's pages evicted first), after a warm-up of the same mode on a
small file: `stream` — open_gguf and iter_tensors, each tensor dropped (what the GPU's streaming load reads on
the host), `convert` — convert_gguf into a container on the CPU (formats kept), `gpu` (needs CUDA) — from_stream
onto the device, the GPU load itself. Without --gguf it writes the spec's Q4_K_M-style file (tools/synth_gguf)
after checking free disk; what it wrote goes afterwards unless --keep. Prints and writes JSON.

    PYTHONPATH=. python3 -m lab.gguf_rss --work /tmp/gguf-rss --json lab/results/gguf_rss_cpu_<date>.json
    PYTHONPATH=. python3 -m lab.gguf_rss --gguf /scratch/qwen3.8-27b-q4_k_m.gguf --modes stream,gpu
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30
SLACK = 2 * GiB                     # free disk kept beyond what the run writes


def small_spec():
    """The tiny spec at widths every k-quant takes (each matrix's K a multiple of 256): the warm-up file."""
    from compiler.spec import load_spec, spec_from_dict
    from ninfer_gen.weights.container import spec_dict

    data = spec_dict(load_spec(ROOT / "model_specs" / "qwen3.8-tiny.yaml"))
    data["model"].update(hidden_size=256, intermediate_size=512)
    data["model"]["linear_attention"]["value_head_dim"] = 128
    data["name"] = "qwen3.8-tiny-k"
    return spec_from_dict(data)


# ---------------------------------------------------------------- one mode, in a child process

def _stream(path: Path, out: Path | None) -> dict:
    from ninfer_gen.weights.gguf_load import iter_tensors, open_gguf

    g = open_gguf(path)
    n = 0
    for _, value in iter_tensors(g):
        n += 1
        del value
    return {"tensors": n, "read_bytes": g.nbytes}


def _convert(path: Path, out: Path | None) -> dict:
    from ninfer_gen.weights.convert import convert_gguf

    r = convert_gguf(path, out, overwrite=True)
    return {k: r[k] for k in ("read_bytes", "written_bytes", "shards", "tensors", "device")}


def _gpu(path: Path, out: Path | None) -> dict:
    import torch

    from ninfer_gen.executor.device_weights import from_stream
    from ninfer_gen.weights.gguf_load import iter_tensors, open_gguf

    g = open_gguf(path)
    weights = from_stream(g.spec, iter_tensors(g), device="cuda")
    r = {"device": torch.cuda.get_device_name(), "device_weight_bytes": weights.nbytes, "read_bytes": g.nbytes}
    del weights
    torch.cuda.empty_cache()
    return r


MODES = {"stream": _stream, "convert": _convert, "gpu": _gpu}


def child(mode: str, path: Path, small: Path, work: Path) -> dict:
    """Warm-up (imports, allocator, CUDA context) on `small`, then `mode` on `path` under PeakRSS, cold."""
    from lab.checkpoint_bench import timed

    from ninfer_gen.weights.gguf_load import open_gguf

    fn, containers = MODES[mode], (work / "warmup_container", work / "container")
    fn(small, containers[0])
    largest = max(int(t.n_bytes) for t in open_gguf(path).entries.values())
    try:
        out, r = timed(lambda: fn(path, containers[1]), [path], path.stat().st_size, largest + GiB)
    finally:
        for c in containers:
            shutil.rmtree(c, ignore_errors=True)
    return {**out, **r}


# ---------------------------------------------------------------- the run

def _run_child(mode: str, path: Path, small: Path, work: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "lab.gguf_rss", "--child", mode, "--gguf", str(path), "--small", str(small),
           "--work", str(work)]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        return {"error": p.stderr.strip().splitlines()[-1] if p.stderr.strip() else f"rc {p.returncode}"}
    return json.loads(p.stdout.strip().splitlines()[-1])


def _write(spec_path: str, path: Path, seed: int, device: str, need: int) -> dict:
    free = shutil.disk_usage(path.parent).free
    if free < need + SLACK:
        raise SystemExit(f"{path.parent}: {free / 1e9:.1f} GB free, the run needs {(need + SLACK) / 1e9:.1f} GB "
                         "(the file, a container for `convert`, and slack)")
    cmd = [sys.executable, "-m", "tools.synth_gguf", str(path), "--spec", spec_path, "--seed", str(seed),
           "--device", device]
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True, check=True)   # progress on stderr
    return {"disk_free_bytes": free, **json.loads(p.stdout.strip().splitlines()[-1])}


def run(args) -> dict:
    from compiler.spec import load_spec
    from ninfer_gen.weights.gguf_load import open_gguf
    from tools.synth_gguf import plan, write_gguf

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    small = work / "warmup.gguf"
    write_gguf(small_spec(), small)
    modes = args.modes.split(",")
    result: dict = {"host": {"cpus": os.cpu_count(), "mem_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")},
                    "work": str(work), "modes": modes}
    written = None
    if args.gguf:
        path = Path(args.gguf)
    else:
        spec = load_spec(args.spec)
        path = work / f"{spec.name}-q4_k_m.gguf"
        size = sum(e.nbytes for e in plan(spec))
        written = path
        result["write"] = _write(args.spec, path, args.seed, args.device, size * (2 if "convert" in modes else 1))
    try:
        entries = open_gguf(path).entries
        largest = max(entries, key=lambda n: int(entries[n].n_bytes))
        result |= {"gguf": str(path), "file_bytes": path.stat().st_size, "tensors": len(entries),
                   "largest_tensor": largest, "largest_tensor_bytes": int(entries[largest].n_bytes)}
        result["bound_bytes"] = result["largest_tensor_bytes"] + GiB
        for mode in modes:
            t0 = time.perf_counter()
            result[mode] = _run_child(mode, path, small, work, args.timeout)
            result[mode]["wall_s"] = time.perf_counter() - t0
            print(f"{mode}: {json.dumps(result[mode])}", file=sys.stderr)
    finally:
        if written is not None and not args.keep:
            written.unlink(missing_ok=True)
        small.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spec", default=str(ROOT / "model_specs" / "qwen3.8-27b.yaml"), help="the file's shape, "
                   "when it is written here (default: the 27B)")
    p.add_argument("--gguf", default=None, help="an existing GGUF file to measure instead of writing one")
    p.add_argument("--work", default="/tmp/gguf-rss", help="folder for the written file and containers")
    p.add_argument("--modes", default=None, help="comma separated, of stream, convert, gpu (default: stream,convert "
                   "and, with CUDA, gpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where tools.synth_gguf draws the file: cpu or cuda")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per mode")
    p.add_argument("--keep", action="store_true", help="keep the written GGUF")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--small", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, Path(args.gguf), Path(args.small), Path(args.work))))
        return 0
    if args.modes is None:
        import torch
        args.modes = "stream,convert" + (",gpu" if torch.cuda.is_available() else "")
    result = run(args)
    text = json.dumps(result, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    print(text)
    failed = [m for m in result["modes"] if "error" in result[m] or not result[m].get("rss_within_bound")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
