// kquant.cuh: device helpers for GGUF k-quant blocks as stored (compiler/kquant.py has the byte layout):
// exact bf16 A fragments from code bytes, byte → float, the m16n8k8 mma and the 3-way bf16 split that
// feeds fp32 sums to it, and the 2-byte-aligned word fix for Q6_K (210-byte blocks).
#pragma once
#include "common/quant.cuh"

// Byte offset of row `row`'s super-block u in a k-quant matrix's device layout (compiler/kernels/weight_layout.py:
// the file's blocks, each byte for byte, in 16-row tile order — tile T's unit u is the 16 blocks of its rows, one
// contiguous run of 16·QB bytes at (T·U + u)·16·QB). U: super-blocks per row, QB: bytes per block.
template <int U, int QB>
__device__ __forceinline__ size_t kq_block_offset(int row, int u) {
  return (((size_t)(row >> 4) * U + u) * 16 + (row & 15)) * QB;
}

// D = A·B (C = 0) for one m16n8k16 tile: a sub-block's first mma needs no zeroed accumulator.
__device__ __forceinline__ void mma_bf16_16816_z(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
}

// D = A·B + D for one m16n8k8 tile (A: a0 row g, a1 row g + 8, k 2t..2t+1; B: b0 k 2t..2t+1, column g).
__device__ __forceinline__ void mma_bf16_1688(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t b0) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]) : "r"(a0), "r"(a1), "r"(b0));
}

__device__ __forceinline__ unsigned short ld_stream_u16(const void* p) {
  unsigned short v;
  asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
  return v;
}

// Bytes (S & 0xF, S >> 8 & 0xF) of a word of codes (each < 128) as the bf16x2 (code − OFF, code' − OFF),
// exactly: PRMT puts each byte under 0x43 (bf16 128 + code), one HFMA2 removes 128 + OFF.
template <int S, int OFF>
__device__ __forceinline__ uint32_t kq_pair(uint32_t codes) {
  const __nv_bfloat162 one = __float2bfloat162_rn(1.0f), neg = __float2bfloat162_rn(-(128.f + OFF));
  return bf2_bits(__hfma2(bits_bf2(__byte_perm(codes, 0x43u, 0x4040 | S)), one, neg));
}

// Bytes (S & 0xF, S >> 8 & 0xF) of a word of codes (each < 128) as the bf16x2 (128 + code, 128 + code'), exactly:
// kq_pair without its HFMA2 (key `code_bias`: the 128s leave the sum with the mins).
template <int S>
__device__ __forceinline__ uint32_t kq_biased(uint32_t codes) {
  return __byte_perm(codes, 0x43u, 0x4040 | S);
}

// Byte i (a constant after unrolling) of a word as fp32, exactly, without I2F: 0x4B0000bb reads 2^23 + bb.
__device__ __forceinline__ float byte_as_f32(uint32_t w, int i) {
  return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7650 | i)) - 8388608.f;
}

// (a, b) as three bf16x2 whose sum is (a, b) to 2^-24 relative: hi = bf16(a), then the exact fp32
// remainders rounded again. An mma over the three parts adds the fp32 sums with fp32 accuracy.
__device__ __forceinline__ void split3_bf16(float a, float b, uint32_t (&p)[3]) {
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    const float2 f = __bfloat1622float2(h);
    p[i] = bf2_bits(h);
    a = __fsub_rn(a, f.x);                          // exact (Sterbenz): a and bf16(a) are within 2^-8
    b = __fsub_rn(b, f.y);
  }
}

// Word m of `w` shifted down by `sh` bits (0 or 16) with the next word of the segment: a lane's
// u32 loads from a 2-byte-aligned Q6_K block start, rounded down to 4 bytes, put right. The next
// word is lane t + 1's (its load of the same segment), for t = 3 lane 0's of the next segment (`nxt`).
__device__ __forceinline__ uint32_t kq_realign(uint32_t w, uint32_t nxt_seg, int lane, uint32_t sh) {
  const uint32_t send = (lane & 3) == 0 ? nxt_seg : w;
  const uint32_t next = __shfl_sync(0xffffffffu, send, (lane & ~3) | ((lane + 1) & 3));
  return __funnelshift_r(w, next, sh);
}
