// How the CUDA paged attention kernel (cuda/paged_attention.cu) divides its
// work, and the float32 workspace its split-K needs. Host code with no CUDA in
// it, so that an FFI contract can size a CUDA workspace result from the
// operand shapes alone (everything here depends only on shapes, never on the
// traced kv_lens or block tables).
//
// A block owns a tile of up to kPagedMaxRowsPerTile of the T * (N / K) query
// rows of one kv head's group (row = t * group + head in the group), for one
// sequence, and walks keys in tiles of kPagedKeyTile. When one tile holds all
// the rows (decode, short chunks) the keys are also split: each block walks
// keys_per_split keys and writes its partial output, max and sum per row to
// the workspace [B, K, splits, rows] x (H + 2), which a second kernel merges.
#pragma once

#include <cstdint>

#include "params/paged_attention.h"

namespace jaxops::params {

// The CUDA kernel's largest head dim: a block holds its query rows and one
// key tile as float32 head vectors in shared memory (67 KiB at 256).
constexpr int64_t kCudaPagedAttentionMaxHeadDim = 256;
constexpr int64_t kPagedKeyTile = 32;
// A GQA group of up to 16 heads decodes in one tile.
constexpr int64_t kPagedMaxRowsPerTile = 16;
// Split-K: at least this many keys per split, at most kPagedMaxSplits splits,
// and no more splits than make about kPagedTargetBlocks blocks (4 per SM of
// an H100) for the B * K blocks without splits.
constexpr int64_t kPagedMinKeysPerSplit = 256;
constexpr int64_t kPagedMaxSplits = 32;
constexpr int64_t kPagedTargetBlocks = 4 * 132;

struct PagedAttentionPlan {
  int64_t rows_per_tile = 0;
  int64_t row_tiles = 0;
  int64_t splits = 1;
  int64_t keys_per_split = 0;  // a multiple of kPagedKeyTile
};

// The plan with (up to) `splits` key splits; 1 when the rows take several
// tiles. The key count is the capacity M * page_size: kv_lens are traced data.
inline PagedAttentionPlan paged_attention_plan_with_splits(const PagedAttentionParams& p,
                                                           int64_t splits) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  PagedAttentionPlan plan;
  const int64_t all_rows = p.num_kv_heads > 0 ? p.q_len * (p.num_heads / p.num_kv_heads) : 0;
  plan.rows_per_tile = all_rows < kPagedMaxRowsPerTile ? all_rows : kPagedMaxRowsPerTile;
  plan.row_tiles = plan.rows_per_tile > 0 ? ceil_div(all_rows, plan.rows_per_tile) : 0;
  if (plan.row_tiles != 1 || splits < 1) splits = 1;
  const int64_t capacity = p.max_pages_per_seq * p.page_size;
  plan.keys_per_split = ceil_div(ceil_div(capacity, splits), kPagedKeyTile) * kPagedKeyTile;
  plan.splits = plan.keys_per_split > 0 ? ceil_div(capacity, plan.keys_per_split) : 1;
  if (plan.splits < 1) plan.splits = 1;
  return plan;
}

// The plan the CUDA launcher takes when it is handed a workspace.
inline PagedAttentionPlan paged_attention_plan(const PagedAttentionParams& p) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const int64_t blocks = p.batch * p.num_kv_heads;
  int64_t splits = ceil_div(p.max_pages_per_seq * p.page_size, kPagedMinKeysPerSplit);
  if (splits > kPagedMaxSplits) splits = kPagedMaxSplits;
  const int64_t wanted = blocks > 0 ? ceil_div(kPagedTargetBlocks, blocks) : 1;
  if (splits > wanted) splits = wanted;
  return paged_attention_plan_with_splits(p, splits);
}

// Bytes of the float32 workspace of `plan` (0 without splits).
inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p,
                                               const PagedAttentionPlan& plan) {
  if (plan.splits <= 1) return 0;
  return p.batch * p.num_kv_heads * plan.splits * plan.rows_per_tile * (p.head_dim + 2) *
         static_cast<int64_t>(sizeof(float));
}

inline int64_t paged_attention_workspace_bytes(const PagedAttentionParams& p) {
  return paged_attention_workspace_bytes(p, paged_attention_plan(p));
}

}  // namespace jaxops::params
