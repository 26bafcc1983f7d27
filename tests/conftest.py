"""Shared pytest setup: the `gpu` marker skips cleanly on machines without a usable CUDA driver; the
`slow_gpu` marker (statistical GPU cases, minutes each) skips unless `-m` names it or NINFER_SLOW_GPU=1, so
`pytest -m gpu` stays within its 5-minute budget; torch's OpenMP threads sleep instead of spinning when idle
(OMP_WAIT_POLICY=PASSIVE, set before torch loads: on a busy 2-core machine spinning threads stall each
other — the same bits, up to 10× slower decode); after each module that used CUDA, unreachable objects are
collected and the allocator's cache emptied, so a module's models (a backend's graphs and buffers hold reference
cycles) never count against the next module's memory budget."""
import gc
import os
import sys

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


def _slow_gpu_asked(config) -> bool:
    return "slow_gpu" in (config.getoption("markexpr") or "") or os.environ.get("NINFER_SLOW_GPU") == "1"


def pytest_collection_modifyitems(config, items):
    if not _slow_gpu_asked(config):
        slow = pytest.mark.skip(reason="slow statistical GPU case: run with -m slow_gpu or NINFER_SLOW_GPU=1")
        for item in items:
            if "slow_gpu" in item.keywords:
                item.add_marker(slow)
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
