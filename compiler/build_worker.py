"""build_worker: compiles one rendered kernel into its cache folder, atomically (temp dir + rename).

Runs inside build worker processes (`python -m compiler.build_worker`): a clean interpreter that imports
the compiler's NVRTC wrapper only (no torch, no CUDA context).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from . import nvrtc


def compile_job(job: dict) -> dict:
    """`job`: name, arch, source, options, include_options, out_dir, ptx, ptx_only, meta. Returns the meta dict."""
    out = Path(job["out_dir"])
    if (out / "meta.json").is_file():       # built before (or by another process after the parent looked)
        if job["ptx"] and not (out / "kernel.ptx").is_file():
            _add_ptx(job, out)
        return json.loads((out / "meta.json").read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        meta = _compile_into(tmp, job, out)
        try:
            os.rename(tmp, out)
        except OSError:                      # lost a race: the winner's folder holds the same kernel, but maybe not
            if job["ptx"] and not (out / "kernel.ptx").is_file():      # the PTX this job was asked for
                os.replace(tmp / "kernel.ptx", out / "kernel.ptx")
            shutil.rmtree(tmp, ignore_errors=True)
        return meta
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _compile_into(tmp: Path, job: dict, out: Path) -> dict:
    """Writes kernel.cu, kernel.cubin (+ kernel.ptx; or kernel.ptx alone for `ptx_only`), nvrtc.log and
    meta.json into `tmp`. A failed compile keeps its source and log in `<out>.failed/` and raises with that path."""
    (tmp / "kernel.cu").write_text(job["source"])
    opts = [*job["options"], *job["include_options"]]
    ptx_only = job.get("ptx_only", False)
    try:
        res = nvrtc.compile_source(job["source"], job["name"], job["arch"], opts, ptx=ptx_only,
                                   source_path=str(out / "kernel.cu"))
    except nvrtc.KernelCompileError as err:
        failed = out.parent / f"{out.name}.failed"
        shutil.rmtree(failed, ignore_errors=True)
        (tmp / "nvrtc.log").write_text(err.log)
        os.replace(tmp, failed)
        raise nvrtc.KernelCompileError(err.name, str(failed / "kernel.cu"), err.log) from None
    if ptx_only:
        (tmp / "kernel.ptx").write_bytes(res.image.rstrip(b"\0"))
    else:
        (tmp / "kernel.cubin").write_bytes(res.image)
    log = res.log
    if job["ptx"]:
        ptx = nvrtc.compile_source(job["source"], job["name"], job["arch"], opts, ptx=True)
        (tmp / "kernel.ptx").write_bytes(ptx.image.rstrip(b"\0"))
        log += ptx.log
    (tmp / "nvrtc.log").write_text(log)
    r = res.resources.get(job["name"], nvrtc.Resources())
    meta = dict(job["meta"], compile_seconds=round(res.seconds, 4), registers=r.registers,
                smem_bytes=r.smem_bytes, stack_bytes=r.stack_bytes, spill_stores=r.spill_stores,
                spill_loads=r.spill_loads, has_ptx=bool(job["ptx"] or ptx_only))
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


def _add_ptx(job: dict, out: Path) -> None:
    """PTX asked for later than the cubin: add it to the existing folder with an atomic rename."""
    opts = [*job["options"], *job["include_options"]]
    ptx = nvrtc.compile_source(job["source"], job["name"], job["arch"], opts, ptx=True,
                               source_path=str(out / "kernel.cu"))
    tmp = out / f".kernel.ptx.{os.getpid()}"
    tmp.write_bytes(ptx.image.rstrip(b"\0"))
    os.replace(tmp, out / "kernel.ptx")


def main() -> None:
    """Worker loop: one JSON job per stdin line, one JSON answer per stdout line."""
    for line in sys.stdin:
        try:
            answer = {"ok": compile_job(json.loads(line))}
        except nvrtc.KernelCompileError as err:  # re-raised by the parent with the same fields
            answer = {"error": err.log, "source_path": err.source_path}
        except Exception as err:
            answer = {"error": f"{type(err).__name__}: {err}", "source_path": None}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
