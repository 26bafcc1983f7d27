"""engine: what a user of the engine talks to — `load()` and `Model` (api), the cohort `Engine` (engine)
and its lane adapters (lanes), sampling parameters and the sampler, the tokenizer. Picks weights and a
backend; computes nothing itself and imports no CUDA.

The cohort engine's names are imported on first use (`from ninfer_gen.engine import Engine`)."""
from __future__ import annotations

import importlib

_EXPORTS = {"Engine": "engine", "EngineFull": "requests", "Event": "requests", "Handle": "requests",
            "Request": "requests", "RequestStats": "requests", "LaneBackend": "lanes", "LaneState": "lanes", "ReferenceLanes": "lanes"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
