"""multimodal: how images enter the text model — each image's placeholder token repeated once per image token,
the 3-axis M-RoPE positions of a prompt with images (HF `get_rope_index` for images) and of the tokens after it
(`RopePositions`: what a backend's sequence carries), and the eager, stateless
reference forward of such a prompt (the encoder, then the text model with image tokens and M-RoPE).

Host-side arithmetic over token ids and grids; the model math stays in compiler.model and compiler.vision_model.
Text-only prompts never come here: their positions are the 1-D ones, unchanged.
"""
from __future__ import annotations

from . import model, vision_model
from .ops import EagerOps
from .spec import ModelSpec
from .spec_vision import VisionSpec


def image_token_counts(grids, merge: int) -> list[int]:
    """Image tokens per image: its merged patches."""
    return [t * h * w // (merge * merge) for t, h, w in grids]


def expand_image_placeholders(ids: list[int], counts: list[int], image_token_id: int) -> list[int]:
    """Each image placeholder (one `image_token_id` per image, as a chat template writes it) repeated to the
    image's token count."""
    out, seen = [], 0
    for tok in ids:
        if tok != image_token_id:
            out.append(tok)
            continue
        if seen == len(counts):
            raise ValueError(f"the prompt has more image placeholders than its {len(counts)} images")
        out += [tok] * counts[seen]
        seen += 1
    if seen != len(counts):
        raise ValueError(f"the prompt has {seen} image placeholders for {len(counts)} images")
    return out


def mrope_positions(ids: list[int], grids, vision: VisionSpec) -> tuple[list[tuple[int, int, int]], int]:
    """(temporal, height, width) RoPE position of every token, and the offset `delta` of the tokens after the
    prompt (token i > prompt gets i + delta on all three axes). Text continues one past the running position on
    all axes; an image's tokens (a run of placeholders, in order of `grids`) sit at the running position plus
    their merged row and column, and advance it by the image's longer merged side."""
    m = vision.spatial_merge_size
    counts = image_token_counts(grids, m)
    out: list[tuple[int, int, int]] = []
    current, i, image = 0, 0, 0
    while i < len(ids):
        if ids[i] != vision.image_token_id:
            out.append((current, current, current))
            current, i = current + 1, i + 1
            continue
        run = i
        while run < len(ids) and ids[run] == vision.image_token_id:
            run += 1
        if image == len(grids) or run - i != counts[image]:
            have = f"{counts[image]} for image {image + 1}" if image < len(grids) else f"{len(grids)} images"
            raise ValueError(f"a run of {run - i} image placeholders at token {i} does not match the images ({have})")
        t, h, w = grids[image]
        out += [(current + f, current + r, current + c) for f in range(t) for r in range(h // m) for c in range(w // m)]
        current += max(h, w) // m
        i, image = run, image + 1
    if image != len(grids):
        raise ValueError(f"the prompt has placeholders for {image} of its {len(grids)} images")
    top = max((max(p) for p in out), default=-1)
    return out, top + 1 - len(ids)


class RopePositions:
    """The RoPE positions of a sequence whose prompt has images: the prompt's 3-axis positions (mrope_positions),
    then p + delta on all three axes for every later cache position p."""

    def __init__(self, prompt_positions: list[tuple[int, int, int]], delta: int):
        import torch

        self.prompt = torch.tensor(prompt_positions, dtype=torch.int32).reshape(-1, 3)
        self.delta = delta

    @classmethod
    def of(cls, ids: list[int], grids, vision: VisionSpec) -> "RopePositions":
        return cls(*mrope_positions(ids, grids, vision))

    def rows(self, start: int, count: int):
        """i32[count, 3]: the positions of cache positions start .. start + count − 1."""
        import torch

        n = self.prompt.shape[0]
        head = self.prompt[min(start, n):min(start + count, n)]
        tail = torch.arange(max(start, n), max(start + count, n), dtype=torch.int32) + self.delta
        return torch.cat([head, tail[:, None].expand(-1, 3)])


def multimodal_forward(spec: ModelSpec, params: dict, ids: list[int], pixels, grids):
    """Eager, stateless reference of one prompt with images (placeholders already expanded): logits [T, vocab]
    and final-norm hidden [T, hidden]. `params`: text and vision tensors by canonical name; pixels as
    ninfer_gen.vision.preprocess makes them, as a tensor."""
    import torch

    dtype = "bf16" if pixels.dtype == torch.bfloat16 else "f32"
    images = vision_model.encode(spec, params, pixels, grids)
    pos3, _ = mrope_positions(ids, grids, spec.vision)
    device = pixels.device
    tokens = torch.tensor([ids], dtype=torch.int32, device=device)
    batch = model.Batch(1, len(ids), torch.zeros(1, dtype=torch.int32, device=device),
                        mrope=torch.tensor(pos3, dtype=torch.int32, device=device))
    return model.forward(EagerOps(dtype), spec, params.__getitem__, tokens, batch, images=images)
