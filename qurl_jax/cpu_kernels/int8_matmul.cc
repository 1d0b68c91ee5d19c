// int8 x int8 -> int32 matrix product for decode-shaped problems on x86 CPUs with AVX512-VNNI,
// exposed to JAX as XLA FFI custom calls:
//   "qurl_int8_matmul":         w is the row-major s8[K, N];
//   "qurl_int8_matmul_packed":  w is in the packed tile layout below, as the sampler stores it once
//                               per rollout;
//   "qurl_int8_pack":           row-major w -> packed w (qurl_jax.quant._cpu_kernel.pack_int8).
//
//   out[m, n] = sum_k x[m, k] * w[k, n]      x: s8[M, K], out: s32[M, N]
//
// Exactly the result of lax.dot_general(x, w, preferred_element_type=int32). It exists because
// XLA:CPU's own int8 GEMM runs at ~60-90 GMAC/s on 2 cores at 8-16 rows (compute-bound), while the
// product is bounded by reading the int8 weights once, which is 3-5x faster.
//
// Method. VNNI's vpdpbusd multiplies 4 consecutive unsigned bytes by 4 signed bytes per int32 lane.
// The weights are the unsigned side, shifted by 128 (wu = w + 128, the same bits as w ^ 0x80), and
// the excess is a per-row correction computed once per call:
//   sum_k wu[k,n] x[m,k] = out[m,n] + 128 * rowsum[m],   rowsum[m] = sum_k x[m,k].
// Columns are processed in tiles of 64. In vpdpbusd's layout a tile is, for each group of 4 rows,
// four 64-byte vectors whose int32 lanes each hold the 4 bytes of one column. Row-major weights
// are reordered into that layout tile by tile (into a per-thread scratch buffer); packed weights
// are already in it and are streamed contiguously, ~2x faster (a row-major tile is 64 bytes from
// each of K rows). Every block of up to 6 rows of x then runs over the tile with 4 accumulators
// of 16 columns per row. Tiles are shared among the calling thread and XLA's intra-op thread pool
// (RunParallel).
//
// On a CPU with AVX2 but without AVX512-VNNI (most laptops), the "_avx2" handlers compute the same
// sums on the same packed layout with AVX2's vpmaddwd, which multiplies 16-bit pairs into int32:
// each 16 bytes of a tile (4 columns x 4 rows, unsigned) are widened to 16-bit lanes, x's 4 bytes
// of those rows are sign-extended and broadcast, and one vpmaddwd gives every column's two pair
// sums, added at the end. The products (<= 255 * 128) and pair sums fit their lanes, so the sums
// are exact, as VNNI's are (vpmaddubsw, the byte product, saturates its 16-bit pair sums and
// would not be). Each row block then runs one 64-byte vector j of every row group at a time, 4
// accumulators per row, up to 3 rows (the 16 ymm registers).
//
// The packed layout: tile t of 64 columns is contiguous, K * 64 bytes; within it, row group kg is
// 256 bytes = 4 vectors j; within vector j, 128-bit lane L holds columns 64 t + 16 L + 4 j + i
// (i = 0..3), each as the 4 bytes of rows 4 kg + r (r = 0..3), shifted to unsigned:
//   packed[t][kg][j][L][i][r] = w[4 kg + r][64 t + 16 L + 4 j + i] ^ 0x80.

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using qurl_jax::RunParallel;

