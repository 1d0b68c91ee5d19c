// Fixed-order (batch-invariant) kernels for XLA:CPU: the exact on-policy numerics
// (`train.on_policy_numerics = 'exact'`, qurl_jax/models/exact.py). The rollout's prefill and
// cached decode and the learner's packed forward call these same kernels, and each output element
// is computed by one documented sequence of IEEE single-precision operations that depends only on
// its own row (token) and the contraction's values, never on how many rows, tokens, cache slots
// or threads the call has. So the two programs give bitwise-equal values, which XLA's own dots and
// reductions do not (their order changes with the batch's shape).
//
//   qurl_fixed_matmul        c f32[M, N] = a f32[M, K] @ b f32[K, N] (attribute transposed = 1:
//                            b is f32[N, K]); c[m, n] = fused chain over k = 0..K-1 from 0 of
//                            a[m, k] * b[k, n].
//   qurl_fixed_matmul_e4m3   the block-scaled FP8 product: a f32[M, G * g] (activation code
//                            values), a_scale f32[M, G], b u8[G * g, N] (E4M3 code bits),
//                            b_scale f32[G, ceil(N / block_n)]; partial P_G = fused chain over the
//                            group's g rows from 0, then c = sum over G in order from 0 of
//                            (P_G * a_scale[m, G]) * b_scale[G, n / block_n].
//   qurl_fixed_rms_norm      y = gain * (x * (1 / sqrt(sum(x*x) / E + eps))) per row (sum below).
//   qurl_fixed_attention     grouped-query attention over each query's allowed keys in slot order.
//   qurl_fixed_logprobs      log softmax(logits / temperature)[target] per row.
//
// Sums over a row (the norm's squares, the softmax denominators, the attention scores' head_dim)
// run in 16 lanes, lane l taking elements l, l + 16, ... in order, then the lanes in a fixed tree
// (Tree16). Exponentials are the kernel's own polynomial (Exp), so they do not depend on a libm.
// fixed_order_impl.h holds the kernels, compiled here once for AVX512 and once for AVX2 + FMA; a
// 16-lane vector is one zmm or two ymm registers, and every lane is computed by the same
// operations, so the two builds give the same bits. Floating-point contraction is off for this
// file: every fused multiply-add is an explicit one.
//
// Speed: the products run packed panels of B (kNB columns x kKC rows, or one FP8 group) through
// an outer-product micro-kernel (6 rows x 64 columns on AVX512), items of 256 rows x 64 columns
// shared with XLA's thread pool (parallel.h).

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

// After the includes, so that only this file's functions are affected (and every intrinsic
// inlined into them).
#pragma GCC optimize("fp-contract=off")

namespace ffi = xla::ffi;

namespace {

// E4M3 (float8_e4m3fn) bits -> float; NaN codes (0x7f, 0xff) never occur (codes are clipped).
struct E4M3Table {
  float value[256];
  E4M3Table() {
    for (int bits = 0; bits < 256; ++bits) {
      const int sign = bits >> 7, exponent = (bits >> 3) & 15, mantissa = bits & 7;
      const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                            : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
      value[bits] = sign ? -magnitude : magnitude;
    }
  }
};
const E4M3Table kE4M3Table;
const float* const kE4M3 = kE4M3Table.value;

enum class BKind { kF32, kF32T, kE4M3 };

struct GemmArgs {
  const float* a;
  int64_t lda;
  const void* b;
  int64_t ldb;
  BKind kind;
  float* c;
  int64_t ldc;
  int64_t m, n, k;
  // Block-scaled products: g rows of the contraction per group, `groups` of them.
  int64_t group = 0, groups = 0;
  const float* a_scale = nullptr;  // [M, groups]
  const float* b_scale = nullptr;  // [groups, b_scale_ld]
  int64_t b_scale_ld = 0, block_n = 1;
};

}  // namespace

