"""build_cache: `build/<sm_XX>/<family>/<name>-<hash12>/` folders and the parallel `build_kernels` driver.
PTX-only builds (an arch path, run on a newer device through the driver's JIT) live apart, in
`build/<sm_XX>-ptx/...`, under their own hash.

Owns cache lookup (a hit does no NVRTC work), the process pool, the progress bar and the summary.
The compile itself happens in compiler.build_worker; `no_jit=True` turns any miss into an error.
"""
from __future__ import annotations

import json
import os
import time
import queue
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from . import codegen, nvrtc
from .build_worker import compile_job
from .kernels import KernelKey
from .targets import parse_arch

DEFAULT_ROOT = Path(__file__).resolve().parent.parent / "build"


class KernelCacheMiss(RuntimeError):
    """no_jit mode found a kernel that was never built."""


@dataclass(frozen=True)
class BuiltKernel:
    key: KernelKey
    dir: Path
    meta: dict

    @property
    def cubin(self) -> Path:
        return self.dir / "kernel.cubin"

    @property
    def ptx(self) -> Path:
        return self.dir / "kernel.ptx"


@dataclass
class BuildSummary:
    kernels: int = 0
    compiled: int = 0
    cached: int = 0
    seconds: float = 0.0
    max_registers: int = 0
    spills: int = 0
    built: list[BuiltKernel] = field(default_factory=list)

    def table(self) -> str:
        return (f"kernels {self.kernels} | compiled {self.compiled} | cached {self.cached} | "
                f"seconds {self.seconds:.1f} | max registers {self.max_registers} | spills {self.spills}")

    def by_name(self) -> dict[str, BuiltKernel]:
        return {b.key.name: b for b in self.built}


def kernel_dir(root: Path, key: KernelKey, digest: str, ptx_only: bool = False) -> Path:
    return Path(root) / (key.arch + ("-ptx" if ptx_only else "")) / key.family / f"{key.name}-{digest}"


def _job(rendered: codegen.Rendered, out: Path, ptx: bool, ptx_only: bool = False) -> dict:
    key = rendered.key
    meta = {"name": key.name, "family": key.family, "key": key.fields(), "hash": rendered.hash,
            "arch": key.arch, "template": rendered.template, "nvrtc_version": nvrtc.version(),
            "nvrtc_options": list(rendered.options), "image": "ptx" if ptx_only else "cubin",
            "gpu_architecture": codegen.image_arch(key, ptx_only)}
    return {"name": key.name, "arch": key.compile_arch, "source": rendered.source, "options": list(rendered.options),
            "include_options": nvrtc.include_options(codegen.TEMPLATE_DIR), "out_dir": str(out),
            "ptx": ptx and not ptx_only, "ptx_only": ptx_only, "meta": meta}


class _Worker:
    """One `python -m compiler.build_worker` process: a clean interpreter (no torch, no CUDA context),
    started in the repository root so `-m` finds the compiler package there."""

    def __init__(self):
        root = str(Path(__file__).resolve().parent.parent)
        self.proc = subprocess.Popen([sys.executable, "-m", "compiler.build_worker"], cwd=root,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def run(self, job: dict) -> dict:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"build worker died while compiling {job['name']}")
        answer = json.loads(line)
        if "error" in answer:
            raise nvrtc.KernelCompileError(job["name"], answer["source_path"], answer["error"])
        return answer["ok"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait()


def _run_jobs(jobs: list[dict], n_jobs: int, progress: bool) -> None:
    bar = None
    if progress and jobs:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc="nvrtc", unit="kernel", leave=False)
    try:
        if n_jobs <= 1:
            for job in jobs:
                compile_job(job)
                bar and bar.update()
            return
        todo = queue.SimpleQueue()
        for job in jobs:
            todo.put(job)

        def drain():
            worker = _Worker()
            try:
                while True:
                    try:
                        job = todo.get_nowait()
                    except queue.Empty:
                        return
                    worker.run(job)
                    bar and bar.update()
            finally:
                worker.close()

        with ThreadPoolExecutor(n_jobs) as pool:
            for fut in [pool.submit(drain) for _ in range(n_jobs)]:
                fut.result()
    finally:
        bar and bar.close()


def build_kernels(keys, arch: str | None = None, jobs: int | None = None, *, root: Path | str = DEFAULT_ROOT,
                  ptx: bool = False, ptx_only: bool = False, no_jit: bool = False,
                  progress: bool = True) -> BuildSummary:
    """Render, look up and compile `keys` (re-targeted to `arch` when given); returns a BuildSummary.
    `ptx`: compute_XX PTX beside each cubin; `ptx_only`: PTX and no cubin, in `<sm_XX>-ptx/` (no ptxas
    report: registers and spills read 0 there, the driver's JIT decides them on the device)."""
    t0 = time.perf_counter()
    if arch is not None:
        arch = parse_arch(arch)
        keys = [replace(k, arch=arch) for k in keys]
    keys = list(dict.fromkeys(keys))                    # order-preserving de-duplication
    version = nvrtc.version()
    summary, pending, dirs = BuildSummary(kernels=len(keys)), [], {}
    for key in keys:
        rendered = codegen.render(key, version, ptx_only=ptx_only)
        out = kernel_dir(Path(root), key, rendered.hash, ptx_only)
        dirs[key.name] = (key, out)
        if (out / "meta.json").is_file() and (not (ptx or ptx_only) or (out / "kernel.ptx").is_file()):
            summary.cached += 1
            continue
        if no_jit:
            raise KernelCacheMiss(f"{key.name} is not built (expected {out}); run `ninfer-gen build` first")
        pending.append(_job(rendered, out, ptx, ptx_only))
    n_jobs = max(1, min(jobs or os.cpu_count() or 1, len(pending) or 1))
    _run_jobs(pending, n_jobs, progress)
    summary.compiled = len(pending)
    for key, out in dirs.values():
        meta = json.loads((out / "meta.json").read_text())
        summary.built.append(BuiltKernel(key, out, meta))
        summary.max_registers = max(summary.max_registers, meta["registers"])
        summary.spills += meta["spill_stores"] + meta["spill_loads"]
    summary.seconds = time.perf_counter() - t0
    return summary


def find_built(key: KernelKey, root: Path | str = DEFAULT_ROOT, ptx_only: bool = False) -> BuiltKernel:
    """The cached build of one key, never compiling (the serving path)."""
    return build_kernels([key], root=root, ptx_only=ptx_only, no_jit=True, progress=False).built[0]
