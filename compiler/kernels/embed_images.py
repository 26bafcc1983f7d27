"""embed_images: a prompt's image tokens into its embedding rows, in place — row r whose id is the image
placeholder `token` takes row idx of `images`, idx = the placeholders before r, while idx < min(count, cap);
other rows keep their embedding (compiler.reference_vision.embed_images).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .._torch import torch

from ..targets import Target
from . import KernelKey, Launch, Param


@dataclass(frozen=True)
class Key(KernelKey):
    family: ClassVar[str] = "embed_images"
    h: int                 # embedding width
    m: int                 # embedding rows (tokens of the run)
    cap: int               # rows of the `images` buffer
    token: int             # the image placeholder id
    arch: str

    def __post_init__(self):
        if self.h % 8 or self.h < 8 or self.m < 1 or self.cap < 1 or self.token < 0:
            raise ValueError(f"embed_images: h a multiple of 8 (16-byte copies), m ≥ 1, cap ≥ 1 and token ≥ 0 "
                             f"expected, got {self}")

    def _name_parts(self):
        return [f"h{self.h}", f"m{self.m}", f"c{self.cap}", f"t{self.token}"]


def launch(key: Key, target: Target | None = None) -> Launch:
    """One block per row: a placeholder's block counts the placeholders before it (≤ m / 128 barrier rounds)."""
    return Launch((key.m, 1, 1), (128, 1, 1), 0)


def params(key: Key) -> list[Param]:
    return [Param("y", "ptr", "in place [m, h] bf16: the embedding rows"), Param("ids", "ptr", "token ids [m] int32"),
            Param("images", "ptr", "[cap, h] bf16 image tokens, in placeholder order"),
            Param("count", "ptr", "[1] int32: image tokens this run holds (null: cap)")]


def reference(key: Key, y: torch.Tensor, ids: torch.Tensor, images: torch.Tensor, count=None) -> torch.Tensor:
    """y with its first min(count, cap) placeholder rows replaced, in order, by the rows of `images`; equal to
    compiler.reference_vision.embed_images whenever every placeholder has its image token."""
    limit = key.cap if count is None else min(int(count.reshape(-1)[0]), key.cap)
    rows = (ids.reshape(-1) == key.token).nonzero().reshape(-1)[:max(limit, 0)]
    out = y.clone()
    out[rows] = images[:rows.numel()].to(y.dtype)
    return out
