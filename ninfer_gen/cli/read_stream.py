"""read_stream: the decode's bandwidth ceiling measured in the same run — a kernel that only reads (PERF.md: on
the H200 a read-only stream runs ~4 % above a device-to-device copy's read + write figure, cli.bench's
`copy_bandwidth`). Decode and attention are reads, so their efficiency is stated against this.

The probe is not a model kernel: its source is here, compiled with NVRTC for the device's arch on each call
(under a second; no build cache) and launched through executor.cuda_module. Needs a CUDA GPU."""
from __future__ import annotations

import statistics

# Every thread loads 16-byte words grid-stride, UNROLL independent loads in flight, and folds them into one
# word; a thread writes only if its fold equals a constant that random data practically never gives, so the
# compiler keeps every load and the kernel writes nothing.
SOURCE = r"""
extern "C" __global__ void __launch_bounds__(256) read_stream(const uint4* __restrict__ src, int n,
                                                              unsigned int* __restrict__ sink) {
  constexpr int UNROLL = 4;
  const int stride = gridDim.x * blockDim.x;
  unsigned int acc = 0u;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < n; i += UNROLL * stride) {
    uint4 w[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) w[u] = __ldg(src + i + u * stride);
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= w[u].x ^ w[u].y ^ w[u].z ^ w[u].w;
  }
  for (; i < n; i += stride) {
    const uint4 w = __ldg(src + i);
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x9E3779B9u) sink[0] = acc;
}
"""
ENTRY = "read_stream"
THREADS = 256
BUFFER_BYTES = 1 << 30          # far past any L2 (the H200's is 60 MiB)


def compile_probe(arch: str) -> bytes:
    """The probe's cubin for `arch` (sm_XX); runs without a GPU (NVRTC only)."""
    from compiler.nvrtc import compile_source

    # -std=c++17: constexpr in the loop bounds; no headers: uint4 and __ldg are NVRTC built-ins
    return compile_source(SOURCE, ENTRY, arch, ["-std=c++17"]).image


def read_bandwidth(iters: int = 20) -> float:
    """GB/s of a read-only stream over a 1 GiB buffer of random bytes (bytes read / median kernel time)."""
    import torch

    from compiler.kernels import Launch, Param
    from ninfer_gen.executor.cuda_module import Kernel

    if not torch.cuda.is_available():
        raise RuntimeError("the read-only stream needs a CUDA GPU; none is visible")
    major, minor = torch.cuda.get_device_capability()
    kernel = Kernel.load(compile_probe(f"sm_{major}{minor}"), ENTRY)
    props = torch.cuda.get_device_properties(0)
    per_sm = getattr(props, "max_threads_per_multi_processor", 2048)     # a field of newer torch builds only
    grid = props.multi_processor_count * max(1, per_sm // THREADS)      # every SM full of resident blocks
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (BUFFER_BYTES // 4,), dtype=torch.int32, device="cuda")
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    params = [Param("src", "ptr"), Param("n", "i32"), Param("sink", "ptr")]
    launcher = kernel.bind(params, [src, BUFFER_BYTES // 16, sink], Launch((grid, 1, 1), (THREADS, 1, 1), 0))
    for _ in range(3):
        launcher.launch()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        launcher.launch()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e-3)
    del launcher, src, sink
    torch.cuda.empty_cache()
    return BUFFER_BYTES / statistics.median(times) / 1e9