namespace {

constexpr int kTile = 64;      // columns per tile
constexpr int kMaxRows = 6;    // rows of x per block (4 accumulators each, 32 zmm registers)
constexpr int kMaxRows2 = 2;   // the same for AVX2 (4 accumulators each, 16 ymm registers)

// Which instructions a handler runs: AVX512-VNNI or AVX2 (the same results).
enum class Isa { kAvx512Vnni, kAvx2 };

struct Problem {
  const int8_t* x;        // [M, K4], zero-padded to K4 = round_up(K, 4) columns
  const int16_t* x16;     // the same sign-extended to 16 bits (AVX2 only, else nullptr)
  const int32_t* rowsum;  // [M]
  const int8_t* w;        // [K, N] row-major, or packed (then K % 4 == 0 and N % 64 == 0)
  int32_t* out;           // [M, N]
  int64_t m, k, k4, n;
  bool packed;
};

// Reorders row-major w[:, n0:n0+cols] (cols <= 64) into the packed layout of one tile.
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void PackTile(const Problem& p, int64_t n0, int64_t cols, int8_t* packed) {
  const __mmask64 mask = cols >= 64 ? ~__mmask64{0} : ((__mmask64{1} << cols) - 1);
  const __m512i zero = _mm512_setzero_si512();
  const __m512i sign = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t kg = 0; kg < p.k4 / 4; ++kg) {
    __m512i row[4];
    for (int r = 0; r < 4; ++r) {
      const int64_t k = 4 * kg + r;
      row[r] = k < p.k ? _mm512_maskz_loadu_epi8(mask, p.w + k * p.n + n0) : zero;
    }
    const __m512i t0 = _mm512_unpacklo_epi8(row[0], row[1]);
    const __m512i t1 = _mm512_unpackhi_epi8(row[0], row[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(row[2], row[3]);
    const __m512i t3 = _mm512_unpackhi_epi8(row[2], row[3]);
    const __m512i v[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2),
                          _mm512_unpacklo_epi16(t1, t3), _mm512_unpackhi_epi16(t1, t3)};
    for (int j = 0; j < 4; ++j) {
      _mm512_storeu_si512(packed + 64 * (4 * kg + j), _mm512_xor_si512(v[j], sign));
    }
  }
}

// out[m0:m0+R, n0:n0+cols] from one packed tile.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void RowBlock(const Problem& p, int64_t m0, int64_t n0, int64_t cols, const int8_t* packed) {
  __m512i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
  const int8_t* x = p.x + m0 * p.k4;
  for (int64_t kg = 0; kg < p.k4 / 4; ++kg) {
    const int8_t* wv = packed + 256 * kg;
    const __m512i w0 = _mm512_loadu_si512(wv), w1 = _mm512_loadu_si512(wv + 64);
    const __m512i w2 = _mm512_loadu_si512(wv + 128), w3 = _mm512_loadu_si512(wv + 192);
    for (int r = 0; r < R; ++r) {
      int32_t xi;
      std::memcpy(&xi, x + r * p.k4 + 4 * kg, 4);
      const __m512i xb = _mm512_set1_epi32(xi);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], w0, xb);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], w1, xb);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], w2, xb);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], w3, xb);
    }
  }
  // Accumulator j, 128-bit lane L, element i is column 16 L + 4 j + i of the tile.
  int32_t buf[64];
  for (int r = 0; r < R; ++r) {
    for (int j = 0; j < 4; ++j) _mm512_storeu_si512(buf + 16 * j, acc[r][j]);
    const int32_t excess = 128 * p.rowsum[m0 + r];
    int32_t* out = p.out + (m0 + r) * p.n + n0;
    for (int64_t c = 0; c < cols; ++c) {
      out[c] = buf[16 * ((c % 16) / 4) + 4 * (c / 16) + c % 4] - excess;
    }
  }
}

// Tile `tile` in the packed layout: the weights themselves when packed, else row-major ones
// packed into `scratch` by `Pack` (the instruction set's PackTile).
template <void (*Pack)(const Problem&, int64_t, int64_t, int8_t*)>
const int8_t* PackedTile(const Problem& p, int64_t tile, int64_t cols,
                         std::vector<int8_t>* scratch) {
  if (p.packed) return p.w + tile * p.k4 * kTile;
  scratch->resize(p.k4 * kTile);
  Pack(p, tile * kTile, cols, scratch->data());
  return scratch->data();
}

__attribute__((target("avx512f,avx512bw,avx512vnni")))
void DoTile(const Problem& p, int64_t tile, std::vector<int8_t>* scratch) {
  const int64_t n0 = tile * kTile;
  const int64_t cols = std::min<int64_t>(kTile, p.n - n0);
  const int8_t* packed = PackedTile<PackTile>(p, tile, cols, scratch);
  for (int64_t m0 = 0; m0 < p.m; m0 += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, p.m - m0)) {
      case 1: RowBlock<1>(p, m0, n0, cols, packed); break;
      case 2: RowBlock<2>(p, m0, n0, cols, packed); break;
      case 3: RowBlock<3>(p, m0, n0, cols, packed); break;
      case 4: RowBlock<4>(p, m0, n0, cols, packed); break;
      case 5: RowBlock<5>(p, m0, n0, cols, packed); break;
      default: RowBlock<6>(p, m0, n0, cols, packed); break;
    }
  }
}

