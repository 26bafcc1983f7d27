"""device_weights: a spec's weights on the GPU in the layouts the kernels read.

- every matrix a GEMV/GEMM multiplies: packed planes (lo, hi, scales) of `weight_layout`, with each
  MLP's gate and up fused into one `…mlp.gate_up.weight` (rows interleaved for the SiLU·mul epilogue);
- the embedding: row-major int8 codes + fp16 scales (W8G32), a bf16 table, or a GGUF k-quant's rows of
  super-blocks as stored (uint8), as `embed` reads it;
  a tied LM head gets its own packed copy;
- norms and conv weights bf16 (conv as [C, width]), GDN `A_log` / `dt_bias` fp32.

Sources: an HF checkpoint streamed one tensor at a time and quantised on the device (`from_checkpoint`),
tensors already in their formats streamed one at a time (`from_stream`: a GGUF file's),
a converted container whose planes are copied as stored (`from_container`), host tensors in the spec's
formats (`from_host`), or `random_on_device`, which draws the whole weight set on the GPU directly in its
quantised formats (seeded) so the 27B shape can be benchmarked without a checkpoint. Every source but
the last builds the same planes (`ninfer_gen.weights.planes`), bit for bit.

The vision tower never comes here: it is no plane set (the GPU runs it in torch from its float tensors,
weights.tower and executor.vision_encoder), so the checkpoint and container sources skip its tensors unread (the
spec keeps its vision section unless the caller drops it) and the packer refuses them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from compiler.kernels.weight_layout import group_of, pack_for_device, pack_kquant_for_device
from compiler.kquant import KFORMATS, KQTensor, random_kquant
from compiler.quant import QTensor
from compiler.spec import ModelSpec, format_of, tensor_table
from compiler.weights import NON_MATRIX_ROLES, lm_head_name, packed_matrices, plane_bytes, planes_of

from ninfer_gen.weights.planes import PlanePacker, device_format, split_key
from ninfer_gen.weights.random_weights import draw_tensor

# code standard deviation of a uniform draw over each format's code range (random weights at O(1) scale)
_CODE_STD = {"q4g64": 16 / math.sqrt(12), "q5g64": 32 / math.sqrt(12), "q6g64": 64 / math.sqrt(12),
             "w8g32": 256 / math.sqrt(12)}


@dataclass
class DeviceWeights:
    spec: ModelSpec
    matrices: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)   # name → packed planes
    formats: dict[str, str] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)               # norms, conv, decay params
    embed_codes: torch.Tensor | None = None          # int8 [V, h] (w8g32), bf16 [V, h] or k-quant blocks uint8
    embed_scales: torch.Tensor | None = None         # fp16 [V, h/32] (w8g32)

    @property
    def embed_format(self) -> str:
        return format_of(self.spec, next(t for t in tensor_table(self.spec) if t.name == "embed_tokens.weight"))

    def plane(self, name: str, plane: str) -> torch.Tensor:
        """A weight by its plan binding (compiler.weights): `lo`/`hi`/`scales` of a packed matrix,
        `rows`/`row_scales` of the embedding's gather table, `tensor` of a small weight."""
        if plane == "tensor":
            if name not in self.tensors:
                raise KeyError(f"weight {name!r} is not a small device tensor")
            return self.tensors[name]
        if plane in ("rows", "row_scales"):
            t = self.embed_codes if plane == "rows" else self.embed_scales
            if name != "embed_tokens.weight" or t is None:
                raise KeyError(f"no embedding plane {plane!r} of {name!r} (format {self.embed_format})")
            return t
        return self.matrix(name)[plane]

    def matrix(self, name: str) -> dict[str, torch.Tensor]:
        try:
            return self.matrices[name]
        except KeyError:
            raise KeyError(f"weight matrix {name!r} is not on the device") from None

    def put(self, plane_key: str, t: torch.Tensor) -> None:
        """Store one plane (`planes.key`) already on its device; a small tensor in its recipe format
        becomes the kernels' form here."""
        name, plane = split_key(plane_key)
        if plane == "tensor":
            self.tensors[name] = _small_tensor(name, t, t.device)
        elif plane == "rows":             # int8 codes, k-quant blocks (uint8), or a float table the gather reads as bf16
            self.embed_codes = t if t.dtype in (torch.int8, torch.uint8) else t.to(torch.bfloat16).contiguous()
        elif plane == "row_scales":
            self.embed_scales = t
        else:
            self.matrices.setdefault(name, {})[plane] = t

    def complete(self) -> "DeviceWeights":
        """Fill each matrix's empty planes (not stored) and its format; every packed matrix must be here."""
        for name, infos in packed_matrices(self.spec):
            if name not in self.matrices:
                raise KeyError(f"weight matrix {name!r} was never loaded")
            fmt = device_format(format_of(self.spec, infos[0]))
            self.formats[name] = fmt
            planes, device = self.matrices[name], self.matrices[name]["lo"].device
            for plane in ("lo", "hi", "scales"):
                if plane not in planes:
                    if plane in planes_of(fmt):
                        raise KeyError(f"plane {plane!r} of weight matrix {name!r} was never loaded")
                    planes[plane] = torch.zeros(0, dtype=torch.float16 if plane == "scales" else torch.uint8,
                                                device=device)
        return self

    @property
    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for planes in self.matrices.values() for t in planes.values())
        n += sum(t.numel() * t.element_size() for t in self.tensors.values())
        for t in (self.embed_codes, self.embed_scales):
            n += 0 if t is None else t.numel() * t.element_size()
        return n


