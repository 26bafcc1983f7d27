// rms_row.cuh: one row of the zero-centred RMSNorm, y = x · rsqrt(mean(x²) + eps) · (1 + w) in fp32, with
// a fixed thread mapping (thread t of NTH owns 8-value chunks t, t + NTH, …) and order, shared by the
// rmsnorm kernel and the GEMV's fused norm (templates/gemv.cu.j2 `norm_eps`), so both give the same bits.
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

// The two steps of one 8-value chunk: its squares added to ss in element order, and its scaled values.
__device__ __forceinline__ float rms_chunk_squares(const float (&f)[8], float ss) {
#pragma unroll
  for (int e = 0; e < 8; ++e) ss = __fmaf_rn(f[e], f[e], ss);
  return ss;
}

__device__ __forceinline__ void rms_chunk_scale(float (&f)[8], const uint4& w, float inv) {
  float wf[8];
  unpack8(w, wf);
#pragma unroll
  for (int e = 0; e < 8; ++e) f[e] = f[e] * inv * (1.0f + wf[e]);
}

// Thread `t`'s sum of squares over its chunks of v (in chunk, then element order).
template <int VPT, int NTH, int VEC>
__device__ __forceinline__ float rms_squares(const float (&v)[VPT][8], int t) {
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (t + i * NTH >= VEC) break;
    ss = rms_chunk_squares(v[i], ss);
  }
  return ss;
}

// y chunks of thread t = v · inv · (1 + w), w from the thread's preloaded weight chunks wr.
template <int VPT, int NTH, int VEC, typename out_t>
__device__ __forceinline__ void rms_store(out_t* y, float (&v)[VPT][8], const uint4 (&wr)[VPT], float inv, int t) {
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int c = t + i * NTH;
    if (c >= VEC) break;
    rms_chunk_scale(v[i], wr[i], inv);
    if constexpr (sizeof(out_t) == 4) {
#pragma unroll
      for (int e = 0; e < 8; ++e) reinterpret_cast<float*>(y)[c * 8 + e] = v[i][e];
    } else {
      reinterpret_cast<uint4*>(y)[c] = pack8(v[i]);
    }
  }
}
