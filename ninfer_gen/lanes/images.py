"""images: what every lane adapter does for a request with images — at `validate`, its images against the
model's vision section (`check_images`); at `open`, the sequence's M-RoPE positions
(compiler.multimodal.RopePositions, which the backend turns into each call's rotary positions) and the prefix
key in which each image token stands for its picture (`prefix_key`); at each prefill chunk, the
image tokens of the chunk's placeholders, the backend's tower run over the request's images at the first chunk
that needs them and kept in the lane's private data (`images`) until its last image token is run. No model math
here.
"""
from __future__ import annotations

import hashlib

from compiler.multimodal import RopePositions, mrope_positions

from ninfer_gen.lanes.contract import LaneState


def open_images(lane: LaneState, vision) -> None:
    """A freshly opened lane of a request with images (`vision`: the spec's vision section): its positions and
    its prefix key. A text-only lane is left as it is."""
    if lane.images is not None:
        lane.seq.positions = RopePositions.of(lane.prompt, lane.images.grids, vision)
        lane.key = prefix_key(lane.prompt, lane.images, vision.image_token_id)


def chunk_images(lane: LaneState, start: int, ids: list[int], vision, encode):
    """The image tokens of the placeholders in prompt positions start .. start + len(ids) − 1 (None: none);
    `encode(pixels, grids)` is the backend's tower, run once per request; the chunk holding the last image token
    lets the encoder's rows go."""
    if lane.images is None:
        return None
    token = vision.image_token_id
    first, count = sum(t == token for t in lane.prompt[:start]), sum(t == token for t in ids)
    if not count:
        return None
    if lane.private.images is None:
        lane.private.images = encode(lane.images.pixels, lane.images.grids)
    rows = lane.private.images[first:first + count]
    if first + count == lane.private.images.shape[0]:   # the last image tokens: no later chunk needs the rows
        lane.private.images = None
    return rows


def prefix_key(prompt: list[int], images, image_token_id: int) -> list[int]:
    """The token chain a prefix checkpoint of this prompt is found by (lanes.reuse): the prompt itself, with
    each image token replaced by a negative id drawn from its image's content digest and its place in the
    image — two prompts share a checkpoint only where their images are the same pictures, not only the same
    placeholders. The images (vision.preprocess.Processed) fill the placeholders in order."""
    if images is None:
        return list(prompt)
    counts, digests = list(images.tokens), list(images.digests)
    key, image, offset = [], 0, 0
    for tok in prompt:
        if tok != image_token_id:
            key.append(tok)
            continue
        if offset == counts[image]:
            image, offset = image + 1, 0
        h = hashlib.blake2b(digests[image] + offset.to_bytes(4, "little"), digest_size=7).digest()
        key.append(-1 - int.from_bytes(h, "little"))
        offset += 1
    return key


def check_images(request, vision, tower: bool) -> None:
    """A request's images against the model's vision section (`vision`, None: a text model) and whether its
    tower runs here: placeholders and images must match one for one (compiler.multimodal.mrope_positions says
    where not); a prompt with placeholders needs its images."""
    images = request.images
    if images is None:
        if vision is not None and vision.image_token_id in request.prompt:
            raise ValueError(f"the prompt holds image placeholder tokens (id {vision.image_token_id}) but no images")
        return
    if vision is None:
        raise ValueError("this model has no vision tower: it takes text only")
    if not tower:
        raise ValueError("the vision tower is not loaded here: this model takes text only")
    if images.merge_size != vision.spatial_merge_size:
        raise ValueError(f"the images were preprocessed for a {images.merge_size}×{images.merge_size} merge, the "
                         f"model merges {vision.spatial_merge_size}×{vision.spatial_merge_size}")
    if images.pixels.shape[1] != vision.patch_dim:
        raise ValueError(f"the images' patch rows have {images.pixels.shape[1]} values, the model's tower takes "
                         f"{vision.patch_dim}")
    mrope_positions(list(request.prompt), images.grids, vision)
