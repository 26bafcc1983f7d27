"""images: what every lane adapter does for a request with images — at `open`, the sequence's M-RoPE positions
(compiler.multimodal.RopePositions, which the backend turns into each call's rotary positions) and the prefix
key in which each image token stands for its picture (lanes.contract.prefix_key); at each prefill chunk, the
image tokens of the chunk's placeholders, the backend's tower run over the request's images at the first chunk
that needs them and kept in the lane's private data (`images`) until the prompt is done. Computes nothing itself.
"""
from __future__ import annotations

from compiler.multimodal import RopePositions

from ninfer_gen.lanes.contract import LaneState, prefix_key


def open_images(lane: LaneState, vision) -> None:
    """A freshly opened lane of a request with images (`vision`: the spec's vision section): its positions and
    its prefix key. A text-only lane is left as it is."""
    if lane.images is not None:
        lane.seq.positions = RopePositions.of(lane.prompt, lane.images.grids, vision)
        lane.key = prefix_key(lane.prompt, lane.images, vision.image_token_id)


def chunk_images(lane: LaneState, start: int, ids: list[int], vision, encode):
    """The image tokens of the placeholders in prompt positions start .. start + len(ids) − 1 (None: none);
    `encode(pixels, grids)` is the backend's tower, run once per request. The chunk after the last image lets the
    encoder's rows go."""
    if lane.images is None:
        return None
    token = vision.image_token_id
    first, count = sum(t == token for t in lane.prompt[:start]), sum(t == token for t in ids)
    if not count:
        return None
    if lane.private.images is None:
        lane.private.images = encode(lane.images.pixels, lane.images.grids)
    return lane.private.images[first:first + count]