// ------------------------------------------------------------------------------- AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,fma")
namespace k512 {
namespace {

struct Vec {
  __m512 v;
};
inline __mmask16 Lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}
inline Vec Zero() { return {_mm512_setzero_ps()}; }
inline Vec Set1(float x) { return {_mm512_set1_ps(x)}; }
inline Vec Load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline Vec LoadN(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(Lanes(n), p)}; }
inline void Store(float* p, Vec x) { _mm512_storeu_ps(p, x.v); }
inline void StoreN(float* p, Vec x, int64_t n) { _mm512_mask_storeu_ps(p, Lanes(n), x.v); }
inline Vec KeepN(Vec x, int64_t n) { return {_mm512_maskz_mov_ps(Lanes(n), x.v)}; }
inline Vec KeepNOr(Vec x, int64_t n, float fill) {
  return {_mm512_mask_mov_ps(_mm512_set1_ps(fill), Lanes(n), x.v)};
}
inline Vec Fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline Vec Fnma(Vec a, Vec b, Vec c) { return {_mm512_fnmadd_ps(a.v, b.v, c.v)}; }
inline Vec Add(Vec a, Vec b) { return {_mm512_add_ps(a.v, b.v)}; }
inline Vec Sub(Vec a, Vec b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline Vec Mul(Vec a, Vec b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline Vec Div(Vec a, Vec b) { return {_mm512_div_ps(a.v, b.v)}; }
inline Vec Max(Vec a, Vec b) { return {_mm512_max_ps(a.v, b.v)}; }
inline Vec RoundNearest(Vec x) {
  return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
inline Vec Pow2(Vec n) {  // 2^n for integral n in [-126, 127]
  const __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(e, 23))};
}
// 16 E4M3 codes -> floats (exact): normal codes by their bits (exponent bias 7 -> 127),
// subnormals as mantissa * 2^-9, then the sign.
inline Vec DecodeE4M3(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i e = _mm512_and_si512(_mm512_srli_epi32(x, 3), _mm512_set1_epi32(15));
  const __m512i m = _mm512_and_si512(x, _mm512_set1_epi32(7));
  const __m512i normal = _mm512_or_si512(
      _mm512_slli_epi32(_mm512_add_epi32(e, _mm512_set1_epi32(120)), 23),
      _mm512_slli_epi32(m, 20));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(m), _mm512_set1_ps(1.0f / 512));
  const __mmask16 is_sub = _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512());
  const __m512 mag = _mm512_mask_mov_ps(_mm512_castsi512_ps(normal), is_sub, sub);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign))};
}
constexpr int kMR = 6;
constexpr int kNV = 4;

#include "fixed_order_impl.h"

}  // namespace
}  // namespace k512
#pragma GCC pop_options

// --------------------------------------------------------------------------------- AVX2
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace k256 {
namespace {

struct Vec {
  __m256 lo, hi;
};
inline __m256i Lanes8(int64_t n) {  // lanes [0, n) of 8 set
  const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::clamp<int64_t>(n, 0, 8))),
                            idx);
}
inline Vec Zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec Set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec Load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline Vec LoadN(const float* p, int64_t n) {
  if (n >= 16) return Load(p);
  return {_mm256_maskload_ps(p, Lanes8(n)), _mm256_maskload_ps(p + 8, Lanes8(n - 8))};
}
inline void Store(float* p, Vec x) {
  _mm256_storeu_ps(p, x.lo);
  _mm256_storeu_ps(p + 8, x.hi);
}
inline void StoreN(float* p, Vec x, int64_t n) {
  if (n >= 16) return Store(p, x);
  _mm256_maskstore_ps(p, Lanes8(n), x.lo);
  _mm256_maskstore_ps(p + 8, Lanes8(n - 8), x.hi);
}
inline Vec KeepN(Vec x, int64_t n) {
  return {_mm256_and_ps(x.lo, _mm256_castsi256_ps(Lanes8(n))),
          _mm256_and_ps(x.hi, _mm256_castsi256_ps(Lanes8(n - 8)))};
}
inline Vec KeepNOr(Vec x, int64_t n, float fill) {
  const __m256 f = _mm256_set1_ps(fill);
  return {_mm256_blendv_ps(f, x.lo, _mm256_castsi256_ps(Lanes8(n))),
          _mm256_blendv_ps(f, x.hi, _mm256_castsi256_ps(Lanes8(n - 8)))};
}
inline Vec Fma(Vec a, Vec b, Vec c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec Fnma(Vec a, Vec b, Vec c) {
  return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
inline Vec Add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec Sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec Mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec Div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec Max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec RoundNearest(Vec x) {
  constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(x.lo, kMode), _mm256_round_ps(x.hi, kMode)};
}
inline __m256 Pow2Half(__m256 n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
inline Vec Pow2(Vec n) { return {Pow2Half(n.lo), Pow2Half(n.hi)}; }
inline __m256 DecodeE4M3Half(const uint8_t* p) {  // as k512's DecodeE4M3, 8 codes
  const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i e = _mm256_and_si256(_mm256_srli_epi32(x, 3), _mm256_set1_epi32(15));
  const __m256i m = _mm256_and_si256(x, _mm256_set1_epi32(7));
  const __m256i normal = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(120)), 23),
      _mm256_slli_epi32(m, 20));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(1.0f / 512));
  const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
  const __m256 mag = _mm256_blendv_ps(_mm256_castsi256_ps(normal), sub, is_sub);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(mag), sign));
}
inline Vec DecodeE4M3(const uint8_t* p) { return {DecodeE4M3Half(p), DecodeE4M3Half(p + 8)}; }
constexpr int kMR = 6;
constexpr int kNV = 1;

