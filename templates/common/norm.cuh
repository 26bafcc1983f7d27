// norm.cuh: the zero-centred RMSNorm of one row (MODEL.md §2), y = x · rsqrt(mean(x²) + eps) · (1 + w)
// in fp32, in one fixed order: thread t of T takes 8-element chunks t, t + T, …, adds their squares
// with FMAs in chunk order, the T/32 warps are summed by block_sum, and each output is
// (x · inv) · (1 + w) rounded to bf16. The rmsnorm kernel and the GEMVs that normalise their own input
// (gemv `norm`, whose blocks may have more than T threads: those take no chunk) both use these
// pieces, so they give the same bits.
#pragma once
#include "common/reduce.cuh"

__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) { const float2 t = __bfloat1622float2(p[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}

__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  uint4 v;
  __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) p[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  return v;
}

// Row geometry for H features (T = 128 threads from 4,096 features, else 32: the rmsnorm launch).
template <int H>
struct NormRow {
  static constexpr int VEC = H / 8, T = VEC >= 512 ? 128 : 32, VPT = (VEC + T - 1) / T;
};

// One chunk's squares into the running sum.
__device__ __forceinline__ void add_squares(const float (&v)[8], float& ss) {
#pragma unroll
  for (int e = 0; e < 8; ++e) ss = __fmaf_rn(v[e], v[e], ss);
}

// 1 / rms of the row from this thread's sum of squares (WIDER: a block of more than T threads).
template <int H, bool WIDER = false>
__device__ __forceinline__ float norm_inverse(float ss, float* scratch, float eps) {
  return rsqrtf(block_sum<NormRow<H>::T / 32, WIDER>(ss, scratch) / H + eps);
}

// Chunk c of the normalised row, in place: (v · inv) · (1 + w).
__device__ __forceinline__ void scale_chunk(float (&v)[8], const uint4& w, float inv) {
  float wf[8];
  unpack8(w, wf);
#pragma unroll
  for (int e = 0; e < 8; ++e) v[e] = v[e] * inv * (1.0f + wf[e]);
}
