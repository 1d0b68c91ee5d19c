// Decode attention for XLA:CPU (AVX512): one new query position per sequence against one layer's
// KV cache, grouped-query. Exposed to JAX as the FFI custom call "qurl_decode_attention".
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
// the values accumulating G weighted sums, normalised at the end.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using qurl_jax::RunParallel;

namespace {

constexpr int kMaxAcc = 24;  // zmm accumulators for the value pass (G chunk x D / 16)

// exp(x) for x <= 0 (x = score - max): exp(x) = 2^n * exp(r), r in [-ln2/2, ln2/2], exp(r) by a
// degree-6 Taylor polynomial (relative error < 2e-7), 2^n applied with vscalefps.
__attribute__((target("avx512f")))
inline __m512 Exp(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Shapes {
  int64_t heads, groups, slots, dim, length;
  float scale;
};

// 16 cache elements as f32 lanes: f32 as they are, int8 codes widened.
__attribute__((target("avx512f")))
inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }

__attribute__((target("avx512f")))
inline __m512 Load16(const int8_t* p) {
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
}

// k_scale, v_scale: per-slot scales of an int8 cache (nullptr for f32).
template <typename KV>
__attribute__((target("avx512f")))
void AttendOne(const Shapes& sh, const float* q, const KV* k, const KV* v, const float* k_scale,
               const float* v_scale, const bool* mask, float* out, std::vector<float>* scratch) {
  const int64_t g_n = sh.groups, d_n = sh.dim, len = sh.length, dv = d_n / 16;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // One per-thread buffer, reused across calls (this runs per (row, kv head) every decode step):
  // scores [G, len], then the row maxima and sums [G] each.
  scratch->resize(g_n * (len + 2));
  float* scores = scratch->data();
  float* row_max = scores + g_n * len;
  float* row_sum = row_max + g_n;
  std::fill(row_max, row_max + g_n, neg_inf);
  bool any = false;
  for (int64_t s = 0; s < len; ++s) {
    if (!mask[s]) {
      for (int64_t g = 0; g < g_n; ++g) scores[g * len + s] = neg_inf;
      continue;
    }
    any = true;
    const KV* ks = k + s * d_n;
    const float slot_scale = k_scale ? sh.scale * k_scale[s] : sh.scale;
    for (int64_t g = 0; g < g_n; ++g) {
      const float* qg = q + g * d_n;
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg), Load16(ks));
      for (int64_t c = 1; c < dv; ++c) {
        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), Load16(ks + 16 * c), acc);
      }
      const float score = _mm512_reduce_add_ps(acc) * slot_scale;
      scores[g * len + s] = score;
      row_max[g] = std::max(row_max[g], score);
    }
  }
  if (!any) {
    for (int64_t i = 0; i < g_n * d_n; ++i) out[i] = 0.0f;
    return;
  }
  // Probabilities (unnormalised) in place; masked slots (-inf) become exactly 0.
  const __m512 minus_inf = _mm512_set1_ps(neg_inf);
  for (int64_t g = 0; g < g_n; ++g) {
    const __m512 m = _mm512_set1_ps(row_max[g]);
    __m512 total = _mm512_setzero_ps();
    float* sg = scores + g * len;
    for (int64_t s = 0; s < len; s += 16) {
      const __mmask16 in = len - s >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (len - s)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(in, sg + s);
      const __mmask16 valid = _mm512_mask_cmp_ps_mask(in, x, minus_inf, _CMP_NEQ_OQ);
      const __m512 e = _mm512_maskz_mov_ps(valid, Exp(_mm512_sub_ps(x, m)));
      _mm512_mask_storeu_ps(sg + s, in, e);
      total = _mm512_add_ps(total, e);
    }
    row_sum[g] = _mm512_reduce_add_ps(total);
  }
  // Weighted sums of the values, G heads at a time within the register budget.
  const int64_t g_chunk = std::max<int64_t>(1, kMaxAcc / dv);
  for (int64_t g0 = 0; g0 < g_n; g0 += g_chunk) {
    const int64_t gc = std::min(g_chunk, g_n - g0);
    __m512 acc[kMaxAcc];
    for (int64_t i = 0; i < gc * dv; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t s = 0; s < len; ++s) {
      if (!mask[s]) continue;
      const KV* vs = v + s * d_n;
      const float vscale = v_scale ? v_scale[s] : 1.0f;
      for (int64_t c = 0; c < dv; ++c) {
        const __m512 vc = Load16(vs + 16 * c);
        for (int64_t g = 0; g < gc; ++g) {
          acc[g * dv + c] = _mm512_fmadd_ps(
              _mm512_set1_ps(scores[(g0 + g) * len + s] * vscale), vc, acc[g * dv + c]);
        }
      }
    }
    for (int64_t g = 0; g < gc; ++g) {
      const __m512 inv = _mm512_set1_ps(1.0f / row_sum[g0 + g]);
      for (int64_t c = 0; c < dv; ++c) {
        _mm512_storeu_ps(out + (g0 + g) * d_n + 16 * c, _mm512_mul_ps(acc[g * dv + c], inv));
      }
    }
  }
}

