// gdn.cuh: the Gated DeltaNet state transition shared by the recurrent step and the ReplaySSM fold.
// Both kernels call these functions with the same thread mapping, so a fold of m records gives the
// bits of m sequential steps (REPLAYSSM.md invariant 2). Every rounding point is an explicit
// intrinsic so FMA contraction cannot differ between the two call sites.
// Thread (p, j): p = threadIdx.x & 3 owns state rows i = p + 4·ii, j is one value column.
#pragma once
#include "common/reduce.cuh"

// l2-normalise one raw bf16 head of length D into smem (times `scale`), one warp; fixed order.
template <int D>
__device__ __forceinline__ void l2norm_head(float* dst, const __nv_bfloat16* src, float scale) {
  const int lane = threadIdx.x & 31;
  float v[D / 32];
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < D / 32; ++e) { v[e] = bf16_to_f32(src[lane + 32 * e]); ss = __fmaf_rn(v[e], v[e], ss); }
  const float inv = rsqrtf(warp_sum(ss) + 1e-6f);
#pragma unroll
  for (int e = 0; e < D / 32; ++e) dst[lane + 32 * e] = __fmul_rn(__fmul_rn(v[e], inv), scale);
}

// Sum of the four p-lanes of a column: xor butterflies give the same bits on all four.
__device__ __forceinline__ float quad_sum(float v) {
  v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 1));
  return __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// S ← exp(g)·S;  u = Sᵀk;  S ← S + k ⊗ beta·(v − u)   (column j of S lives in this thread's RI rows).
template <int RI>
__device__ __forceinline__ void gdn_update(float (&s)[RI], const float* k, float v, float g, float beta) {
  const int p = threadIdx.x & 3;
  const float decay = expf(g);
  float u = 0.f;
#pragma unroll
  for (int ii = 0; ii < RI; ++ii) {
    s[ii] = __fmul_rn(s[ii], decay);
    u = __fmaf_rn(s[ii], k[p + 4 * ii], u);
  }
  u = quad_sum(u);
  const float delta = __fmul_rn(beta, __fsub_rn(v, u));
#pragma unroll
  for (int ii = 0; ii < RI; ++ii) s[ii] = __fmaf_rn(k[p + 4 * ii], delta, s[ii]);
}

// o_j = Σ_i S_ij q_i (read after the update).
template <int RI>
__device__ __forceinline__ float gdn_output(const float (&s)[RI], const float* q) {
  const int p = threadIdx.x & 3;
  float o = 0.f;
#pragma unroll
  for (int ii = 0; ii < RI; ++ii) o = __fmaf_rn(s[ii], q[p + 4 * ii], o);
  return quad_sum(o);
}

// beta = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias) (torch's softplus: linear above 20).
__device__ __forceinline__ float2 gdn_gates(float a, float b, float a_log, float dt_bias) {
  const float x = a + dt_bias;
  const float sp = x > 20.f ? x : log1pf(expf(x));
  return make_float2(-expf(a_log) * sp, 1.0f / (1.0f + expf(-b)));
}
