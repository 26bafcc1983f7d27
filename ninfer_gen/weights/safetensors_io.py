"""safetensors_io: safetensors files read and written without memory maps — headers parsed and checked
(a truncated or corrupt file is a CheckpointError naming the file and tensor), tensors read with pread
into buffers of one tensor, shards written at offsets planned up front. Knows no model or tensor names.

Why no `safe_open`: a memory map keeps every page this process touched resident (and counted in its
RSS) until the file closes, so reading a shard tensor by tensor grows RSS by the whole shard (measured:
a 2 GB file read through safe_open → +1.9 GB RSS). A pread copy of one tensor keeps RSS to that tensor;
the page cache stays the kernel's.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

CHUNK = 16 << 20                 # bytes per pread / host-to-device copy
MAX_HEADER = 100 << 20           # the format's own limit on the JSON header
# safetensors dtype name → torch dtype (None: a dtype this torch cannot hold) and bytes per element
DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "F64": (torch.float64, 8), "F32": (torch.float32, 4), "F16": (torch.float16, 2), "BF16": (torch.bfloat16, 2),
    "I64": (torch.int64, 8), "I32": (torch.int32, 4), "I16": (torch.int16, 2), "I8": (torch.int8, 1),
    "U8": (torch.uint8, 1), "BOOL": (torch.bool, 1),
    "F8_E4M3": (getattr(torch, "float8_e4m3fn", None), 1), "F8_E5M2": (getattr(torch, "float8_e5m2", None), 1),
}
NAME_OF = {dt: name for name, (dt, _) in DTYPES.items() if dt is not None}


class CheckpointError(ValueError):
    """A checkpoint or container that cannot be used; the message names the directory, file or tensors."""


@dataclass(frozen=True)
class Entry:
    """One stored tensor: where its bytes lie in which file."""
    path: Path
    key: str
    dtype: str                   # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int                  # absolute byte offset in the file
    nbytes: int

    @property
    def where(self) -> str:
        return f"tensor {self.key!r} in {self.path}"


def _bad(path: Path, why: str) -> CheckpointError:
    return CheckpointError(f"cannot read safetensors file {path}: {why}")


def read_header(path: str | Path) -> dict[str, Entry]:
    """Every tensor of a safetensors file, checked against the file size and the format's rules."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n < 0 or n > min(size - 8, MAX_HEADER):
                raise _bad(path, f"the file is {size} bytes and its 8-byte header length reads {max(n, 0)}: "
                                 "truncated, or not a safetensors file")
            raw = f.read(n)
    except OSError as err:
        raise _bad(path, str(err)) from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(path, f"the header is not valid JSON ({err}): corrupt") from None
    if not isinstance(header, dict):
        raise _bad(path, "the header is not a JSON object: corrupt")
    header.pop("__metadata__", None)
    start, entries = 8 + n, {}
    for key, e in header.items():
        entries[key] = _entry(path, key, e, start)
    ends = sorted((e.offset, e.offset + e.nbytes, e.key) for e in entries.values())
    for (_, end, a), (begin, _, b) in zip(ends, ends[1:]):
        if begin < end:
            raise _bad(path, f"tensors {a!r} and {b!r} overlap: corrupt header")
    for _, end, key in ends:
        if end > size:
            raise _bad(path, f"truncated: tensor {key!r} needs bytes up to {end:,} but the file has {size:,}")
    if (ends[-1][1] if ends else start) != size:
        raise _bad(path, f"{size - (ends[-1][1] if ends else start):,} bytes follow the last tensor: corrupt")
    return entries


def _entry(path: Path, key: str, e, start: int) -> Entry:
    if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= set(e):
        raise _bad(path, f"tensor {key!r}: expected dtype, shape and data_offsets in the header, got {e!r}")
    dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    if dtype not in DTYPES:
        raise _bad(path, f"tensor {key!r} has unknown dtype {dtype!r}")
    ok = (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
          and isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
          and 0 <= offsets[0] <= offsets[1])
    if not ok:
        raise _bad(path, f"tensor {key!r} has a malformed shape {shape!r} or data_offsets {offsets!r}")
    nbytes = math.prod(shape) * DTYPES[dtype][1]
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(path, f"tensor {key!r}: {dtype} {shape} is {nbytes:,} bytes but its data_offsets span "
                         f"{offsets[1] - offsets[0]:,}: corrupt header")
    return Entry(path, key, dtype, tuple(shape), start + offsets[0], nbytes)


