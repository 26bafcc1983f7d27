"""streaming: tensors read one at a time onto a device, a few reads ahead on worker threads, handed on in
a fixed order and dropped by the caller before host memory holds more than about one tensor.

Owns the read-ahead bound (bytes in flight), the byte progress bar, and errors that name the file and
tensor: a corrupt value, a quantisation that cannot be done. `stream_formatted` gives an HF checkpoint's
tensors in the spec's recipe formats, quantised where they landed (on the GPU for a GPU load).
"""
from __future__ import annotations

import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch
from tqdm import tqdm

from compiler.spec import format_of

from .checkpoint import Checkpoint, weight_table
from .safetensors_io import CheckpointError, Reader
from .stream_quant import check_finite, to_format

T = TypeVar("T")
R = TypeVar("R")
HOST_INFLIGHT = 16 << 20        # bytes read ahead into host memory (beyond the one tensor being handed on)
DEVICE_INFLIGHT = 2 << 30       # bytes read ahead into device memory (reads to the GPU stage through pinned buffers)


def workers_for(device) -> int:
    """Reader threads: a few for a GPU (reads, hashes and copies overlap); two for the host, where
    quantising is the slower half and more read-ahead would only hold more memory."""
    return max(1, min(4 if torch.device(device).type == "cuda" else 2, os.cpu_count() or 1))


def prefetch(items: Iterable[T], load: Callable[[T], R], size: Callable[[T], int], workers: int,
             budget: int) -> Iterator[tuple[T, R]]:
    """(item, load(item)) in the order of `items`, loads running ahead on `workers` threads while the
    bytes of loaded-but-not-yet-released items stay within `budget` (one item always goes, whatever its
    size). An item is released when the consumer asks for the next one."""
    it = iter(items)
    pending: deque = deque()
    inflight = 0
    nxt = next(it, None)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ninfer-read") as pool:
        try:
            while pending or nxt is not None:
                while nxt is not None and len(pending) < 2 * workers and \
                        (not pending or inflight + size(nxt) <= budget):
                    pending.append((nxt, pool.submit(load, nxt)))
                    inflight += size(nxt)
                    nxt = next(it, None)
                item, future = pending.popleft()
                result = future.result()
                yield item, result
                del result
                inflight -= size(item)
        finally:
            for _, future in pending:
                future.cancel()


def progress_bar(total: int, desc: str, show: bool) -> tqdm:
    """Bytes with throughput (B/s); `show` False hides it, True shows it where stderr is a terminal."""
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=None if show else True)


def stream_formatted(ckpt: Checkpoint, device="cpu", progress: bool = False,
                     workers: int | None = None) -> Iterator[tuple[str, object]]:
    """(canonical name, tensor in its recipe format on `device`: a QTensor, or a bf16 / fp32 tensor) for
    every tensor of the checkpoint (the vision tower's too, where it was opened with it), in file order."""
    device = torch.device(device)
    roles = {t.name: t for t in weight_table(ckpt.spec)}
    host = device.type == "cpu"
    items = ckpt.in_file_order()
    with Reader(device) as reader, progress_bar(ckpt.nbytes, f"loading {ckpt.path.name}", progress) as bar:
        loads = prefetch(items, lambda kv: reader.read(kv[1]), lambda kv: kv[1].nbytes,
                         workers or workers_for(device), HOST_INFLIGHT if host else DEVICE_INFLIGHT)
        for (name, entry), raw in loads:
            if raw.dtype not in (torch.bfloat16, torch.float32):
                raw = raw.to(torch.float32)       # as load_checkpoint reads it: exact for F16, once-rounded F64
            fmt = format_of(ckpt.spec, roles[name])
            if fmt in ("bf16", "fp32") and not check_finite(raw):
                raise CheckpointError(f"{entry.where} holds NaN or inf values: a corrupt shard?")
            try:
                value = to_format(raw, fmt)
            except ValueError as err:
                raise CheckpointError(f"{entry.where}: cannot convert to {fmt} (role {roles[name].role}): "
                                      f"{err}") from None
            del raw
            bar.update(entry.nbytes)
            yield name, value
