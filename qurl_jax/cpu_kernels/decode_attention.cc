// Decode attention for XLA:CPU (AVX512, or AVX2 with FMA): one new query position per sequence
// against one layer's KV cache, grouped-query. Exposed to JAX as the FFI custom call
// "qurl_decode_attention" ("qurl_decode_attention_avx2": the same with AVX2's 8-lane vectors).
//
//   q:      f32[B, Hkv, G, D]   the G query heads that share kv head h (RoPE applied)
//   k, v:   f32[B, Hkv, S, D]   the layer's cache, this step's key/value already written
//   mask:   pred[B, S]          slot holds a real token
//   length: s32[]               slots [0, length) can be attended to (the query's slot + 1)
//   scale:  f32 attribute       1 / sqrt(D)
//   out:    f32[B, Hkv, G, D]   sum_s softmax_s(scale * q.k_s) v_s over valid slots s < length
//
// "qurl_decode_attention_int8" reads an int8 cache (the rollout's `kv_precision='int8'`): k, v
// s8[B, Hkv, S, D] codes with k_scale, v_scale f32[B, Hkv, S] (key s = k_scale[s] * k codes),
// dequantized in registers, so a step reads 1 byte per cached element instead of 4: the score
// of slot s is k_scale[s] * (q . codes_s), its probability multiplies v_scale[s] into the
// weighted sum of the value codes.
//
// Why: XLA:CPU runs the two attention products as 2 * B * Hkv tiny batched matmuls ([G, D] x
// [D, S]) at ~11 GB/s and reads every slot of the cache, generated or not. This kernel streams each
// (row, kv head)'s keys and values once, stops at `length`, and keeps scores and softmax in f32
// (as the model does). A row with no valid slot gets zeros (the model's masked softmax would
// average the whole cache; such rows are padding and their outputs unused).
//
// Per (b, h) item, shared across threads (parallel.h): scores for all G heads in one pass over the
// keys, max-subtracted exponentials (a vectorised exp, ~1e-7 relative error), then one pass over
// the values accumulating G weighted sums, normalised at the end. The body is written once over a
// vector type (decode_attention_body.h) and compiled for each instruction set; the two paths
// differ only in the order of their float sums.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using qurl_jax::RunParallel;

