"""ninfer_gen: the runtime — weights, backends, engine and CLI. `ninfer_gen.load()` is the public entry."""
from .api import Model, load

__all__ = ["Model", "load"]
