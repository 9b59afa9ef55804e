#include "cpu/patch_embed.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu/float_convert.h"
#include "cpu/fresh_memory.h"
#include "cpu/gemm_bf16_microkernels.h"
#include "cpu/gemm_microkernels.h"
#include "cpu/row_buffer.h"

namespace jaxops::cpu {
namespace {

using microkernels::gemm;
using microkernels::Update;
using simd::kLanes;

// Patch rows per GEMM panel: a multiple of the micro-kernels' row blocks (6,
// 12, 16), and small enough that a panel of ViT-B patches (768 floats a row)
// and its product stay in L2 next to the streamed kernel columns.
constexpr int64_t kPanelRows = 48;

inline int64_t round_up(int64_t n, int64_t multiple) {
  return (n + multiple - 1) / multiple * multiple;
}

// float32 copy of rows x cols `src` with its rows padded to `ld` with zeros
// (the micro-kernels take whole SIMD vectors of columns).
template <typename T>
std::vector<float> padded_float_copy(const T* src, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(rows * ld, 0.0f);
#pragma omp parallel for schedule(static) if (rows * cols >= (int64_t{1} << 16))
  for (int64_t r = 0; r < rows; ++r) load_row(src + r * cols, out.data() + r * ld, cols);
  return out;
}

// Patch rows first .. first + rows (flattened over batch and patches) gathered
// as float32 into panel [rows, patch_len]: patch_len contiguous kernel-order
// values per row, copied as `patch` runs of patch * channels image values.
template <typename T>
void gather_patches(const T* images, const PatchEmbedShape& s, int64_t first, int64_t rows,
                    float* panel) {
  const int64_t run = s.patch * s.channels, len = s.patch_len(), patches = s.patches();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = (first + r) / patches, n = (first + r) % patches;
    for (int64_t ky = 0; ky < s.patch; ++ky) {
      load_row(images + s.patch_row_offset(b, n, ky), panel + r * len + ky * run, run);
    }
  }
}

// The inverse of gather_patches for the image gradient: rows of dpatches
// [rows, ld] written to their (disjoint) patches.
template <typename T>
void scatter_patches(const float* dpatches, int64_t ld, const PatchEmbedShape& s, int64_t first,
                     int64_t rows, T* dimages) {
  const int64_t run = s.patch * s.channels, patches = s.patches();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t b = (first + r) / patches, n = (first + r) % patches;
    for (int64_t ky = 0; ky < s.patch; ++ky) {
      store_row(dpatches + r * ld + ky * run, dimages + s.patch_row_offset(b, n, ky), run);
    }
  }
}

// The bfloat16 forward on AVX512_BF16 dot products (twice the float32 FMA
// rate): a patch row's values are contiguous along the patch length, so the
// image's own bfloat16 pairs are the A operand as they are; the kernel is
// packed once into pairs along the patch length. Needs whole pairs and whole
// 16-column vectors (ViT shapes: 768 = 16 x 16 x 3, D a multiple of 16).
template <typename T>
bool forward_uses_bf16_dot(const PatchEmbedShape& s) {
#if defined(JAXOPS_BF16_DOT)
  return std::is_same_v<T, bfloat16> && s.patch_len() % 2 == 0 && s.dim % 16 == 0 &&
         microkernels::cpu_has_bf16_dot();
#else
  (void)s;
  return false;
#endif
}

#if defined(JAXOPS_BF16_DOT)
// product[m, dim] = patches first .. first + m (gathered as bfloat16 pairs into
// `pairs` [m, patch_len / 2]) x kernel (`kernel_pairs`, [patch_len / 2, dim]).
template <typename T>
void bf16_dot_panel(const T* images, const PatchEmbedShape& s, int64_t first, int64_t m,
                    const uint32_t* kernel_pairs, uint32_t* pairs, float* product) {
  const int64_t run = s.patch * s.channels, len = s.patch_len(), patches = s.patches();
  uint16_t* halves = reinterpret_cast<uint16_t*>(pairs);
  for (int64_t r = 0; r < m; ++r) {
    const int64_t b = (first + r) / patches, n = (first + r) % patches;
    for (int64_t ky = 0; ky < s.patch; ++ky) {
      std::memcpy(halves + r * len + ky * run, images + s.patch_row_offset(b, n, ky),
                  sizeof(uint16_t) * run);
    }
  }
  microkernels::dot_gemm<Update::kOverwrite>(m, s.dim, len / 2, pairs, len / 2, 1, kernel_pairs,
                                             s.dim, product, s.dim);
}
#endif

}  // namespace

