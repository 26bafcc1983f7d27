// kvq.cuh: INT8-G64 KV quantisation (MODEL.md §9): per 64 values, scale = fp16(max|x| / 127),
// code = clamp(round_half_even(x / scale), −127, 127); an all-zero group has scale 0 and codes 0.
#pragma once
#include "common/ptx.cuh"

// Max of |x| over `LANES` consecutive lanes (a power of two ≤ 32) that share one group.
template <int LANES>
__device__ __forceinline__ float group_amax(float v) {
#pragma unroll
  for (int o = 1; o < LANES; o <<= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ int8_t kv_code(float x, float scale) {
  if (scale == 0.f) return 0;
  const float c = fminf(fmaxf(rintf(__fdiv_rn(x, scale)), -127.f), 127.f);
  return (int8_t)(int)c;
}

// INT8 codes as fp32 without the conversion unit (I2F runs at 16 results per clock per SM on sm_80–90,
// a quarter of the integer pipe): the biased byte u = x + 128 becomes the low mantissa bits of 2^23,
// and (2^23 + u) − (2^23 + 128) = x exactly — the same values as (float)x, by one PRMT/LOP3 and one FADD.
__device__ __forceinline__ float s8_as_f32(uint32_t byte) {
  return __uint_as_float(0x4B000000u | ((byte & 0xFFu) ^ 0x80u)) - 8388736.f;
}

// The four codes of a 32-bit word, lowest byte first.
__device__ __forceinline__ void s8x4_as_f32(uint32_t w, float* f) {
  const uint32_t u = w ^ 0x80808080u;
  f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7540)) - 8388736.f;
  f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7541)) - 8388736.f;
  f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7542)) - 8388736.f;
  f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7543)) - 8388736.f;
}

// Two codes in bytes 0 and 2 of `x` (bytes 1 and 3 ignored) as an exact fp16 pair, lower byte in the low half:
// each half reads 0x64uu = 1024 + u with u the code's byte with its sign bit flipped (code + 128), minus 1152.
// One LOP3 and one HSUB2 for two codes.
__device__ __forceinline__ uint32_t s8x2_as_h2(uint32_t x) {
  uint32_t h;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;\n" : "=r"(h) : "r"(x), "r"(0x00FF00FFu), "r"(0x64806480u));  // (x & m) ^ c
  const __half2 v = __hsub2(*reinterpret_cast<const __half2*>(&h), __half2half2(__ushort_as_half(0x6480)));
  return *reinterpret_cast<const uint32_t*>(&v);
}