def _small_tensor(name: str, value: torch.Tensor, device) -> torch.Tensor:
    if name.endswith(("A_log", "dt_bias")):
        return value.to(device, torch.float32).contiguous()
    if name.endswith("conv1d.weight"):
        return value.reshape(value.shape[0], -1).to(device, torch.bfloat16).contiguous()
    return value.to(device, torch.bfloat16).contiguous()


def _progress(items, desc: str, show: bool):
    if not show:
        return items
    from tqdm import tqdm
    return tqdm(items, desc=desc, unit="tensor", leave=False)


def _to(value, device):
    if isinstance(value, QTensor):
        return QTensor(value.fmt, value.codes.to(device), value.scales.to(device))
    if isinstance(value, KQTensor):
        return KQTensor(value.fmt, value.blocks.to(device), value.k)
    return value.to(device)


def from_host(spec: ModelSpec, tensors: dict, device="cuda", progress: bool = False) -> DeviceWeights:
    """`tensors`: canonical name → QTensor or float tensor in the spec's formats (checkpoint.quantize_weights)."""
    dw = DeviceWeights(spec)
    packer = PlanePacker(spec, dw.put)
    for info in _progress(tensor_table(spec), "packing weights", progress):
        packer.add(info.name, _to(tensors[info.name], device))
    packer.finish()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return dw.complete()


def from_stream(spec: ModelSpec, items, device="cuda") -> DeviceWeights:
    """(canonical name, value in the spec's formats) pairs packed on `device` as they come, one tensor in
    host memory at a time (a GGUF file's tensors: weights.gguf_load.iter_tensors)."""
    dw = DeviceWeights(spec)
    packer = PlanePacker(spec, dw.put)
    for name, value in items:
        packer.add(name, _to(value, device))
    packer.finish()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return dw.complete()


def _no_tower(vision: str) -> str:
    if vision not in ("skip", "drop"):
        raise ValueError(f"the device runs no vision tower: vision must be 'skip' (the spec keeps its vision "
                         f"section) or 'drop', got {vision!r}")
    return vision


def from_checkpoint(path, spec: ModelSpec | None = None, device="cuda", require_mtp: bool = False,
                    progress: bool = False, vision: str = "skip") -> DeviceWeights:
    """An HF checkpoint streamed onto `device`: each tensor read, quantised there by the spec's recipe,
    packed and freed before host memory holds more than about one tensor (`weights.streaming`). The vision
    tower is not read (`vision` "skip" keeps the spec's vision section, "drop" drops it)."""
    from ninfer_gen.weights.checkpoint import open_checkpoint
    from ninfer_gen.weights.streaming import stream_formatted

    ckpt = open_checkpoint(path, spec, require_mtp, _no_tower(vision))
    dw = DeviceWeights(ckpt.spec)
    packer = PlanePacker(ckpt.spec, dw.put)
    for name, value in stream_formatted(ckpt, device, progress):
        packer.add(name, value)
    packer.finish()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return dw.complete()