// PackTile with AVX2: the same bytes. AVX2's unpacks work within 128-bit lanes as AVX512's do,
// so the low 32 columns give lanes 0-1 of each 64-byte vector and the high 32 lanes 2-3.
__attribute__((target("avx2")))
void PackTileAvx2(const Problem& p, int64_t n0, int64_t cols, int8_t* packed) {
  const __m256i sign = _mm256_set1_epi8(static_cast<char>(0x80));
  alignas(32) int8_t partial[4][kTile];  // a last tile's rows, zero-padded to 64 columns
  for (int64_t kg = 0; kg < p.k4 / 4; ++kg) {
    const int8_t* src[4];
    for (int r = 0; r < 4; ++r) {
      const int64_t k = 4 * kg + r;
      src[r] = p.w + k * p.n + n0;
      if (k >= p.k || cols < kTile) {
        std::memset(partial[r], 0, kTile);
        if (k < p.k) std::memcpy(partial[r], src[r], cols);
        src[r] = partial[r];
      }
    }
    for (int half = 0; half < 2; ++half) {
      __m256i row[4];
      for (int r = 0; r < 4; ++r) {
        row[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[r] + 32 * half));
      }
      const __m256i t0 = _mm256_unpacklo_epi8(row[0], row[1]);
      const __m256i t1 = _mm256_unpackhi_epi8(row[0], row[1]);
      const __m256i t2 = _mm256_unpacklo_epi8(row[2], row[3]);
      const __m256i t3 = _mm256_unpackhi_epi8(row[2], row[3]);
      const __m256i v[4] = {_mm256_unpacklo_epi16(t0, t2), _mm256_unpackhi_epi16(t0, t2),
                            _mm256_unpacklo_epi16(t1, t3), _mm256_unpackhi_epi16(t1, t3)};
      for (int j = 0; j < 4; ++j) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed + 64 * (4 * kg + j) + 32 * half),
                            _mm256_xor_si256(v[j], sign));
      }
    }
  }
}

// out[m0:m0+R, the tile's columns 16 L + 4 j + i] from vector j of every row group of one packed
// tile, with AVX2 (see the file's comment).
template <int R>
__attribute__((target("avx2")))
void RowBlockAvx2(const Problem& p, int64_t m0, int64_t n0, int64_t cols, int j,
                  const int8_t* packed) {
  __m256i acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int l = 0; l < 4; ++l) acc[r][l] = _mm256_setzero_si256();
  const int16_t* x = p.x16 + m0 * p.k4;
  for (int64_t kg = 0; kg < p.k4 / 4; ++kg) {
    __m256i xb[R];
    for (int r = 0; r < R; ++r) {
      int64_t xi;  // the 4 rows' x as 16-bit lanes, repeated for the 4 columns
      std::memcpy(&xi, x + r * p.k4 + 4 * kg, 8);
      xb[r] = _mm256_set1_epi64x(xi);
    }
    const int8_t* wv = packed + 256 * kg + 64 * j;
    for (int l = 0; l < 4; ++l) {
      const __m256i w = _mm256_cvtepu8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(wv + 16 * l)));
      for (int r = 0; r < R; ++r) {
        acc[r][l] = _mm256_add_epi32(acc[r][l], _mm256_madd_epi16(w, xb[r]));
      }
    }
  }
  // Accumulator l holds, for column 16 l + 4 j + i, its row pairs' sums in lanes 2 i and 2 i + 1.
  int32_t buf[8];
  for (int r = 0; r < R; ++r) {
    const int32_t excess = 128 * p.rowsum[m0 + r];
    int32_t* out = p.out + (m0 + r) * p.n + n0;
    for (int l = 0; l < 4; ++l) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf), acc[r][l]);
      for (int i = 0; i < 4; ++i) {
        const int64_t c = 16 * l + 4 * j + i;
        if (c < cols) out[c] = buf[2 * i] + buf[2 * i + 1] - excess;
      }
    }
  }
}

__attribute__((target("avx2")))
void DoTileAvx2(const Problem& p, int64_t tile, std::vector<int8_t>* scratch) {
  const int64_t n0 = tile * kTile;
  const int64_t cols = std::min<int64_t>(kTile, p.n - n0);
  const int8_t* packed = PackedTile<PackTileAvx2>(p, tile, cols, scratch);
  // A quarter of the tile (vector j of every row group) stays in L1 while every row block reads
  // it.
  for (int j = 0; j < 4; ++j) {
    for (int64_t m0 = 0; m0 < p.m; m0 += kMaxRows2) {
      switch (std::min<int64_t>(kMaxRows2, p.m - m0)) {
        case 1: RowBlockAvx2<1>(p, m0, n0, cols, j, packed); break;
        default: RowBlockAvx2<2>(p, m0, n0, cols, j, packed); break;
      }
    }
  }
}