#include "fixed_order_impl.h"

}  // namespace
}  // namespace k256
#pragma GCC pop_options

// ----------------------------------------------------------------------------- handlers
namespace {

// QURL_JAX_CPU_KERNELS_ISA=avx2 runs the AVX2 build on an AVX512 machine (tests compare them).
bool HasAvx512() {
  __builtin_cpu_init();
  const char* isa = std::getenv("QURL_JAX_CPU_KERNELS_ISA");
  if (isa != nullptr && std::strcmp(isa, "avx2") == 0) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
}
const bool kAvx512 = HasAvx512();

ffi::Error Matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> b,
                  ffi::ResultBuffer<ffi::F32> c, int64_t transposed) {
  const auto ad = a.dimensions(), bd = b.dimensions();
  if (ad.size() != 2 || bd.size() != 2 || ad[1] != bd[transposed ? 1 : 0]) {
    return ffi::Error::InvalidArgument(
        "qurl_fixed_matmul: expects a[M, K] and b[K, N] (transposed: b[N, K])");
  }
  GemmArgs g{a.typed_data(), ad[1], b.typed_data(), bd[1],
             transposed ? BKind::kF32T : BKind::kF32, c->typed_data(),
             transposed ? bd[0] : bd[1], ad[0], transposed ? bd[0] : bd[1], ad[1]};
  if (kAvx512) {
    k512::Gemm(pool, g);
  } else {
    k256::Gemm(pool, g);
  }
  return ffi::Error::Success();
}

ffi::Error MatmulE4M3(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> a, ffi::Buffer<ffi::F32> a_scale,
                      ffi::Buffer<ffi::U8> b, ffi::Buffer<ffi::F32> b_scale,
                      ffi::ResultBuffer<ffi::F32> c, int64_t block_n) {
  const auto ad = a.dimensions(), sd = a_scale.dimensions(), bd = b.dimensions();
  const auto bsd = b_scale.dimensions();
  if (ad.size() != 2 || sd.size() != 2 || bd.size() != 2 || bsd.size() != 2 ||
      ad[1] != bd[0] || sd[0] != ad[0] || sd[1] < 1 || ad[1] % sd[1] != 0 ||
      bsd[0] != sd[1] || block_n < 1 || bsd[1] != (bd[1] + block_n - 1) / block_n ||
      (block_n != 1 && block_n % 64 != 0 && block_n < bd[1])) {
    return ffi::Error::InvalidArgument(
        "qurl_fixed_matmul_e4m3: expects a[M, G * g], a_scale[M, G], b u8[G * g, N], "
        "b_scale[G, ceil(N / block_n)] with block_n 1, a multiple of 64 or >= N");
  }
  GemmArgs g{a.typed_data(), ad[1], b.typed_data(), bd[1], BKind::kE4M3, c->typed_data(),
             bd[1], ad[0], bd[1], ad[1]};
  g.groups = sd[1];
  g.group = ad[1] / sd[1];
  g.a_scale = a_scale.typed_data();
  g.b_scale = b_scale.typed_data();
  g.b_scale_ld = bsd[1];
  g.block_n = block_n;
  if (kAvx512) {
    k512::Gemm(pool, g);
  } else {
    k256::Gemm(pool, g);
  }
  return ffi::Error::Success();
}

