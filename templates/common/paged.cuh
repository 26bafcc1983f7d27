// paged.cuh: the split rule shared by attn_decode and attn_combine. A row's pages are divided into
// at most SPLITS runs of pps pages, pps = max(ceil(pages / SPLITS), MIN_PPS); it depends only on
// the row's length, so the result does not depend on B or T. Short contexts use fewer splits.
#pragma once

constexpr int MIN_PPS = 1;   // one page per split at short context: a block walks its pages serially

__device__ __forceinline__ int pages_per_split(int pages, int splits) {
  const int pps = (pages + splits - 1) / splits;
  return pps > MIN_PPS ? pps : MIN_PPS;
}
