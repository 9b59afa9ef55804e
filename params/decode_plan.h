// How the CUDA decode kernels (cuda/kv_decode.cuh: jaxops.attention's decode
// path, cuda/attention_decode.cu, and jaxops.paged_attention,
// cuda/paged_attention.cu) divide their work, and the float32 workspace of
// their split-K. Host code with no CUDA in it, so that an FFI contract can
// size the CUDA workspace result from the operand shapes alone (everything
// here depends on shapes only, never on traced lengths or block tables).
//
// A group is one (sequence, kv head) pair; its rows are the T * G query rows
// of the kv head's G query heads (row = t * G + head in the group). A block
// owns a tile of up to rows_per_tile of those rows, so that every key and
// value row it reads serves the whole GQA group, and one of `splits` key
// ranges of keys_per_split keys (split-K, FlashDecoding): enough blocks that a
// batch-1 call keeps every SM busy. With several splits each block writes its
// rows' unnormalised output and softmax state to the workspace
//   partial_out   [groups, row_tiles, splits, rows_per_tile, Hv] (Hv: the
//                 value and output head dim)
//   partial_state [groups, row_tiles, splits, rows_per_tile, 2] (max in log2
//                 units, sum)
// (the second after the first) and a second kernel merges them by their
// log-sum-exp.
#pragma once

#include <cstdint>

namespace jaxops::params {

// The decode kernels keep a tile's query rows and their float32 outputs
// spread over a warp's lanes (at most 8 elements of a head vector per lane).
constexpr int64_t kCudaDecodeMaxHeadDim = 256;
// Rows of a tile: each lane holds rows x ceil(head_dim / 32) float32 outputs,
// 64 registers at most.
constexpr int64_t kDecodeMaxRowsPerTile = 16;
constexpr int64_t kDecodeMaxRowsPerTileWide = 8;  // head_dim above 128
// A split holds at least kDecodeMinKeysPerSplit keys (below that the merge
// costs more than the parallelism gains), a multiple of kDecodeKeyAlign, and
// there are no more splits than make about kDecodeTargetBlocks blocks (two
// waves of two resident blocks per SM on a 132-SM H100/H200).
constexpr int64_t kDecodeMinKeysPerSplit = 256;
constexpr int64_t kDecodeKeyAlign = 32;
constexpr int64_t kDecodeMaxSplits = 128;
constexpr int64_t kDecodeTargetBlocks = 4 * 132;

// The MLA decode kernel (cuda/kv_decode.cuh's mla_decode_block), which the
// paged attention takes for a value head dim of its own, values read from the
// key rows (absorbed MLA) and heads wider than kCudaDecodeMaxHeadDim: its
// four warps split a tile's output columns (128 each) and rows instead of
// its keys, so a tile keeps kMlaDecodeMaxRowsPerTile rows at every width.
// The key rows are scored in pieces of at most 16 16-byte units a lane.
constexpr int64_t kCudaMlaDecodeMaxHeadDim = 576;       // DeepSeek's latent + rope part
constexpr int64_t kCudaMlaDecodeMaxValueHeadDim = 512;  // 4 warps x 128 columns
constexpr int64_t kMlaDecodeMaxRowsPerTile = 16;

struct DecodePlan {
  int64_t rows_per_tile = 0;
  int64_t row_tiles = 0;
  int64_t splits = 1;
  int64_t keys_per_split = 0;  // a multiple of kDecodeKeyAlign
};

inline int64_t decode_max_rows_per_tile(int64_t head_dim) {
  return head_dim > 128 ? kDecodeMaxRowsPerTileWide : kDecodeMaxRowsPerTile;
}

// The plan for groups of `rows` rows over `capacity` keys with (up to)
// `splits` key splits, in tiles of at most `most_rows` rows.
inline DecodePlan tiled_decode_plan_with_splits(int64_t rows, int64_t capacity,
                                                int64_t most_rows, int64_t splits) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  DecodePlan plan;
  plan.row_tiles = ceil_div(rows, most_rows);
  plan.rows_per_tile = plan.row_tiles > 0 ? ceil_div(rows, plan.row_tiles) : 0;
  if (splits < 1) splits = 1;
  plan.keys_per_split =
      ceil_div(ceil_div(capacity, splits), kDecodeKeyAlign) * kDecodeKeyAlign;
  plan.splits = plan.keys_per_split > 0 ? ceil_div(capacity, plan.keys_per_split) : 1;
  if (plan.splits < 1) plan.splits = 1;
  return plan;
}

// The plan of `groups` groups that the launchers take when they are handed a
// workspace: enough splits for about kDecodeTargetBlocks blocks.
inline DecodePlan tiled_decode_plan(int64_t groups, int64_t rows, int64_t capacity,
                                    int64_t most_rows) {
  const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  const DecodePlan unsplit = tiled_decode_plan_with_splits(rows, capacity, most_rows, 1);
  const int64_t blocks = groups * unsplit.row_tiles;
  int64_t splits = ceil_div(capacity, kDecodeMinKeysPerSplit);
  if (splits > kDecodeMaxSplits) splits = kDecodeMaxSplits;
  const int64_t wanted = blocks > 0 ? ceil_div(kDecodeTargetBlocks, blocks) : 1;
  if (splits > wanted) splits = wanted;
  return tiled_decode_plan_with_splits(rows, capacity, most_rows, splits);
}

// The decode kernel's plans (decode_block: tiles of decode_max_rows_per_tile).
inline DecodePlan decode_plan_with_splits(int64_t rows, int64_t capacity, int64_t head_dim,
                                          int64_t splits) {
  return tiled_decode_plan_with_splits(rows, capacity, decode_max_rows_per_tile(head_dim),
                                       splits);
}

inline DecodePlan decode_plan(int64_t groups, int64_t rows, int64_t capacity,
                              int64_t head_dim) {
  return tiled_decode_plan(groups, rows, capacity, decode_max_rows_per_tile(head_dim));
}

// The MLA kernel's plans (mla_decode_block: tiles of kMlaDecodeMaxRowsPerTile).
inline DecodePlan mla_decode_plan_with_splits(int64_t rows, int64_t capacity, int64_t splits) {
  return tiled_decode_plan_with_splits(rows, capacity, kMlaDecodeMaxRowsPerTile, splits);
}

inline DecodePlan mla_decode_plan(int64_t groups, int64_t rows, int64_t capacity) {
  return tiled_decode_plan(groups, rows, capacity, kMlaDecodeMaxRowsPerTile);
}

// Bytes of the workspace of `plan` (0 without splits): partial outputs of
// `value_head_dim` floats a row, and the (max, sum) states.
inline int64_t decode_workspace_bytes(int64_t groups, int64_t value_head_dim,
                                      const DecodePlan& plan) {
  if (plan.splits <= 1) return 0;
  return groups * plan.row_tiles * plan.splits * plan.rows_per_tile * (value_head_dim + 2) *
         static_cast<int64_t>(sizeof(float));
}

}  // namespace jaxops::params
