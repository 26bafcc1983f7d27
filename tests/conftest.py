"""Shared pytest setup: the `gpu` marker skips cleanly on machines without a usable CUDA driver; the
`slow_gpu` marker (statistical GPU cases, minutes each) skips unless `-m` names it or NINFER_SLOW_GPU=1, so
`pytest -m gpu` stays within its 5-minute budget; the `sweep` marker (exhaustive NVRTC compile sweeps, minutes of CPU:
CI compiles a sample of the same keys) skips unless `-m` names it or NINFER_SWEEP=1 — the GPU session scripts run
them on the device machine's cores; torch's OpenMP threads sleep instead of spinning when idle
(OMP_WAIT_POLICY=PASSIVE, set before torch loads: on a busy 2-core machine spinning threads stall each
other — the same bits, up to 10× slower decode); after each module that used CUDA, unreachable objects are
collected and the allocator's cache emptied, so a module's models (a backend's graphs and buffers hold reference
cycles) never count against the next module's memory budget.

Also the session's kernel cache (`kernel_cache`: one build root for every NVRTC compile test, so a key two tests
build compiles once; the folder names hash the exact source) and its background build: tests marked
`prebuild(keys=keys_fn, **build_kwargs)` run last in the session, and a process at idle CPU priority
(tests/kernel_prebuild.py; started with the session, so its imports overlap the collection) compiles their keys
(`keys_fn` of the test's parameters, the function the test builds from; last test first) into that cache once they
are collected — on CI's 2 cores the other tests leave most of a core idle, and the NVRTC work (~400 CPU-seconds)
soaks it up instead of running after them. NINFER_PREBUILD=0 turns the background build off."""
import gc
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def _gpu_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


@pytest.fixture
def one_thread():
    """torch on one CPU thread for the test: a bit-for-bit comparison of two torch CPU computations holds
    the bits our code decides only when both run on the same thread split (tests/rounding.py says why)."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def one_thread_module():
    """torch on one CPU thread for a whole module, restored afterwards: the tiny spec's ops are microseconds, and on
    a busy 2-core box a second intra-op thread only spin-waits (test_hf_parity ran 137 s instead of 16 s).
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread_module")`."""
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def release_gpu_memory_after_module():
    """Whole-tier runs: the 27B Q4_K_M backend of test_kquant_gpu (16 GiB) was still allocated when
    test_long_context_gpu's 128K reference needed its 3 GiB under the 24 GiB cap a load had set (4 OOM failures,
    session 18; the file alone passes)."""
    yield
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()


def _asked(config, marker: str, env: str) -> bool:
    return marker in (config.getoption("markexpr") or "") or os.environ.get(env) == "1"


def pytest_collection_modifyitems(config, items):
    # compile tests last (order otherwise kept), so that the background build has the other tests' time to work in
    items[:] = [i for i in items if not i.get_closest_marker("prebuild")] + \
               [i for i in items if i.get_closest_marker("prebuild")]
    for marker, env, what in (("slow_gpu", "NINFER_SLOW_GPU", "slow statistical GPU case"),
                              ("sweep", "NINFER_SWEEP", "exhaustive compile sweep (CI compiles a sample)")):
        if not _asked(config, marker, env):
            skip = pytest.mark.skip(reason=f"{what}: run with -m {marker} or {env}=1")
            for item in items:
                if marker in item.keywords:
                    item.add_marker(skip)
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_PREBUILD: dict = {}        # "root": the session's kernel cache; "proc": the background build


@pytest.fixture(scope="session")
def nvrtc():
    """NVRTC with the CUDA headers, or the test skips (no cuda-bindings / NVRTC / headers on this machine)."""
    try:
        from compiler import nvrtc as module
        module.version()
        module.cuda_include_dir()
    except Exception as err:
        pytest.skip(f"NVRTC unavailable: {err}")
    return module


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory) -> Path:
    """The session's kernel build root (a key compiles once per session; the background build fills it)."""
    if "root" not in _PREBUILD:
        _PREBUILD["root"] = tmp_path_factory.mktemp("kernels")
    return _PREBUILD["root"]


@pytest.fixture(scope="session")
def adopt_kernels(kernel_cache):
    """A function that moves the kernel folders another build root holds (a `ninfer-gen build --build-dir` of a
    test, after its checks) into the session's cache, each with one rename: a folder's name is the hash of its
    exact source, so it is the cache entry build_kernels would have compiled. A key the cache has already stays."""
    def adopt(root: Path) -> int:
        moved = 0
        for src in Path(root).glob("*/*/*"):
            if src.name.startswith(".") or src.suffix == ".failed" or not (src / "meta.json").is_file():
                continue
            dest = kernel_cache / src.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                src.rename(dest)
                moved += 1
            except OSError:         # built already (by a test or the background build)
                pass
        return moved
    return adopt


def _prebuild_jobs(items) -> list[dict]:
    jobs = []
    for item in items:
        mark = item.get_closest_marker("prebuild")
        if mark is None or item.get_closest_marker("skip"):
            continue
        fn, kwargs = mark.kwargs["keys"], {k: v for k, v in mark.kwargs.items() if k != "keys"}
        params = getattr(getattr(item, "callspec", None), "params", {})
        job = {"module": fn.__module__, "fn": fn.__name__, "kwargs": kwargs,
               "params": {n: params[n] for n in inspect.signature(fn).parameters if n in params}}
        if job not in jobs:
            jobs.append(job)
    return jobs


def pytest_sessionstart(session):
    """The background build's process starts before collection (its imports overlap the collection's, which runs on
    one core); it waits for its jobs on stdin."""
    config = session.config
    if config.option.collectonly or os.environ.get("NINFER_PREBUILD") == "0":
        return
    _PREBUILD["root"] = root = config._tmp_path_factory.mktemp("kernels")
    with open(root / "prebuild.log", "w") as log:
        _PREBUILD["proc"] = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("kernel_prebuild.py"))], stdin=subprocess.PIPE,
            stdout=log, stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).resolve().parent.parent)


def pytest_collection_finish(session):
    proc = _PREBUILD.get("proc")
    if proc is None:
        return
    jobs = _prebuild_jobs(session.items)
    if all(i.get_closest_marker("prebuild") for i in session.items):
        jobs = []               # no other test to overlap with: the compile tests build their keys themselves
    try:
        proc.stdin.write(json.dumps({"root": str(_PREBUILD["root"]), "jobs": jobs}))
        proc.stdin.close()
    except OSError:             # it died: the tests build everything themselves
        pass


def pytest_sessionfinish(session):
    proc = _PREBUILD.pop("proc", None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
