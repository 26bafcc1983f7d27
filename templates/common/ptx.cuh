// ptx.cuh: thin wrappers over the Ampere instructions the kernels use (mma.sync, streaming loads).
// Only sm_80+ features, so every kernel compiles for sm_80/86/87/89/90.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
// NVRTC has no libc headers; these are the widths the kernels rely on.
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef signed char int8_t;

// D = A·B + D for one m16n8k16 tile, bf16 inputs, fp32 accumulators.
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The same with fp16 inputs (attn_decode: INT8 codes as exact fp16, fp16 Q and probabilities).
__device__ __forceinline__ void mma_f16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weights are read exactly once per call: bypass L1 so activations keep it.
__device__ __forceinline__ uint4 ld_stream_u4(const void* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

__device__ __forceinline__ uint32_t ld_stream_u32(const void* p) {
  uint32_t v;
  asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
  return v;
}

__device__ __forceinline__ uint2 ld_stream_u2(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// Byte i (0..3, a constant after unrolling) of a word of int8 codes already XORed with 0x80808080, as
// fp32, exactly, on full-rate instructions instead of I2F: 0x4B0000uu reads 2^23 + code + 128.
__device__ __forceinline__ float biased_s8_as_f32(uint32_t biased, int i) {
  return __uint_as_float(__byte_perm(biased, 0x4B000000u, 0x7650 | i)) - 8388736.f;
}

__device__ __forceinline__ uint4 ld_u4(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// The same load through L2 only: data another block of the same launch may have written (a launch chain's
// later stages, templates/gemv_chain.cu.j2), which the non-coherent path and L1 could hold stale.
__device__ __forceinline__ uint4 ld_cg_u4(const void* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); }

__device__ __forceinline__ float bf16_to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

// NVRTC has no <math.h> macros.
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// 16-byte global → shared copy that bypasses registers; `bytes` 0 zero-fills (rows past the end).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int bytes) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N)); }

// Four 8×8 b16 matrices from shared memory: lane l gives the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

// Four 8×8 b16 matrices from shared memory, transposed: lane l gives the row address of matrix l/8.
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(s));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Asks L2 to fetch [p, p + bytes) ahead of its loads (bytes a multiple of 16, p 16-byte aligned): one
// bulk prefetch on sm_90+ (operands must be warp-uniform, or ptxas loops over the lanes), one prefetch
// per 128-byte line before. No register or scoreboard is tied up.
__device__ __forceinline__ void prefetch_l2(const void* p, int bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" :: "l"(p), "r"(bytes) : "memory");
#else
  for (int o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];\n" :: "l"((const char*)p + o));
#endif
}

// Programmatic dependent launch (sm_90+; compiled out below). The runtime launches each kernel with
// programmatic stream serialisation, so it may start while its predecessor still runs. Contract kept
// by every kernel: before pdl_entry() write nothing, and read only constants (weights, norm weights,
// conv taps) or data written before the run began (the step inputs; GDN state and conv history, which
// the same kernel wrote in an earlier step). pdl_entry() first lets the successor launch, then waits
// for the predecessor grid to finish (its writes visible). A successor takes only the SM resources left over
// (every block of this grid has started when it launches) and runs only its prologue until this grid
// is done, so a chain of one-wave kernels gets its weights streaming early: the trigger before the wait
// was −1.1 % per decode step against after it (H200 tree A/B). Several grids may then be
// waiting at once, so a plan launches the first kernel of every bucket run without
// programmatic serialisation: a run begins once all earlier work is done, which keeps those reads safe.
// A kernel with work the contract allows before the wait (e.g. attn_decode's `early` ring prologue: KV pages
// of keys written before the run) calls pdl_release() first and pdl_wait() after that work, in every thread
// that then reads or writes what its predecessor wrote.
__device__ __forceinline__ void pdl_release() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_entry() {
  pdl_release();
  pdl_wait();
}
