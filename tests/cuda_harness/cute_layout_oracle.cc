// Test-only: CUTLASS's CuTe as an independent oracle of the wgmma layouts
// (tests/test_cute_oracle.py). Built with the host g++ against the CuTe headers
// of the nvidia-cutlass wheel (and the CUDA toolkit's headers, which CuTe's
// configuration includes); nothing of it is shipped or vendored. It prints, from
// CuTe's own definitions, one record a line:
//   acc N t v row col        CLayout_64xN<N> (cute/atom/mma_traits_sm90_gmma.hpp):
//                            thread t, value v -> element (row, col) of D (64 x N)
//   rega16 t v row col       ALayout_64x16: the 16-bit register-A fragment
//   regatf32 t v row col     ALayout_64x8: the TF32 register-A fragment
//   desc start lbo sbo base layout value
//                            GmmaDescriptor (cute/arch/mma_sm90_desc.hpp) with
//                            those bit fields set (bytes; layout in CuTe's
//                            LayoutType numbering), and its 64-bit value
//   swz b offset value       Swizzle<b, 4, 3> (cute/swizzle.hpp) of a byte offset
//   canon major layout bytes lbo sbo mn k offset
//                            a canonical GMMA tile (tile_to_shape of CuTe's
//                            Layout_{K,MN}_{INTER,SW32,SW64,SW128}_Atom), its
//                            descriptor's LBO and SBO by make_gmma_desc, and the
//                            byte offset of element (mn, k) from the tile's
//                            (1024-aligned) base through CuTe's swizzled pointer.
// The layouts are read through CuTe's algebra, not transcribed.
#include <cstdint>
#include <cstdio>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

using namespace cute;

template <int N>
void accumulator() {
  const auto layout = SM90::GMMA::CLayout_64xN<N>{};
  for (int t = 0; t < 128; ++t) {
    for (int v = 0; v < N / 2; ++v) {
      const int index = layout(t, v);  // column-major in the 64 x N tile
      std::printf("acc %d %d %d %d %d\n", N, t, v, index % 64, index / 64);
    }
  }
}

template <class Layout>
void register_a(const char* name, int values) {
  const Layout layout{};
  for (int t = 0; t < 128; ++t) {
    for (int v = 0; v < values; ++v) {
      const int index = layout(t, v);
      std::printf("%s %d %d %d %d\n", name, t, v, index % 64, index / 64);
    }
  }
}

void descriptor(uint32_t start, uint32_t lbo, uint32_t sbo, uint32_t base, uint32_t layout) {
  GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(start >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(lbo >> 4);
  d.bitfield.stride_byte_offset_ = static_cast<uint16_t>(sbo >> 4);
  d.bitfield.base_offset_ = static_cast<uint8_t>(base);
  d.bitfield.layout_type_ = static_cast<uint8_t>(layout);
  std::printf("desc %u %u %u %u %u %llu\n", start, lbo, sbo, base, layout,
              static_cast<unsigned long long>(d.desc_));
}

template <int B>
void swizzle() {
  const Swizzle<B, 4, 3> s{};
  for (int offset = 0; offset < 4096; offset += 2) std::printf("swz %d %d %d\n", B, offset, int(s(offset)));
}

alignas(1024) unsigned char g_tile[64 * 1024];

// One canonical tile: `atom` tiled to (MN, K), the descriptor of its first
// k-step (MN x one instruction's K), and every element's byte offset.
template <class T, SM90::GMMA::Major kMajor, class Atom, int MN, int K, int KStep>
void canonical(const char* major, int layout_type) {
  const auto layout = tile_to_shape(Atom{}, Shape<Int<MN>, Int<K>>{});
  T* base = reinterpret_cast<T*>(g_tile);
  const auto tile = make_tensor(make_smem_ptr(base), layout);
  const auto step = local_tile(tile, Shape<Int<MN>, Int<KStep>>{}, make_coord(0, 0));
  const GmmaDescriptor d = SM90::GMMA::make_gmma_desc<kMajor>(step);
  const uint32_t lbo = uint32_t(d.bitfield.leading_byte_offset_) << 4;
  const uint32_t sbo = uint32_t(d.bitfield.stride_byte_offset_) << 4;
  for (int mn = 0; mn < MN; ++mn) {
    for (int k = 0; k < KStep; ++k) {
      const auto* p = reinterpret_cast<const unsigned char*>(&step(mn, k));
      std::printf("canon %s %d %d %u %u %d %d %ld\n", major, layout_type, int(sizeof(T)), lbo, sbo,
                  mn, k, static_cast<long>(p - g_tile));
    }
  }
}

int main() {
  accumulator<8>();
  accumulator<64>();
  accumulator<96>();
  accumulator<256>();
  register_a<SM90::GMMA::ALayout_64x16>("rega16", 8);
  register_a<SM90::GMMA::ALayout_64x8>("regatf32", 4);
  for (uint32_t layout = 0; layout < 4; ++layout) {
    descriptor(0x1230, 16, 1024, 0, layout);
    descriptor(0x3fff0, 0x3fff0, 0x10, 0, layout);
    descriptor(0x4560, 8192, 2048, 0, layout);
  }
  swizzle<1>();
  swizzle<2>();
  swizzle<3>();
  using namespace SM90::GMMA;
  using LT = LayoutType;
  canonical<half_t, Major::K, Layout_K_INTER_Atom<half_t>, 128, 16, 16>("k", int(LT::INTERLEAVE));
  canonical<half_t, Major::K, Layout_K_SW32_Atom<half_t>, 128, 16, 16>("k", int(LT::B32));
  canonical<half_t, Major::K, Layout_K_SW64_Atom<half_t>, 128, 32, 16>("k", int(LT::B64));
  canonical<half_t, Major::K, Layout_K_SW128_Atom<half_t>, 128, 64, 16>("k", int(LT::B128));
  canonical<half_t, Major::MN, Layout_MN_INTER_Atom<half_t>, 128, 16, 16>("mn", int(LT::INTERLEAVE));
  canonical<half_t, Major::MN, Layout_MN_SW32_Atom<half_t>, 128, 16, 16>("mn", int(LT::B32));
  canonical<half_t, Major::MN, Layout_MN_SW64_Atom<half_t>, 128, 16, 16>("mn", int(LT::B64));
  canonical<half_t, Major::MN, Layout_MN_SW128_Atom<half_t>, 128, 16, 16>("mn", int(LT::B128));
  canonical<tfloat32_t, Major::K, Layout_K_INTER_Atom<tfloat32_t>, 64, 8, 8>("k", int(LT::INTERLEAVE));
  canonical<tfloat32_t, Major::K, Layout_K_SW32_Atom<tfloat32_t>, 64, 8, 8>("k", int(LT::B32));
  canonical<tfloat32_t, Major::K, Layout_K_SW64_Atom<tfloat32_t>, 64, 16, 8>("k", int(LT::B64));
  canonical<tfloat32_t, Major::K, Layout_K_SW128_Atom<tfloat32_t>, 64, 32, 8>("k", int(LT::B128));
  return 0;
}
