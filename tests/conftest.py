"""Shared pytest setup: the `gpu` marker skips cleanly on machines without a usable CUDA driver; torch's
OpenMP threads sleep instead of spinning when idle (OMP_WAIT_POLICY=PASSIVE, set before torch loads: on a
busy 2-core machine spinning threads stall each other — the same bits, up to 10× slower decode)."""
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402


def _gpu_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _gpu_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