ffi::Error RmsNorm(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> gain,
                   ffi::ResultBuffer<ffi::F32> y, float eps) {
  const auto xd = x.dimensions(), gd = gain.dimensions();
  if (xd.size() != 2 || gd.size() != 1 || gd[0] != xd[1]) {
    return ffi::Error::InvalidArgument("qurl_fixed_rms_norm: expects x[M, E] and gain[E]");
  }
  const int64_t m = xd[0], e = xd[1];
  const float *xp = x.typed_data(), *gp = gain.typed_data();
  float* yp = y->typed_data();
  qurl_jax::RunParallel(pool, m, m * e * 8, [=](int64_t r) {
    if (kAvx512) {
      k512::RmsNormRow(xp + r * e, gp, yp + r * e, e, eps);
    } else {
      k256::RmsNormRow(xp + r * e, gp, yp + r * e, e, eps);
    }
  });
  return ffi::Error::Success();
}

ffi::Error Attention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                     ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_pos,
                     ffi::Buffer<ffi::S32> k_pos, ffi::Buffer<ffi::PRED> k_valid,
                     ffi::Buffer<ffi::S32> q_seg, ffi::Buffer<ffi::S32> k_seg,
                     ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto qpd = q_pos.dimensions(), kpd = k_pos.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || kd[0] != qd[0] || kd[3] != qd[3] ||
      qd[3] % 16 != 0 || kd[1] < 1 || qd[2] % kd[1] != 0 || vd[0] != kd[0] || vd[1] != kd[1] ||
      vd[2] != kd[2] || vd[3] != kd[3] || qpd.size() != 2 || qpd[0] != qd[0] ||
      qpd[1] != qd[1] || kpd.size() != 2 || kpd[0] != kd[0] || kpd[1] != kd[2] ||
      k_valid.element_count() != kd[0] * kd[2] || q_seg.element_count() != qd[0] * qd[1] ||
      k_seg.element_count() != kd[0] * kd[2]) {
    return ffi::Error::InvalidArgument(
        "qurl_fixed_attention: expects q[B, T, H, D], k/v[B, Hkv, S, D] (D % 16 == 0, Hkv | H), "
        "q_pos and q_seg [B, T], k_pos, k_valid and k_seg [B, S]");
  }
  if (kAvx512) {
    k512::AttnArgs args{q.typed_data(), k.typed_data(), v.typed_data(), q_pos.typed_data(),
                        k_pos.typed_data(), q_seg.typed_data(), k_seg.typed_data(),
                        k_valid.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[1],
                        kd[2], qd[3], scale};
    k512::Attention(pool, args);
  } else {
    k256::AttnArgs args{q.typed_data(), k.typed_data(), v.typed_data(), q_pos.typed_data(),
                        k_pos.typed_data(), q_seg.typed_data(), k_seg.typed_data(),
                        k_valid.typed_data(), out->typed_data(), qd[0], qd[1], qd[2], kd[1],
                        kd[2], qd[3], scale};
    k256::Attention(pool, args);
  }
  return ffi::Error::Success();
}

ffi::Error Logprobs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits,
                    ffi::Buffer<ffi::S32> targets, ffi::Buffer<ffi::F32> temperature,
                    ffi::ResultBuffer<ffi::F32> out) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || targets.element_count() != ld[0] || temperature.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "qurl_fixed_logprobs: expects logits[N, V], targets[N] and a scalar temperature");
  }
  const int64_t n = ld[0], v = ld[1];
  const float* lp = logits.typed_data();
  const int32_t* tp = targets.typed_data();
  const float t = temperature.typed_data()[0];
  float* op = out->typed_data();
  qurl_jax::RunParallel(pool, n, n * v * 8, [=](int64_t r) {
    const int32_t target = std::clamp<int32_t>(tp[r], 0, static_cast<int32_t>(v - 1));
    op[r] = kAvx512 ? k512::LogprobRow(lp + r * v, v, target, t)
                    : k256::LogprobRow(lp + r * v, v, target, t);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlFixedMatmul, Matmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlFixedMatmulE4M3, MatmulE4M3,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block_n"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlFixedRmsNorm, RmsNorm,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("eps"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlFixedAttention, Attention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlFixedLogprobs, Logprobs,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int qurl_cpu_supports_fixed_order() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