namespace {

struct Shapes {
  int64_t heads, groups, slots, dim, length;
  float scale;
};

// exp(x) for x <= 0 (x = score - max): exp(x) = 2^n * exp(r), r in [-ln2/2, ln2/2], exp(r) by a
// degree-6 Taylor polynomial (relative error < 2e-7), on either instruction set's vectors.
#define QURL_EXP_POLYNOMIAL(PS, FMADD, FNMADD, SET1)                                     \
  x = PS##_max_ps(x, SET1(-87.0f));                                                      \
  const auto n = Round(PS##_mul_ps(x, SET1(1.44269504088896341f)));                      \
  auto r = FNMADD(n, SET1(0.693359375f), x);                                             \
  r = FNMADD(n, SET1(-2.12194440e-4f), r);                                               \
  auto p = SET1(1.0f / 720);                                                             \
  p = FMADD(p, r, SET1(1.0f / 120));                                                     \
  p = FMADD(p, r, SET1(1.0f / 24));                                                      \
  p = FMADD(p, r, SET1(1.0f / 6));                                                       \
  p = FMADD(p, r, SET1(0.5f));                                                           \
  p = FMADD(p, r, SET1(1.0f));                                                           \
  p = FMADD(p, r, SET1(1.0f))

namespace avx512 {

#define QURL_TARGET __attribute__((target("avx512f")))

struct V {
  using F = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kMaxAcc = 24;  // zmm accumulators for the value pass (G chunk x D / 16)
  QURL_TARGET static F Zero() { return _mm512_setzero_ps(); }
  QURL_TARGET static F Set1(float x) { return _mm512_set1_ps(x); }
  QURL_TARGET static F Load(const float* p) { return _mm512_loadu_ps(p); }
  QURL_TARGET static F Load(const int8_t* p) {
    const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
  }
  QURL_TARGET static void Store(float* p, F x) { _mm512_storeu_ps(p, x); }
  QURL_TARGET static F Add(F a, F b) { return _mm512_add_ps(a, b); }
  QURL_TARGET static F Sub(F a, F b) { return _mm512_sub_ps(a, b); }
  QURL_TARGET static F Mul(F a, F b) { return _mm512_mul_ps(a, b); }
  QURL_TARGET static F Fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  QURL_TARGET static float Sum(F x) { return _mm512_reduce_add_ps(x); }
  QURL_TARGET static void Sum4(const F* x, float* out) {
    for (int i = 0; i < 4; ++i) out[i] = _mm512_reduce_add_ps(x[i]);
  }
  QURL_TARGET static F Round(F x) {
    return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  QURL_TARGET static F Exp(F x) {
    QURL_EXP_POLYNOMIAL(_mm512, _mm512_fmadd_ps, _mm512_fnmadd_ps, _mm512_set1_ps);
    return _mm512_scalef_ps(p, n);  // 2^n applied with vscalefps
  }
  QURL_TARGET static F KeepFinite(F x, F e) {
    const __mmask16 finite = _mm512_cmp_ps_mask(
        x, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
    return _mm512_maskz_mov_ps(finite, e);
  }
};

#include "decode_attention_body.h"

#undef QURL_TARGET

}  // namespace avx512

namespace avx2 {

#define QURL_TARGET __attribute__((target("avx2,fma")))

struct V {
  using F = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kMaxAcc = 12;  // ymm accumulators for the value pass (G chunk x D / 8)
  QURL_TARGET static F Zero() { return _mm256_setzero_ps(); }
  QURL_TARGET static F Set1(float x) { return _mm256_set1_ps(x); }
  QURL_TARGET static F Load(const float* p) { return _mm256_loadu_ps(p); }
  QURL_TARGET static F Load(const int8_t* p) {
    int64_t codes;
    std::memcpy(&codes, p, 8);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(codes)));
  }
  QURL_TARGET static void Store(float* p, F x) { _mm256_storeu_ps(p, x); }
  QURL_TARGET static F Add(F a, F b) { return _mm256_add_ps(a, b); }
  QURL_TARGET static F Sub(F a, F b) { return _mm256_sub_ps(a, b); }
  QURL_TARGET static F Mul(F a, F b) { return _mm256_mul_ps(a, b); }
  QURL_TARGET static F Fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  QURL_TARGET static float Sum(F x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
  }
  // The four sums in one tree of horizontal adds.
  QURL_TARGET static void Sum4(const F* x, float* out) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(x[0], x[1]), _mm256_hadd_ps(x[2], x[3]));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
  }
  QURL_TARGET static F Round(F x) {
    return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  QURL_TARGET static F Exp(F x) {
    QURL_EXP_POLYNOMIAL(_mm256, _mm256_fmadd_ps, _mm256_fnmadd_ps, _mm256_set1_ps);
    // 2^n as a float's exponent bits (n >= -126 after the clamp: a normal number).
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  QURL_TARGET static F KeepFinite(F x, F e) {
    const F finite = _mm256_cmp_ps(
        x, _mm256_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
    return _mm256_and_ps(finite, e);
  }
};

#include "decode_attention_body.h"

#undef QURL_TARGET

}  // namespace avx2

}  // namespace

#define QURL_DECODE_ATTENTION_HANDLERS(suffix, isa)                                    \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlDecodeAttention##suffix, isa::DecodeAttention,     \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                      \
                                    .Ret<ffi::Buffer<ffi::F32>>()                      \
                                    .Attr<float>("scale"));                            \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlDecodeAttentionInt8##suffix, isa::DecodeAttentionInt8, \
                                ffi::Ffi::Bind()                                       \
                                    .Ctx<ffi::ThreadPool>()                            \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::S8>>()                       \
                                    .Arg<ffi::Buffer<ffi::S8>>()                       \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::F32>>()                      \
                                    .Arg<ffi::Buffer<ffi::PRED>>()                     \
                                    .Arg<ffi::Buffer<ffi::S32>>()                      \
                                    .Ret<ffi::Buffer<ffi::F32>>()                      \
                                    .Attr<float>("scale"))

QURL_DECODE_ATTENTION_HANDLERS(, avx512);
QURL_DECODE_ATTENTION_HANDLERS(Avx2, avx2);

// The best handlers this CPU runs: 2 = AVX512F, 1 = AVX2 with FMA, 0 = neither.
extern "C" int qurl_decode_attention_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return 2;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
}