template <typename T>
void patch_embed_fwd(const T* images, const T* kernel, const T* bias, const T* pos,
                     const T* cls, T* tokens, PatchEmbedShape s) {
  const int64_t dim = s.dim, len = s.patch_len(), patches = s.patches();
  const int64_t n_tokens = s.tokens(), first_patch = s.has_cls ? 1 : 0;
  const int64_t ld = round_up(dim, kLanes);
  const int64_t rows = s.batch * patches;
  advise_huge_pages(tokens, sizeof(T) * s.batch * n_tokens * dim);
  const bool bf16_dot = forward_uses_bf16_dot<T>(s);
  // The float32 GEMM's B operand: a float32 kernel whose rows are whole SIMD
  // vectors (ViT widths) is read in place; any other is copied once as float32
  // with its rows padded. (The copy of ViT-B's kernel is 2.4 MB of freshly
  // allocated memory per call.)
  const bool kernel_in_place = std::is_same_v<T, float> && dim == ld;
  const std::vector<float> packed = bf16_dot || kernel_in_place
                                        ? std::vector<float>()
                                        : padded_float_copy(kernel, len, dim, ld);
  const float* kernel_f =
      kernel_in_place ? reinterpret_cast<const float*>(kernel) : packed.data();
  std::vector<uint32_t> kernel_pairs(bf16_dot ? len / 2 * dim : 0);
#if defined(JAXOPS_BF16_DOT)
  if (bf16_dot) {
    microkernels::pack_value_pairs(reinterpret_cast<const uint16_t*>(kernel), dim, len, dim,
                                   kernel_pairs.data());
  }
#endif
  std::vector<float> bias_f(dim, 0.0f), cls_row(s.has_cls ? dim : 0);
  if (s.has_bias) load_row(bias, bias_f.data(), dim);
  if (s.has_cls) {
    // Row 0 of every image: the class token plus pos[0].
    load_row(cls, cls_row.data(), dim);
    if (s.has_pos) {
      RowBuffer<T> pos_row(dim);
      const float* pos0 = pos_row.read(pos, dim);
      for (int64_t d = 0; d < dim; ++d) cls_row[d] += pos0[d];
    }
  }

  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
#pragma omp parallel if (panels > 1)
  {
    // The class-token rows are stored by both threads, not before the
    // parallel region: each of them is on another page of the freshly
    // allocated tokens, and their first-touch page faults are a serial
    // fault-in of the whole output otherwise.
    if (s.has_cls) {
#pragma omp for schedule(static) nowait
      for (int64_t b = 0; b < s.batch; ++b) {
        store_row(cls_row.data(), tokens + b * n_tokens * dim, dim);
      }
    }
    std::vector<float> panel(bf16_dot ? 0 : kPanelRows * len), product(kPanelRows * ld);
    std::vector<uint32_t> pairs(bf16_dot ? kPanelRows * len / 2 : 0);
    RowBuffer<T> pos_row(dim);
    // Dynamic: a thread that takes more page faults, or is preempted on a
    // shared machine, does fewer panels instead of holding the other one up
    // at the end.
#pragma omp for schedule(dynamic)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t first = p * kPanelRows, m = std::min(kPanelRows, rows - first);
      if (bf16_dot) {
#if defined(JAXOPS_BF16_DOT)
        bf16_dot_panel(images, s, first, m, kernel_pairs.data(), pairs.data(), product.data());
#endif
      } else {
        gather_patches(images, s, first, m, panel.data());
        gemm<Update::kOverwrite>(m, ld, len, panel.data(), len, 1, kernel_f, ld,
                                 product.data(), ld);
      }
      for (int64_t r = 0; r < m; ++r) {
        const int64_t b = (first + r) / patches, token = first_patch + (first + r) % patches;
        float* row = product.data() + r * ld;
        const float* pos_f = s.has_pos ? pos_row.read(pos + token * dim, dim) : nullptr;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] += bias_f[d] + (pos_f ? pos_f[d] : 0.0f);
        store_row(row, tokens + (b * n_tokens + token) * dim, dim);
      }
    }
  }
}

