"""_torch: `torch` for compiler modules that use it only inside functions (references, quantisation,
weight packing). The build path — trace, passes, lowering, codegen, the NVRTC cache — never touches a
tensor, and `import torch` is ~2 s of a warm `ninfer-gen build`; so the real import happens at the
first attribute access (`torch.float32`, `torch.nn.functional.silu`, ...), not at module import.
"""
from __future__ import annotations

import importlib


class _Deferred:
    """Stands for a module until an attribute is read from it; then imports it (once; sys.modules
    caches it) and forwards."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<deferred module {self._name!r}>"


torch = _Deferred("torch")
F = _Deferred("torch.nn.functional")