def from_container(path, device="cuda", verify: bool = True, spec: ModelSpec | None = None,
                   require_mtp: bool = False, progress: bool = False, vision: str = "skip") -> DeviceWeights:
    """A converted container's planes copied to `device` as stored (sha256-checked unless `verify` is
    False); `spec`, when given, must be the container's (`weights.container.open_container`). The vision
    tower's planes are not read (`vision` as in from_checkpoint)."""
    from ninfer_gen.weights.container import open_container, read_planes

    box = open_container(path, spec=spec, require_mtp=require_mtp, vision=_no_tower(vision))
    dw = DeviceWeights(box.spec)
    for plane_key, t in read_planes(box, device, verify, progress):
        dw.put(plane_key, t)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    return dw.complete()


def _random_planes(fmt: str, n: int, k: int, std: float, gen: torch.Generator, device) -> dict:
    """Packed planes of a random [n, k] matrix in `fmt` drawn directly: every bit pattern of the code
    planes is a valid code (uniform over the range), scales ≈ std / code std (±25 %)."""
    if fmt == "bf16":
        return pack_for_device((torch.randn(n, k, generator=gen, device=device) * std).to(torch.bfloat16))
    if fmt in KFORMATS:           # random super-blocks, valid fp16 scales: std within ×2 of `std`
        return pack_kquant_for_device(random_kquant(fmt, n, k, gen, device, scale=6 * std))
    sizes = plane_bytes(fmt, n, k)
    planes = {name: torch.randint(0, 256, (size,), generator=gen, device=device, dtype=torch.uint8)
              for name, size in sizes.items() if name != "scales"}
    scale = std / _CODE_STD[fmt]
    planes["scales"] = ((torch.rand(sizes["scales"] // 2, generator=gen, device=device) * 0.5 + 0.75)
                        * scale).to(torch.float16)
    return planes


def random_on_device(spec: ModelSpec, seed: int = 0, device="cuda", progress: bool = False) -> DeviceWeights:
    """The spec's full weight set drawn on the device in its quantised formats (seeded): matrices at
    std 1/√K (the LM head ×2, as `random_weights`), the embedding at std 1, small tensors as
    `random_weights` draws them (on the host, then copied)."""
    dw = DeviceWeights(spec)
    gen = torch.Generator(device=device).manual_seed(seed)
    head = lm_head_name(spec)
    for name, infos in _progress(packed_matrices(spec), "drawing weights", progress):
        n, k = sum(i.shape[0] for i in infos), infos[0].shape[1]
        fmt = format_of(spec, infos[0])
        std = (2.0 if name == head else 1.0) / math.sqrt(k)
        dw.matrices[name] = _random_planes(fmt, n, k, std, gen, device)
        dw.formats[name] = fmt
    host_gen = torch.Generator().manual_seed(seed)
    for info in tensor_table(spec):
        if info.name == "embed_tokens.weight":
            fmt = format_of(spec, info)
            v, h = info.shape
            if fmt == "w8g32":
                dw.embed_codes = torch.randint(-127, 128, (v, h), generator=gen, device=device, dtype=torch.int8)
                dw.embed_scales = torch.full((v, h // group_of(fmt)), 1.0 / _CODE_STD["w8g32"],
                                             dtype=torch.float16, device=device)
            elif fmt in KFORMATS:
                dw.embed_codes = random_kquant(fmt, v, h, gen, device, scale=6.0).blocks
            else:
                dw.embed_codes = torch.randn(v, h, generator=gen, device=device).to(torch.bfloat16)
        elif info.role in NON_MATRIX_ROLES:
            dw.tensors[info.name] = _small_tensor(info.name, draw_tensor(info.name, info.shape, host_gen), device)
    return dw