template <typename T>
void patch_embed_bwd(const T* dtokens, const T* images, const T* kernel, T* dimages,
                     T* dkernel, T* dbias, T* dpos, T* dcls, PatchEmbedShape s) {
  const int64_t dim = s.dim, len = s.patch_len(), patches = s.patches();
  const int64_t n_tokens = s.tokens(), first_patch = s.has_cls ? 1 : 0;
  const int64_t ld = round_up(dim, kLanes), ld_len = round_up(len, kLanes);
  const int64_t rows = s.batch * patches;

  // Per-token sums over the batch: dpos itself, and dcls / dbias from them.
  if (dpos || dcls || dbias) {
    std::vector<float> sums(n_tokens * dim, 0.0f);
#pragma omp parallel if (s.batch * n_tokens * dim >= (int64_t{1} << 16))
    {
      RowBuffer<T> row_buffer(dim);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < n_tokens; ++t) {
        float* sum = sums.data() + t * dim;
        for (int64_t b = 0; b < s.batch; ++b) {
          const float* row = row_buffer.read(dtokens + (b * n_tokens + t) * dim, dim);
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) sum[d] += row[d];
        }
        if (dpos) store_row(sum, dpos + t * dim, dim);
      }
    }
    if (dcls) store_row(sums.data(), dcls, dim);
    if (dbias) {
      std::vector<float> total(dim, 0.0f);
      for (int64_t t = first_patch; t < n_tokens; ++t) {
        const float* sum = sums.data() + t * dim;
        for (int64_t d = 0; d < dim; ++d) total[d] += sum[d];
      }
      store_row(total.data(), dbias, dim);
    }
  }
  if (!dimages && !dkernel) return;

  // kernel^T [dim, patch_len] padded to ld_len columns, for dimages.
  std::vector<float> packed_t;
  if (dimages) {
    packed_t.assign(dim * ld_len, 0.0f);
    std::vector<float> row(dim);
    for (int64_t k = 0; k < len; ++k) {
      load_row(kernel + k * dim, row.data(), dim);
      for (int64_t d = 0; d < dim; ++d) packed_t[d * ld_len + k] = row[d];
    }
    advise_huge_pages(dimages, sizeof(T) * s.batch * s.height * s.width * s.channels);
  }
  const int64_t panels = (rows + kPanelRows - 1) / kPanelRows;
  const int threads = panels > 1 ? omp_get_max_threads() : 1;
  // dkernel [patch_len, ld] partial sums, one per thread.
  std::vector<std::vector<float>> partials(dkernel ? threads : 0);
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> panel(dkernel ? kPanelRows * len : 0);
    std::vector<float> dpanel(kPanelRows * ld, 0.0f), product(dimages ? kPanelRows * ld_len : 0);
    std::vector<float>* partial = nullptr;
    if (dkernel) {
      partial = &partials[omp_get_thread_num()];
      partial->assign(len * ld, 0.0f);
    }
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t first = p * kPanelRows, m = std::min(kPanelRows, rows - first);
      for (int64_t r = 0; r < m; ++r) {
        const int64_t b = (first + r) / patches, token = first_patch + (first + r) % patches;
        load_row(dtokens + (b * n_tokens + token) * dim, dpanel.data() + r * ld, dim);
      }
      if (dimages) {
        gemm<Update::kOverwrite>(m, ld_len, dim, dpanel.data(), ld, 1, packed_t.data(), ld_len,
                                 product.data(), ld_len);
        scatter_patches(product.data(), ld_len, s, first, m, dimages);
      }
      if (dkernel) {
        gather_patches(images, s, first, m, panel.data());
        // partial[k, :] += sum over the panel's rows r of panel[r, k] dpanel[r, :].
        gemm<Update::kAdd>(len, ld, m, panel.data(), 1, len, dpanel.data(), ld,
                           partial->data(), ld);
      }
    }
  }
  if (dkernel) {
#pragma omp parallel for schedule(static) if (len * dim >= (int64_t{1} << 16))
    for (int64_t k = 0; k < len; ++k) {
      float* row = partials[0].data() + k * ld;
      for (int t = 1; t < threads; ++t) {
        const float* other = partials[t].data() + k * ld;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) row[d] += other[d];
      }
      store_row(row, dkernel + k * dim, dim);
    }
  }
}

#define JAXOPS_INSTANTIATE_PATCH_EMBED(T)                                                  \
  template void patch_embed_fwd<T>(const T*, const T*, const T*, const T*, const T*, T*,  \
                                   PatchEmbedShape);                                       \
  template void patch_embed_bwd<T>(const T*, const T*, const T*, T*, T*, T*, T*, T*,      \
                                   PatchEmbedShape);

JAXOPS_INSTANTIATE_PATCH_EMBED(float)
JAXOPS_INSTANTIATE_PATCH_EMBED(bfloat16)
JAXOPS_INSTANTIATE_PATCH_EMBED(float16)

}  // namespace jaxops::cpu