template <Isa isa>
ffi::Error Int8Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                      ffi::ResultBuffer<ffi::S32> out, bool packed) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0]) {
    return ffi::Error::InvalidArgument("qurl_int8_matmul: expects x[M, K] and w[K, N]");
  }
  const int64_t m = xd[0], k = xd[1], n = wd[1], k4 = (k + 3) / 4 * 4;
  if (packed && (k % 4 != 0 || n % kTile != 0)) {
    return ffi::Error::InvalidArgument(
        "qurl_int8_matmul_packed: packed weights need K % 4 == 0 and N % 64 == 0");
  }
  if (m == 0 || n == 0) return ffi::Error::Success();
  const int8_t* xs = x.typed_data();
  std::vector<int8_t> padded;
  if (k4 != k) {
    padded.assign(m * k4, 0);
    for (int64_t i = 0; i < m; ++i) std::memcpy(&padded[i * k4], xs + i * k, k);
    xs = padded.data();
  }
  std::vector<int32_t> rowsum(m, 0);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < k4; ++j) rowsum[i] += xs[i * k4 + j];
  std::vector<int16_t> wide;
  if (isa == Isa::kAvx2) wide.assign(xs, xs + m * k4);

  const Problem problem{xs, wide.data(), rowsum.data(), w.typed_data(), out->typed_data(),
                        m, k, k4, n, packed};
  RunParallel(pool, (n + kTile - 1) / kTile, m * k * n, [&problem](int64_t tile) {
    thread_local std::vector<int8_t> scratch;
    if (isa == Isa::kAvx2) {
      DoTileAvx2(problem, tile, &scratch);
    } else {
      DoTile(problem, tile, &scratch);
    }
  });
  return ffi::Error::Success();
}

template <Isa isa>
ffi::Error RowMajor(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                    ffi::ResultBuffer<ffi::S32> out) {
  return Int8Matmul<isa>(pool, x, w, out, /*packed=*/false);
}

template <Isa isa>
ffi::Error Packed(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                  ffi::ResultBuffer<ffi::S32> out) {
  return Int8Matmul<isa>(pool, x, w, out, /*packed=*/true);
}

// The packed layout of a row-major w[K, N] (K % 4 == 0, N % 64 == 0).
template <Isa isa>
ffi::Error Pack(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S8> out) {
  const auto wd = w.dimensions();
  if (wd.size() != 2 || wd[0] % 4 != 0 || wd[1] % kTile != 0) {
    return ffi::Error::InvalidArgument("qurl_int8_pack: expects w[K, N], K % 4 == 0, N % 64 == 0");
  }
  const int64_t k = wd[0], n = wd[1];
  const Problem problem{nullptr, nullptr, nullptr, w.typed_data(), nullptr, 0, k, k, n, false};
  int8_t* packed = out->typed_data();
  RunParallel(pool, n / kTile, k * n, [&problem, packed](int64_t tile) {
    int8_t* dest = packed + tile * problem.k4 * kTile;
    if (isa == Isa::kAvx2) {
      PackTileAvx2(problem, tile * kTile, kTile, dest);
    } else {
      PackTile(problem, tile * kTile, kTile, dest);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#define QURL_INT8_PACK_HANDLER(symbol, fn)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                                            \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::S8>>()                       \
                                    .Ret<ffi::Buffer<ffi::S8>>())

#define QURL_INT8_MATMUL_HANDLER(symbol, fn)                                           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(symbol, fn,                                            \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::S8>>()                       \
                                    .Arg<ffi::Buffer<ffi::S8>>()                       \
                                    .Ret<ffi::Buffer<ffi::S32>>())

QURL_INT8_PACK_HANDLER(QurlInt8Pack, Pack<Isa::kAvx512Vnni>);
QURL_INT8_MATMUL_HANDLER(QurlInt8Matmul, RowMajor<Isa::kAvx512Vnni>);
QURL_INT8_MATMUL_HANDLER(QurlInt8MatmulPacked, Packed<Isa::kAvx512Vnni>);
QURL_INT8_PACK_HANDLER(QurlInt8PackAvx2, Pack<Isa::kAvx2>);
QURL_INT8_MATMUL_HANDLER(QurlInt8MatmulAvx2, RowMajor<Isa::kAvx2>);
QURL_INT8_MATMUL_HANDLER(QurlInt8MatmulPackedAvx2, Packed<Isa::kAvx2>);

// The best handlers this CPU runs: 2 = AVX512-VNNI, 1 = AVX2, 0 = neither.
extern "C" int qurl_int8_matmul_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vnni")) {
    return 2;
  }
  return __builtin_cpu_supports("avx2") ? 1 : 0;
}
