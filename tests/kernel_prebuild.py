"""What the background kernel build of a test session runs (tests/conftest.py starts it after collection, as a
script, at idle CPU priority): the keys of the collected tests marked `prebuild`, compiled one by one into the
session's kernel cache (the `kernel_cache` fixture), last test's last key first — the tests start from the first, so
when they catch up the two meet in the middle instead of compiling the same keys side by side. A test marked so still builds its
own keys there with build_kernels and checks what it checked: a kernel built here is a cache hit (its folder is named
by the hash of key, template text, NVRTC options and version — the source the test renders), one not built yet is
compiled by the test itself. A failure here is only logged (`prebuild.log` in the cache): the test compiles that key
again and reports it. Started when the session starts; reads one JSON object on stdin once it is collected:
{"root": ..., "jobs": [{"module", "fn", "params", "kwargs"}]}."""
import importlib
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def idle_priority() -> None:
    """SCHED_IDLE: CPU time only when nothing else wants it (the session's tests never wait on this process)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def main() -> None:
    idle_priority()
    parent = os.getppid()
    sys.path.insert(1, str(ROOT))            # pytest's pythonpath = ["."]; sys.path[0] is tests/ (this script's)
    import torch  # noqa: F401               # what the test modules import, loaded while the session collects
    import lab.cases  # noqa: F401
    from compiler.build_cache import build_kernels

    spec = json.load(sys.stdin)              # after collection: the jobs (none when nothing is to be built ahead)

    t0, compiled, cached = time.perf_counter(), 0, 0
    for job in reversed(spec["jobs"]):
        try:
            keys = getattr(importlib.import_module(job["module"]), job["fn"])(**job["params"])
        except Exception as err:             # the test computes its keys itself and fails there
            print(f"{job['module']}.{job['fn']}({job['params']}): {type(err).__name__}: {err}", flush=True)
            continue
        for key in reversed(list(keys)):
            if os.getppid() != parent:       # the session ended without stopping us
                return
            try:
                summary = build_kernels([key], jobs=1, root=spec["root"], progress=False, **job["kwargs"])
                compiled, cached = compiled + summary.compiled, cached + summary.cached
            except Exception as err:
                print(f"{key.name}: {type(err).__name__}: {err}", flush=True)
        print(f"{job['module']}.{job['fn']}({job['params']}): done at {time.perf_counter() - t0:.0f} s "
              f"(compiled {compiled}, cached {cached})", flush=True)


if __name__ == "__main__":
    main()