template <typename KV, ffi::DataType KT>
ffi::Error Attend(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<KT> k,
                  ffi::Buffer<KT> v, const float* k_scale, const float* v_scale,
                  ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> length,
                  ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const auto md = mask.dimensions();
  const bool same_kv = vd.size() == 4 && kd.size() == 4 && vd[0] == kd[0] && vd[1] == kd[1] &&
                       vd[2] == kd[2] && vd[3] == kd[3];
  if (qd.size() != 4 || !same_kv || md.size() != 2 || qd[0] != kd[0] || qd[1] != kd[1] ||
      qd[3] != kd[3] || md[0] != kd[0] || md[1] != kd[2] || qd[3] % 16 != 0 ||
      length.element_count() != 1) {
    return ffi::Error::InvalidArgument(
        "qurl_decode_attention: expects q[B, H, G, D], k/v[B, H, S, D], mask[B, S], length[] "
        "with D % 16 == 0");
  }
  const int64_t b_n = qd[0], h_n = qd[1];
  Shapes sh{h_n, qd[2], kd[2], qd[3], 0, scale};
  sh.length = std::clamp<int64_t>(length.typed_data()[0], 0, sh.slots);
  const float* qp = q.typed_data();
  const KV* kp = k.typed_data();
  const KV* vp = v.typed_data();
  const bool* mp = mask.typed_data();
  float* op = out->typed_data();
  const int64_t bytes_read = 2 * b_n * h_n * sh.length * (sh.dim * sizeof(KV) +
                                                          (k_scale ? 4 : 0));
  RunParallel(pool, b_n * h_n, bytes_read, [&](int64_t item) {
    thread_local std::vector<float> scratch;
    const int64_t b = item / h_n;
    AttendOne<KV>(sh, qp + item * sh.groups * sh.dim, kp + item * sh.slots * sh.dim,
                  vp + item * sh.slots * sh.dim, k_scale ? k_scale + item * sh.slots : nullptr,
                  v_scale ? v_scale + item * sh.slots : nullptr, mp + b * sh.slots,
                  op + item * sh.groups * sh.dim, &scratch);
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::PRED> mask,
                           ffi::Buffer<ffi::S32> length, ffi::ResultBuffer<ffi::F32> out,
                           float scale) {
  return Attend<float, ffi::F32>(pool, q, k, v, nullptr, nullptr, mask, length, out, scale);
}

ffi::Error DecodeAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::S8> k, ffi::Buffer<ffi::S8> v,
                               ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                               ffi::Buffer<ffi::PRED> mask, ffi::Buffer<ffi::S32> length,
                               ffi::ResultBuffer<ffi::F32> out, float scale) {
  const auto kd = k.dimensions(), sd = k_scale.dimensions(), vsd = v_scale.dimensions();
  if (kd.size() != 4 || sd.size() != 3 || vsd.size() != 3 || sd[0] != kd[0] ||
      sd[1] != kd[1] || sd[2] != kd[2] || vsd[0] != sd[0] || vsd[1] != sd[1] ||
      vsd[2] != sd[2]) {
    return ffi::Error::InvalidArgument(
        "qurl_decode_attention_int8: expects k/v s8[B, H, S, D] and k/v scales f32[B, H, S]");
  }
  return Attend<int8_t, ffi::S8>(pool, q, k, v, k_scale.typed_data(), v_scale.typed_data(),
                                 mask, length, out, scale);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QurlDecodeAttentionInt8, DecodeAttentionInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("scale"));

extern "C" int qurl_cpu_supports_decode_attention() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
