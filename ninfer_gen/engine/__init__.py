"""engine: the cohort engine — `Engine` (admission, lanes, scheduling, finishing), what goes in and comes out
(`requests`), structured output (`grammar`), the tokenizer, and the engine over tensor-parallel ranks
(`replicated`). It drives a backend only through the contract (ninfer_gen.lanes.contract); it imports no
backend, no executor and no CUDA (ninfer_gen.api wires a model's backend under it).

The cohort engine's names are imported on first use (`from ninfer_gen.engine import Engine`)."""
from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "engine", "EngineFull": "requests", "Event": "requests", "Handle": "requests",
            "Request": "requests", "RequestStats": "requests"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
