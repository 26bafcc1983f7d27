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
