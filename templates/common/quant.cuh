// quant.cuh: biased integer codes → exact bf16x2 values for the mma A fragments.
// A code u (biased, u < 128) placed in the mantissa of bf16 128.0 (0x4300) gives 128 + u exactly;
// one fma then removes 128 + bias. Layout: compiler/kernels/weight_layout.py.
#pragma once
#include "common/ptx.cuh"

__device__ __forceinline__ uint32_t bf2_bits(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 bits_bf2(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// (a & b) | c in one LOP3: ptxas leaves the mask and the 0x4300 insertion as two instructions.
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// (128 + u_lo, 128 + u_hi) - offset, u = (bits & mask) | extra, with `extra` already holding 0x43004300
// (and any high code bits): u lies in bits 0..6 and 16..22.
__device__ __forceinline__ uint32_t unbias_bf2(uint32_t bits, uint32_t mask, uint32_t extra, float offset) {
  const __nv_bfloat162 one = __float2bfloat162_rn(1.0f);
  const __nv_bfloat162 neg = __float2bfloat162_rn(-offset);
  return bf2_bits(__hfma2(bits_bf2(and_or(bits, mask, extra)), one, neg));
}

// x >> SH for SH ≥ 0, x << -SH otherwise (one shift; the caller masks).
template <int SH>
__device__ __forceinline__ uint32_t shift_r(uint32_t x) { return SH >= 0 ? x >> (SH & 31) : x << ((-SH) & 31); }

// 4-bit plane: register p of a step holds nibbles p and p+4 of the step's word.
template <int P>
__device__ __forceinline__ uint32_t q4_reg(uint32_t w) { return unbias_bf2(w >> (4 * P), 0x000F000Fu, 0x43004300u, 136.f); }

// Q4G64 (bias 8): the 4 A registers of step S (Q5G64 bias 16, Q6G64 bias 32 below).
template <int S>
__device__ __forceinline__ void dq_q4(uint32_t (&a)[4], uint32_t w) {
  a[0] = q4_reg<0>(w); a[1] = q4_reg<1>(w); a[2] = q4_reg<2>(w); a[3] = q4_reg<3>(w);
}

// Q5G64: whole 5-bit codes (weight_layout.py), so a register is a shift and one LOP3. Registers 0-2 of
// step S are fields 0, 5, 10 of lo word S; register 3 is field 5S of the hi word, except in step 3,
// whose codes are gathered from bit 15 / 31 of the five words (bit i of the code in word i).
template <int SH>
__device__ __forceinline__ uint32_t q5_reg(uint32_t w) { return unbias_bf2(w >> SH, 0x001F001Fu, 0x43004300u, 144.f); }

__device__ __forceinline__ uint32_t q5_spare(const uint4& w, uint32_t hi) {
  uint32_t v = and_or(w.x >> 15, 0x00010001u, 0x43004300u);
  v = and_or(w.y >> 14, 0x00020002u, v);
  v = and_or(w.z >> 13, 0x00040004u, v);
  v = and_or(w.w >> 12, 0x00080008u, v);
  return unbias_bf2(hi >> 11, 0x00100010u, v, 144.f);
}

template <int S>
__device__ __forceinline__ void dq_q5(uint32_t (&a)[4], const uint4& w, uint32_t hi) {
  const uint32_t ws = S == 0 ? w.x : S == 1 ? w.y : S == 2 ? w.z : w.w;
  a[0] = q5_reg<0>(ws); a[1] = q5_reg<5>(ws); a[2] = q5_reg<10>(ws);
  if constexpr (S < 3) a[3] = q5_reg<5 * S>(hi);
  else a[3] = q5_spare(w, hi);
}

// Two hi bits at 8·(S&1) + 2P (+16) → code bits 4, 5 of each half.
template <int S, int P>
__device__ __forceinline__ uint32_t q6_reg(uint32_t w, uint32_t hi) {
  const uint32_t extra = and_or(shift_r<8 * (S & 1) + 2 * P - 4>(hi), 0x00300030u, 0x43004300u);
  return unbias_bf2(w >> (4 * P), 0x000F000Fu, extra, 160.f);
}

template <int S>
__device__ __forceinline__ void dq_q6(uint32_t (&a)[4], uint32_t w, uint32_t hi) {
  a[0] = q6_reg<S, 0>(w, hi); a[1] = q6_reg<S, 1>(w, hi); a[2] = q6_reg<S, 2>(w, hi); a[3] = q6_reg<S, 3>(w, hi);
}

// W8G32 (bias 128): bytes (0, 2) and (1, 3) of a word form two registers; v = 16·(hi − 8) + lo, exact.
__device__ __forceinline__ uint32_t w8_pair(uint32_t w, int shift) {
  const __nv_bfloat162 sixteen = __float2bfloat162_rn(16.0f);
  const uint32_t lo = unbias_bf2(w >> shift, 0x000F000Fu, 0x43004300u, 128.f);
  const uint32_t hi = unbias_bf2(w >> (shift + 4), 0x000F000Fu, 0x43004300u, 136.f);
  return bf2_bits(__hfma2(bits_bf2(hi), sixteen, bits_bf2(lo)));
}

__device__ __forceinline__ void dq_w8(uint32_t (&a)[4], uint32_t w0, uint32_t w1) {
  a[0] = w8_pair(w0, 0); a[1] = w8_pair(w0, 8); a[2] = w8_pair(w1, 0); a[3] = w8_pair(w1, 8);
}
