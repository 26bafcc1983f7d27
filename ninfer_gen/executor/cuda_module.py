"""cuda_module: loads built kernels (cubin, or PTX as a fallback) on torch's primary context and
launches them on torch's current stream, so launches are captured by `torch.cuda.graph`. An arch path
older than the device (`KernelCache(jit_ptx=True)`) loads PTX only, which the driver JIT-compiles.

Arguments are packed once per `Launcher` (device addresses as uint64, ints as int32, floats as fp32).
Kernels built for sm_90 or newer are launched with programmatic stream serialisation (programmatic
dependent launch): each may start while its predecessor finishes, and waits for it in `pdl_entry()`
(templates/common/ptx.cuh), which every template calls before touching another kernel's data; a
plan says which calls launch so (`Call.programmatic`). Import order matters (CUDA.md): torch first, then cuda.bindings. Never compiles.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: F401  (must precede any cuda.bindings work after cuInit)
from cuda.bindings import driver as cu

from compiler.targets import supports_pdl

_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "f32": ctypes.c_float}
_STATIC_SMEM_LIMIT = 48 * 1024


class CudaError(RuntimeError):
    pass


def check(result, what: str):
    """Unwrap a cuda.bindings result tuple, raising CudaError with the driver's message."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise CudaError(f"{what}: {err.name} ({msg.decode() if msg else '?'})")
    return rest[0] if len(rest) == 1 else tuple(rest)


def primary_context(device: int | None = None):
    """Make torch's primary context current on this thread (torch creates it first)."""
    device = torch.cuda.current_device() if device is None else device
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{device}")             # forces torch's context into existence
    check(cu.cuInit(0), "cuInit")
    dev = check(cu.cuDeviceGet(device), "cuDeviceGet")
    ctx = check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    return ctx


@dataclass
class Kernel:
    name: str
    module: object
    function: object
    registers: int = 0             # per thread, as loaded on this device (for PTX: what the driver's JIT chose)
    local_bytes: int = 0           # local memory per thread (stack frame and spills)

    @classmethod
    def load(cls, image: bytes | str | Path, entry: str, dynamic_smem: int = 0) -> "Kernel":
        """`image`: cubin bytes, PTX text, or a path to either (a .ptx file is JIT-compiled by the driver)."""
        primary_context()
        if isinstance(image, (str, Path)):
            path = Path(image)
            image = path.read_bytes() + (b"\0" if path.suffix == ".ptx" else b"")
        try:
            module = check(cu.cuModuleLoadData(image), f"cuModuleLoadData({entry})")
        except CudaError as err:
            if "UNSUPPORTED_PTX_VERSION" in str(err):        # CUDA.md: newer NVRTC's PTX, older driver
                raise CudaError(f"{err}: this driver cannot JIT PTX from NVRTC {_nvrtc_version()}; build with "
                                "an NVRTC no newer than the driver's CUDA version (13.0 for driver 580)") from None
            raise
        fn = check(cu.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})")
        if dynamic_smem > _STATIC_SMEM_LIMIT:
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(fn, attr, dynamic_smem), f"cuFuncSetAttribute({entry})")
        attrs = cu.CUfunction_attribute
        regs, local = (check(cu.cuFuncGetAttribute(a, fn), f"cuFuncGetAttribute({entry})")
                       for a in (attrs.CU_FUNC_ATTRIBUTE_NUM_REGS, attrs.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES))
        return cls(entry, module, fn, regs, local)

    def bind(self, params, args, launch, pdl: bool = False) -> "Launcher":
        return Launcher(self, params, args, launch, pdl)

    def __call__(self, params, args, launch, stream: int | None = None) -> None:
        self.bind(params, args, launch).launch(stream)


def _nvrtc_version() -> str:
    from compiler.nvrtc import version
    return version()


def _value(arg):
    """A tensor is passed by its device address; None is a null pointer."""
    if arg is None:
        return 0
    if isinstance(arg, torch.Tensor):
        return arg.data_ptr()
    return arg


