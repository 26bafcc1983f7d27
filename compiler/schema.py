"""schema: builds frozen dataclasses from plain YAML/JSON data with strict checking.

Owns the one error type of configuration input, `SpecError`, whose message names the key path and the
expected form. Knows nothing about models; `compiler.spec` declares the dataclasses.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any


class SpecError(ValueError):
    """A bad model spec or config: `path` is the dotted key path, the message says what was expected."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is tuple:
        return f"a list of {_describe(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(f.name for f in dataclasses.fields(tp))}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise SpecError(path, f"expected {_describe(tp)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        present = [a for a in args if a is not type(None)]
        if len(present) == 1 and dataclasses.is_dataclass(present[0]):   # an optional section: its own errors
            return build(present[0], value, path)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except SpecError:
                continue
        raise SpecError(path, f"expected {_describe(tp)}, got {value!r}")
    if origin is tuple:
        (item,) = typing.get_args(tp)[:1]
        if not isinstance(value, (list, tuple)):
            raise SpecError(path, f"expected {_describe(tp)}, got {value!r}")
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise SpecError(path, f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpecError(path, f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpecError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise SpecError(path, f"expected a string, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict):
            raise SpecError(path, f"expected a mapping, got {value!r}")
        _, vt = typing.get_args(tp)
        return {str(k): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    raise TypeError(f"schema: unsupported field type {tp!r} at {path}")


def build(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from `data`; unknown, missing and mistyped keys raise SpecError."""
    if not isinstance(data, dict):
        raise SpecError(path, f"expected {_describe(cls)}, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        where = f"{path}.{unknown[0]}" if path else unknown[0]
        raise SpecError(where, f"unknown key (expected one of: {', '.join(fields)})")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in data:
            has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
            if not has_default:
                raise SpecError(sub, f"missing key (expected {_describe(hints[name])})")
            continue
        kwargs[name] = _convert(hints[name], data[name], sub)
    try:
        return cls(**kwargs)
    except SpecError as err:  # raised by __post_init__ with a path relative to this mapping
        if path and not err.path.startswith(path):
            raise SpecError(f"{path}.{err.path}" if err.path else path, err.message) from None
        raise


def require(cond: bool, path: str, message: str) -> None:
    if not cond:
        raise SpecError(path, message)