class Reader:
    """Reads entries onto one device. Thread-safe (pread has no shared file position). Reads to a CUDA
    device stage through two pinned buffers per thread and a stream per thread, so the next chunk's read
    overlaps the last one's copy (`staged`: the same path on the CPU, for tests)."""

    def __init__(self, device="cpu", chunk: int = CHUNK, staged: bool | None = None):
        self.device, self.chunk = torch.device(device), chunk
        self.staged = self.device.type == "cuda" if staged is None else staged
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _pread(self, e: Entry, view: memoryview, pos: int) -> None:
        fd, done = self._fd(e.path), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], e.offset + pos + done)
            if got <= 0:
                raise CheckpointError(f"{e.where}: the file ended {e.offset + pos + done:,} bytes in, inside the "
                                      "tensor: truncated while reading")
            done += got

    def read(self, e: Entry, hasher=None) -> torch.Tensor:
        """The entry as a tensor of its dtype and shape on the reader's device; `hasher` (hashlib) sees
        its bytes in order."""
        dtype = DTYPES[e.dtype][0]
        if dtype is None:
            raise CheckpointError(f"{e.where} has dtype {e.dtype}, which this torch build cannot hold")
        if not self.staged:
            out = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
            view = memoryview(out.numpy())
            for pos in range(0, e.nbytes, self.chunk):
                part = view[pos:pos + self.chunk]
                self._pread(e, part, pos)
                if hasher is not None:
                    hasher.update(part)
        else:
            out = self._read_staged(e, hasher)
        return out.view(dtype).view(e.shape)

    def _staging(self):
        local, cuda = self._local, self.device.type == "cuda"
        if getattr(local, "buffers", None) is None:
            local.buffers = [torch.empty(self.chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
            local.events = [None, None]
            local.stream = torch.cuda.Stream(self.device) if cuda else None
        return local

    def _read_staged(self, e: Entry, hasher) -> torch.Tensor:
        local = self._staging()
        out = torch.empty(e.nbytes, dtype=torch.uint8, device=self.device)
        for i, pos in enumerate(range(0, e.nbytes, self.chunk)):
            n, slot = min(self.chunk, e.nbytes - pos), i % 2
            buf = local.buffers[slot]
            if local.events[slot] is not None:
                local.events[slot].synchronize()      # the copy that last read this buffer is done
            view = memoryview(buf.numpy())[:n]
            self._pread(e, view, pos)
            if hasher is not None:
                hasher.update(view)
            if local.stream is None:
                out[pos:pos + n].copy_(buf[:n])
                continue
            with torch.cuda.stream(local.stream):
                out[pos:pos + n].copy_(buf[:n], non_blocking=True)
                local.events[slot] = torch.cuda.Event()
                local.events[slot].record(local.stream)
        if local.stream is not None:
            local.stream.synchronize()
        return out


def sha256_of(e: Entry, reader: Reader) -> str:
    """Hex sha256 of an entry's bytes (read through `reader`, which must be a CPU reader)."""
    h = hashlib.sha256()
    reader.read(e, h)
    return h.hexdigest()


def _aligned_header(meta: dict) -> bytes:
    raw = json.dumps(meta, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)          # data starts 8-byte aligned, as safetensors writes it


class ShardWriter:
    """Writes named tensors into shard files planned up front (`items`: name, dtype, shape in file
    order), in any order, each at its planned offset; records the sha256 of each (unless `hashes` is off)."""

    def __init__(self, folder: str | Path, items: list[tuple[str, str, tuple[int, ...]]], max_bytes: int,
                 stem: str = "model", metadata: dict[str, str] | None = None, hashes: bool = True):
        self.folder, self._hashing = Path(folder), hashes
        groups: list[list] = [[]]
        size = 0
        for name, dtype, shape in items:
            nbytes = math.prod(shape) * DTYPES[dtype][1]
            if groups[-1] and size + nbytes > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, tuple(shape), nbytes))
            size += nbytes
        count = len(groups)
        self.files = [f"{stem}.safetensors"] if count == 1 else \
            [f"{stem}-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        self.plan: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}  # name → file, dtype, shape, offset, n
        self._fds: dict[str, int] = {}
        for file, group in zip(self.files, groups):
            header, pos = {"__metadata__": dict(metadata or {}, format="pt")}, 0
            for name, dtype, shape, nbytes in group:
                header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
                pos += nbytes
            raw = _aligned_header(header)
            start = 8 + len(raw)
            for name, dtype, shape, nbytes in group:
                self.plan[name] = (file, dtype, shape, start + header[name]["data_offsets"][0], nbytes)
            fd = os.open(self.folder / file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            self._fds[file] = fd
            os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
            os.ftruncate(fd, start + pos)
        self.hashes: dict[str, str] = {}

    def write(self, name: str, tensor: torch.Tensor) -> str:
        if name not in self.plan:
            raise KeyError(f"tensor {name!r} is not in this writer's plan")
        file, dtype, shape, offset, nbytes = self.plan[name]
        if NAME_OF.get(tensor.dtype) != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"tensor {name!r}: planned {dtype} {list(shape)}, got {tensor.dtype} "
                             f"{list(tensor.shape)}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        h, view, fd = hashlib.sha256() if self._hashing else None, memoryview(data), self._fds[file]
        for pos in range(0, nbytes, CHUNK):
            part = view[pos:pos + CHUNK]
            if h is not None:
                h.update(part)
            done = 0
            while done < len(part):
                done += os.pwrite(fd, part[done:], offset + pos + done)
        self.hashes[name] = h.hexdigest() if h is not None else ""
        return self.hashes[name]

    def close(self, check: bool = True) -> None:
        """Closes the files; with `check`, every planned tensor must have been written (then synced)."""
        missing = [n for n in self.plan if n not in self.hashes]
        for fd in self._fds.values():
            if check and not missing:
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()
        if check and missing:
            raise CheckpointError(f"{len(missing)} planned tensor(s) never written to {self.folder}: "
                                  f"{', '.join(missing[:5])}")