class Launcher:
    """One kernel with its arguments packed once (a void*[] of ctypes values); launch() is cheap.
    `pdl`: launch with programmatic stream serialisation (only for kernels that call pdl_entry())."""

    def __init__(self, kernel: Kernel, params, args, launch, pdl: bool = False):
        if len(params) != len(args):
            raise ValueError(f"{kernel.name}: {len(params)} parameters, {len(args)} arguments")
        self.kernel, self.launch_cfg, self.pdl = kernel, launch, pdl
        # The packed values are raw device addresses: the launcher keeps its tensors alive, or a freed
        # argument's memory could be handed to another tensor before a later launch.
        self._tensors = [a for a in args if isinstance(a, torch.Tensor)]
        self._values = [_CTYPES[p.kind](_value(a)) for p, a in zip(params, args)]
        self._ptrs = (ctypes.c_void_p * len(self._values))(*[ctypes.addressof(v) for v in self._values])
        self._config = None
        if pdl:
            attr = cu.CUlaunchAttribute()
            attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            cfg = cu.CUlaunchConfig()
            (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ), (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) = \
                launch.grid, launch.block
            cfg.sharedMemBytes, cfg.attrs, cfg.numAttrs = launch.smem, [attr], 1
            self._config = cfg

    def launch(self, stream: int | None = None) -> None:
        stream = torch.cuda.current_stream().cuda_stream if stream is None else stream
        if self._config is not None:
            self._config.hStream = stream
            check(cu.cuLaunchKernelEx(self._config, self.kernel.function, ctypes.addressof(self._ptrs), 0),
                  f"cuLaunchKernelEx({self.kernel.name})")
            return
        g, b, smem = self.launch_cfg.grid, self.launch_cfg.block, self.launch_cfg.smem
        check(cu.cuLaunchKernel(self.kernel.function, *g, *b, smem, stream, ctypes.addressof(self._ptrs), 0),
              f"cuLaunchKernel({self.kernel.name})")


class KernelCache:
    """Kernels by key for one build root: compiles on a miss (unless no_jit) and loads each once.
    `jit_ptx`: every kernel is built as PTX only (`build/<sm_XX>-ptx/`) and JIT-compiled by the driver,
    all of them as they are built (so no request waits for the JIT): an arch path older than the device
    (compiler.targets.arch_path_target). The `ptx` arguments below load the PTX beside a cubin instead."""

    def __init__(self, root=None, jobs: int | None = None, no_jit: bool = False, progress: bool = False,
                 jit_ptx: bool = False):
        """`progress`: show the build's progress bar when kernels must be compiled (first runs)."""
        from compiler.build_cache import DEFAULT_ROOT
        self.root, self.jobs, self.no_jit, self.progress = Path(root or DEFAULT_ROOT), jobs, no_jit, progress
        self.jit_ptx = jit_ptx
        self._built: dict = {}
        self._loaded: dict = {}

    def build(self, keys, ptx: bool = False) -> None:
        from compiler.build_cache import build_kernels
        ptx = ptx or self.jit_ptx
        todo = [k for k in dict.fromkeys(keys) if (k.name, ptx) not in self._built]
        if todo:
            summary = build_kernels(todo, jobs=self.jobs, root=self.root, ptx=ptx, ptx_only=self.jit_ptx,
                                    no_jit=self.no_jit, progress=self.progress)
            self._built.update({(b.key.name, ptx): b for b in summary.built})
            if self.jit_ptx:
                for key in todo:
                    self.get(key)

    def spilled(self) -> list[str]:
        """Names of built kernels whose ptxas report shows spills. A PTX-only build has no report (none for
        `jit_ptx`): the JIT's local memory (`loaded()`) mixes stack frames with spills — qk_rope_kv's sinf
        reduction keeps a 32-byte frame on sm_90 — and the same source's sm_86 cubins are spill-checked in CI."""
        return [b.key.name for b in self._built.values() if b.meta["spill_stores"] or b.meta["spill_loads"]]

    def loaded(self) -> list[Kernel]:
        """The kernels loaded so far, with the registers and local memory this device gave them."""
        return list(self._loaded.values())

    def get(self, key, ptx: bool = False) -> Kernel:
        ptx = ptx or self.jit_ptx
        if (key.name, ptx) not in self._loaded:
            self.build([key], ptx)
            built = self._built[(key.name, ptx)]
            from compiler.kernels import module_of
            smem = module_of(key).launch(key).smem          # > 48 KiB needs the opt-in attribute
            self._loaded[(key.name, ptx)] = Kernel.load(built.ptx if ptx else built.cubin, key.name, smem)
        return self._loaded[(key.name, ptx)]

    def bind(self, key, args, ptx: bool = False, programmatic: bool = True) -> Launcher:
        """A launcher for `key` with `args` in the family's parameter order and its launch config;
        `programmatic` (only where the key's arch supports it: never on the sm_86 path) lets it start
        before its predecessor ends, else it starts after all earlier work in its stream has finished."""
        from compiler.kernels import module_of
        mod = module_of(key)
        return self.get(key, ptx).bind(mod.params(key), args, mod.launch(key), programmatic and supports_pdl(key.arch))
