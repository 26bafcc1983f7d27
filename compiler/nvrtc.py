"""nvrtc: compiles one CUDA C++ source to CUBIN (for an sm_XX) or PTX (for a compute_XX) with NVRTC.

Owns the NVRTC calls, the include directories (found with cuda.pathfinder, never hard-coded) and the
parsing of the `--ptxas-options=-v` report. Never loads a module or touches a GPU.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cuda.bindings import nvrtc
from cuda.pathfinder import locate_nvidia_header_directory


class KernelCompileError(RuntimeError):
    """NVRTC refused a source: the message holds the rendered file's path and the full NVRTC log."""

    def __init__(self, name: str, source_path: str | None, log: str):
        self.name, self.source_path, self.log = name, source_path, log
        where = f" (rendered source: {source_path})" if source_path else ""
        super().__init__(f"NVRTC failed to compile {name}{where}:\n{log}")


@dataclass(frozen=True)
class Resources:
    """ptxas report for one entry: registers, static shared memory, stack frame and spills (bytes)."""
    registers: int = 0
    smem_bytes: int = 0
    stack_bytes: int = 0           # local-memory frame per thread (spills land there)
    spill_stores: int = 0
    spill_loads: int = 0

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass
class CompileResult:
    image: bytes                       # cubin or PTX text (NUL-terminated as NVRTC gives it)
    log: str
    seconds: float
    resources: dict[str, Resources] = field(default_factory=dict)


def _check(result, what: str):
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what}: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1] if len(result) == 2 else result[1:]


@lru_cache(maxsize=1)
def version() -> str:
    major, minor = _check(nvrtc.nvrtcVersion(), "nvrtcVersion")
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def cuda_include_dir() -> str:
    """Headers for cuda_bf16.h / cuda_fp16.h: NVRTC 13.0 has no built-in copy of them."""
    located = locate_nvidia_header_directory("cudart")
    if located is None:
        raise RuntimeError("cuda_bf16.h not found: install nvidia-cuda-runtime==13.0.* (cuda.pathfinder found "
                           "no cudart header directory)")
    return str(getattr(located, "abs_path", located))


_FUNC = re.compile(r"(?:Compiling entry function|Function properties for) '?([A-Za-z_]\w*)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, Resources]:
    """Registers, static smem, stack and spills per entry from a `--ptxas-options=-v` log."""
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        if m := _FUNC.search(line):
            current = found.setdefault(m.group(1), {})
        if current is None:
            continue
        if m := _FRAME.search(line):
            current.update(stack_bytes=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        if m := _USED.search(line):
            current["registers"] = int(m[1])
            if s := _SMEM.search(line):
                current["smem_bytes"] = int(s[1])
    return {name: Resources(**vals) for name, vals in found.items()}


def compile_source(source: str, name: str, arch: str, options: list[str], *,
                   ptx: bool = False, source_path: str | None = None) -> CompileResult:
    """Compile `source` (program name `name`.cu) for `arch` (sm_XX); `ptx=True` gives compute_XX PTX.

    `options` are the caller's extra options (includes, -std); the arch option is added here.
    """
    # sm_XX gives a cubin for exactly that arch (what the runtime loads); compute_XX gives portable PTX.
    arch_opt = f"--gpu-architecture={'compute_' + arch[3:] if ptx else arch}"
    # -v: ptxas reports registers, shared memory, stack and spills per entry (parsed into `resources`).
    # --no-cache: NVRTC (12.9+) keeps compiles in a cache beside the driver's, and a hit returns the image
    # with an empty log, so no report. Per compile, unlike CUDA_CACHE_DISABLE, which NVRTC reads once when
    # its cache first initialises (`--enable-cache-trace` shows both) and which would be process-wide.
    opts = [arch_opt, *options] + ([] if ptx else ["--ptxas-options=-v", "--no-cache"])
    t0 = time.perf_counter()
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []),
                  "nvrtcCreateProgram")
    try:
        err = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])[0]
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        # NVRTC writes into the buffer: a bytearray of our own. `b" " * 1` is CPython's shared one-byte object,
        # and an empty log (size 1, "\0") written into it turned every b" " of the process into b"\0".
        buf = bytearray(size)
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = bytes(buf).rstrip(b"\0").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise KernelCompileError(name, source_path, log)
        getsize, get = (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX) if ptx else \
            (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN)
        size = _check(getsize(prog), "get image size")
        out = bytearray(size)
        _check(get(prog, out), "get image")
        image = bytes(out)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    seconds = time.perf_counter() - t0
    return CompileResult(image, log, seconds, {} if ptx else parse_ptxas(log))


def include_options(template_dir: str | Path) -> list[str]:
    """cuda_bf16.h / cuda_fp16.h (NVRTC 13.0 ships none) and the templates' `common/*.cuh`."""
    return [f"-I{cuda_include_dir()}", f"-I{Path(template_dir).resolve()}"]
