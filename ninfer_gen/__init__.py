"""ninfer_gen: the runtime — weights, backends, engine and CLI. `ninfer_gen.load()` is the public entry.

`load`, `Model` and the submodules are imported on first use, so the CLI's compile-only commands
(`check`, `plan`, `build`, `inspect`) start without importing torch."""
from __future__ import annotations

import importlib
import importlib.util

__all__ = ["Model", "load"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(".api", __name__), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:        # ninfer_gen.api, .reference, ...
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
