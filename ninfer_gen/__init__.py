"""ninfer_gen: the runtime, in layers that each import only those below them — cli (the command and
its environment edge) → engine (load, Model, sampling, tokenizer) → backends (`reference`, and the GPU
backend in executor) → allocators (KV blocks, state slots, sequences) → executor (device weights and
state, module loading, the executable, the memory plan) → the compiler. `weights` loads host-side weights.
`ninfer_gen.load()` is the public entry.

`load`, `Model` and the submodules are imported on first use, so the CLI's compile-only commands
(`check`, `plan`, `build`, `inspect`) start without importing torch."""
from __future__ import annotations

import importlib
import importlib.util

__all__ = ["Model", "load"]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(".api", __name__), name)
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:        # ninfer_gen.engine, .reference, ...
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
