// Attention over a paged KV cache (jaxops.paged_attention) and the write of
// new tokens into it (jaxops.paged_kv_update). Layouts, masking and the
// clamping of traced data are params/paged_attention.h's.
//
// Q is the query's element type (float, bfloat16, float16); KV the pages':
// Q itself or int8_t (int8 pages carry float32 scales per token and head, in
// `p.key_scales` / `p.value_scales`). Computation is in float32.
#pragma once

#include <cstdint>

#include "params/paged_attention.h"

namespace jaxops::cpu {

using ::jaxops::params::PagedAttentionParams;
using ::jaxops::params::PagedKvUpdateParams;

// out [B, T, N, H] and logsumexp [B, N, T] float32 (-inf where a row attends
// no key, whose output is 0).
template <typename Q, typename KV>
void paged_attention_fwd(const PagedAttentionParams& p, const Q* query, const KV* key_pages,
                         const KV* value_pages, Q* out, float* logsumexp);

// Writes token i's rows of key/value [num_tokens, K, H] to slot
// slot_mapping[i] of the pages (in place); invalid slots are skipped. A slot
// named by several tokens keeps the last one's rows (tokens are written in
// order). Src is the rows' type (float, bfloat16, float16), Page Src or int8_t
// (then each row is quantized, its scale written to key_scales/value_scales).
template <typename Src, typename Page>
void paged_kv_update(const PagedKvUpdateParams& p, const Src* key, const Src* value,
                     const int32_t* slot_mapping, Page* key_pages, Page* value_pages,
                     float* key_scales, float* value_scales);

}  // namespace jaxops::cpu
