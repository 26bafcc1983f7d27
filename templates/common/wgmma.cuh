// wgmma.cuh: Hopper warpgroup-MMA plumbing shared by the sm_90a kernels (templates/gemm_wg.cu.j2, the lab's
// attn_prefill `wg` variant): shared-memory matrix descriptors, the fence / commit / wait trio, register ties.
// Only keys compiled for sm_90a (KernelKey.compile_arch) may call these: wgmma exists nowhere else.
#pragma once
#include "common/ptx.cuh"

// Shared-memory matrix descriptor with the 128-byte swizzle (atoms of 8 rows × 128 bytes, 1024-byte aligned):
// start address, leading- and stride-dimension byte offsets (PTX ISA, "Matrix Descriptor Format"). K-major:
// `sbo` is the distance between 8-row groups, `lbo` unused (1). MN-major: `lbo` between 64-element groups of
// the M/N dimension, `sbo` between 8-row groups of K.
__device__ __forceinline__ uint64_t desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo & 0x3FFFF) >> 4) << 16) |
         ((uint64_t)((sbo & 0x3FFFF) >> 4) << 32) | ((uint64_t)1 << 62);
}

// K-major, 8-row atoms 1024 bytes apart (consecutive 128-byte rows).
__device__ __forceinline__ uint64_t desc_sw128(unsigned addr) { return desc_sw128(addr, 16, 1024); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int P>
__device__ __forceinline__ void wg_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" :: "n"(P) : "memory"); }

// Generic-proxy shared-memory writes (st.shared, cp.async) made visible to the async proxy wgmma reads through:
// each writer fences, then a barrier.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Ties registers to this point (reads of accumulators after a wait stay after it; fragment definitions stay
// before wgmma.fence, or ptxas serialises the wgmma).
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}
template <int N>
__device__ __forceinline__ void reg_fence(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i]) :: "memory");
}
