// quant.cuh: biased integer codes → exact bf16x2 values for the mma A fragments.
// A code u (biased, u < 128) placed in the mantissa of bf16 128.0 (0x4300) gives 128 + u exactly;
// one fma then removes 128 + bias. Layout: compiler/kernels/weight_layout.py.
#pragma once
#include "common/ptx.cuh"

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// (128 + u_lo, 128 + u_hi) - offset, with u already masked into bits 0..6 and 16..22.
__device__ __forceinline__ uint32_t unbias_bf2(uint32_t masked, float offset) {
  const __nv_bfloat162 one = __float2bfloat162_rn(1.0f);
  const __nv_bfloat162 neg = __float2bfloat162_rn(-offset);
  return bf2_bits(__hfma2(bits_bf2(masked | 0x43004300u), one, neg));
}

// 4-bit plane: register p of a step holds nibbles p and p+4 of the step's word.
template <int P>
__device__ __forceinline__ uint32_t nib_pair(uint32_t w) { return (w >> (4 * P)) & 0x000F000Fu; }

// Q4G64 (bias 8), Q5G64 (bias 16, hi bit), Q6G64 (bias 32, two hi bits): the 4 A registers of step S.
template <int S>
__device__ __forceinline__ void dq_q4(uint32_t (&a)[4], uint32_t w) {
  a[0] = unbias_bf2(nib_pair<0>(w), 136.f); a[1] = unbias_bf2(nib_pair<1>(w), 136.f);
  a[2] = unbias_bf2(nib_pair<2>(w), 136.f); a[3] = unbias_bf2(nib_pair<3>(w), 136.f);
}

template <int S, int P>
__device__ __forceinline__ uint32_t q5_pair(uint32_t w, uint32_t hi) {
  return nib_pair<P>(w) | (((hi >> (4 * S + P)) << 4) & 0x00100010u);
}

template <int S>
__device__ __forceinline__ void dq_q5(uint32_t (&a)[4], uint32_t w, uint32_t hi) {
  a[0] = unbias_bf2(q5_pair<S, 0>(w, hi), 144.f); a[1] = unbias_bf2(q5_pair<S, 1>(w, hi), 144.f);
  a[2] = unbias_bf2(q5_pair<S, 2>(w, hi), 144.f); a[3] = unbias_bf2(q5_pair<S, 3>(w, hi), 144.f);
}

template <int S, int P>
__device__ __forceinline__ uint32_t q6_pair(uint32_t w, uint32_t hi) {
  return nib_pair<P>(w) | (((hi >> (8 * (S & 1) + 2 * P)) << 4) & 0x00300030u);
}

template <int S>
__device__ __forceinline__ void dq_q6(uint32_t (&a)[4], uint32_t w, uint32_t hi) {
  a[0] = unbias_bf2(q6_pair<S, 0>(w, hi), 160.f); a[1] = unbias_bf2(q6_pair<S, 1>(w, hi), 160.f);
  a[2] = unbias_bf2(q6_pair<S, 2>(w, hi), 160.f); a[3] = unbias_bf2(q6_pair<S, 3>(w, hi), 160.f);
}

// W8G32 (bias 128): bytes (0, 2) and (1, 3) of a word form two registers; v = 16·(hi − 8) + lo, exact.
__device__ __forceinline__ uint32_t w8_pair(uint32_t w, int shift) {
  const __nv_bfloat162 sixteen = __float2bfloat162_rn(16.0f);
  const uint32_t lo = unbias_bf2((w >> shift) & 0x000F000Fu, 128.f);
  const uint32_t hi = unbias_bf2((w >> (shift + 4)) & 0x000F000Fu, 136.f);
  return bf2_bits(__hfma2(bits_bf2(hi), sixteen, bits_bf2(lo)));
}

__device__ __forceinline__ void dq_w8(uint32_t (&a)[4], uint32_t w0, uint32_t w1) {
  a[0] = w8_pair(w0, 0); a[1] = w8_pair(w0, 8); a[2] = w8_pair(w1, 0); a[3] = w8_pair(w1, 8);
}
