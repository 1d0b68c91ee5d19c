// The fixed-order kernels of fixed_order.cc, written once over a 16-lane float vector `Vec`
// (AVX512: one zmm register; AVX2: two ymm registers). fixed_order.cc includes this file once per
// instruction set, inside a namespace that defines Vec, its operations and the register blocking
// (kMR rows x kNV vectors per micro-tile). Every operation is IEEE single precision, rounded per
// operation (fused multiply-adds where the documented order says so), so both instantiations give
// bitwise the same results. Include only from fixed_order.cc.

// ------------------------------------------------------------------ helpers over 16 lanes
// The sum of 16 lanes in the documented tree: halves, then quarters, eighths, the last pair.
inline float Tree16(Vec v) {
  alignas(64) float a[16];
  Store(a, v);
  float s8[8], s4[4], s2[2];
  for (int i = 0; i < 8; ++i) s8[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) s4[i] = s8[i] + s8[i + 4];
  for (int i = 0; i < 2; ++i) s2[i] = s4[i] + s4[i + 2];
  return s2[0] + s2[1];
}

inline float Max16(Vec v) {
  alignas(64) float a[16];
  Store(a, v);
  float m = a[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a[i]);
  return m;
}

// exp(x), x <= 0 expected: x clamped to -87, n = round(x log2 e), r = x - n ln2 (two fused
// steps, Cody-Waite), exp(r) by a degree-6 Taylor polynomial (Horner, fused), times 2^n built
// from its exponent bits (exact). Relative error < 2e-7.
inline Vec Exp(Vec x) {
  x = Max(x, Set1(-87.0f));
  const Vec n = RoundNearest(Mul(x, Set1(1.44269504088896341f)));
  Vec r = Fnma(n, Set1(0.693359375f), x);
  r = Fnma(n, Set1(-2.12194440e-4f), r);
  Vec p = Set1(1.0f / 720);
  p = Fma(p, r, Set1(1.0f / 120));
  p = Fma(p, r, Set1(1.0f / 24));
  p = Fma(p, r, Set1(1.0f / 6));
  p = Fma(p, r, Set1(0.5f));
  p = Fma(p, r, Set1(1.0f));
  p = Fma(p, r, Set1(1.0f));
  return Mul(p, Pow2(n));
}

// ------------------------------------------------------------------------------- products
constexpr int64_t kNR = 16 * kNV;  // columns of a micro-tile
constexpr int64_t kNB = 64;        // columns of a packed panel (a multiple of kNR)
constexpr int64_t kKC = 256;       // contraction rows of a packed panel (plain products)
constexpr int64_t kMB = 256;       // rows of A per work item

// One micro-tile: rows [0, mr) of A (row stride lda) times the panel's kNR columns starting at
// `col` (panel row stride kNB), over kc contraction rows. Plain (scale == nullptr): each C element
// continues its fused chain from C (or from 0 when `first`). Block-scaled: the chain starts at 0
// (the group's partial P) and C becomes (first ? 0 : C) + (P * a_scale[r]) * b_scale.
template <int MR>
void Micro(const float* a, int64_t lda, const float* panel, int64_t col, int64_t kc, float* c,
           int64_t ldc, int64_t ncols, bool first, const float* a_scale, int64_t a_scale_ld,
           float b_scale) {
  Vec acc[MR][kNV];
  const bool plain = a_scale == nullptr;
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) {
      const int64_t left = ncols - 16 * j;
      acc[r][j] = (plain && !first && left > 0) ? LoadN(c + r * ldc + 16 * j, left) : Zero();
    }
  }
  const float* bp = panel + col;
  for (int64_t kk = 0; kk < kc; ++kk) {
    Vec b[kNV];
    for (int j = 0; j < kNV; ++j) b[j] = Load(bp + kk * kNB + 16 * j);
    for (int r = 0; r < MR; ++r) {
      const Vec av = Set1(a[r * lda + kk]);
      for (int j = 0; j < kNV; ++j) acc[r][j] = Fma(av, b[j], acc[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) {
      const int64_t left = ncols - 16 * j;
      if (left <= 0) continue;
      Vec out = acc[r][j];
      if (!plain) {
        const Vec term = Mul(Mul(out, Set1(a_scale[r * a_scale_ld])), Set1(b_scale));
        out = Add(first ? Zero() : LoadN(c + r * ldc + 16 * j, left), term);
      }
      StoreN(c + r * ldc + 16 * j, out, left);
    }
  }
}

template <int MR>
void MicroRows(const GemmArgs& g, const float* panel, int64_t col, int64_t m0, int64_t n0,
               int64_t k0, int64_t kc, bool first, float b_scale) {
  const int64_t ncols = std::min<int64_t>(kNR, g.n - n0 - col);
  const float* a_scale = g.a_scale ? g.a_scale + m0 * g.groups + k0 / g.group : nullptr;
  Micro<MR>(g.a + m0 * g.lda + k0, g.lda, panel, col, kc, g.c + m0 * g.ldc + n0 + col, g.ldc,
            ncols, first, a_scale, g.groups, b_scale);
}

// Panel [kc, kNB] of B's rows [k0, k0 + kc) and columns [n0, n0 + kNB), as f32, zero past N.
void PackPanel(const GemmArgs& g, int64_t k0, int64_t kc, int64_t n0, float* panel) {
  const int64_t cols = std::min(kNB, g.n - n0);
  for (int64_t kk = 0; kk < kc; ++kk) {
    float* row = panel + kk * kNB;
    const int64_t k = k0 + kk;
    if (g.kind == BKind::kF32) {
      const float* src = static_cast<const float*>(g.b) + k * g.ldb + n0;
      for (int64_t j = 0; j < cols; ++j) row[j] = src[j];
    } else if (g.kind == BKind::kF32T) {
      continue;  // below, column by column
    } else {
      const uint8_t* src = static_cast<const uint8_t*>(g.b) + k * g.ldb + n0;
      for (int64_t j = 0; j < cols; ++j) row[j] = kE4M3[src[j]];
    }
    for (int64_t j = cols; j < kNB; ++j) row[j] = 0.0f;
  }
  if (g.kind == BKind::kF32T) {  // b[N, K]: each column's kc values are contiguous
    for (int64_t j = 0; j < kNB; ++j) {
      const float* src = static_cast<const float*>(g.b) + (n0 + j) * g.ldb + k0;
      for (int64_t kk = 0; kk < kc; ++kk) panel[kk * kNB + j] = j < cols ? src[kk] : 0.0f;
    }
  }
}

// Rows [m0, m0 + mb) x columns [n0, n0 + kNB) of C, the whole contraction in order.
void GemmItem(const GemmArgs& g, int64_t m0, int64_t mb, int64_t n0, std::vector<float>* scratch) {
  const int64_t step = g.group ? g.group : kKC;
  scratch->resize(step * kNB);
  float* panel = scratch->data();
  for (int64_t k0 = 0; k0 < g.k; k0 += step) {
    const int64_t kc = std::min(step, g.k - k0);
    PackPanel(g, k0, kc, n0, panel);
    const bool first = k0 == 0;
    for (int64_t col = 0; col < kNB && n0 + col < g.n; col += kNR) {
      // One weight scale per micro-tile: kNR divides block_n, so a tile never spans two blocks.
      const float b_scale = g.b_scale ? g.b_scale[(k0 / step) * g.b_scale_ld +
                                                  (n0 + col) / g.block_n] : 0.0f;
      int64_t r = 0;
      for (; r + kMR <= mb; r += kMR) {
        MicroRows<kMR>(g, panel, col, m0 + r, n0, k0, kc, first, b_scale);
      }
      switch (mb - r) {
        case 0: break;
#define QURL_TAIL(n) case n: MicroRows<n>(g, panel, col, m0 + r, n0, k0, kc, first, b_scale); break;
        QURL_TAIL(1) QURL_TAIL(2) QURL_TAIL(3) QURL_TAIL(4) QURL_TAIL(5)
#undef QURL_TAIL
        default: break;
      }
    }
  }
}

void Gemm(xla::ffi::ThreadPool& pool, const GemmArgs& g) {
  const int64_t mbs = (g.m + kMB - 1) / kMB, nbs = (g.n + kNB - 1) / kNB;
  qurl_jax::RunParallel(pool, mbs * nbs, g.m * g.n * g.k, [&g, nbs](int64_t item) {
    thread_local std::vector<float> scratch;
    const int64_t mi = item / nbs, ni = item % nbs;
    const int64_t m0 = mi * kMB;
    GemmItem(g, m0, std::min(kMB, g.m - m0), ni * kNB, &scratch);
  });
}

// -------------------------------------------------------------------------------- RMSNorm
// y = gain * (x * (1 / sqrt(Tree16(lanes of x*x) / E + eps))), lane l summing x[l], x[l + 16],
// ... by fused multiply-adds from 0.
void RmsNormRow(const float* x, const float* gain, float* y, int64_t e, float eps) {
  Vec acc = Zero();
  for (int64_t i = 0; i < e; i += 16) {
    const Vec v = LoadN(x + i, e - i);
    acc = Fma(v, v, acc);
  }
  const float mean = Tree16(acc) / static_cast<float>(e);
  const float r = 1.0f / std::sqrt(mean + eps);
  const Vec rv = Set1(r);
  for (int64_t i = 0; i < e; i += 16) {
    StoreN(y + i, Mul(LoadN(gain + i, e - i), Mul(LoadN(x + i, e - i), rv)), e - i);
  }
}

// ------------------------------------------------------------------------------ attention
struct AttnArgs {
  const float *q, *k, *v;
  const int32_t *q_pos, *k_pos, *q_seg, *k_seg;
  const bool* k_valid;
  float* out;
  int64_t b, t, h, hkv, s, d;
  float scale;
};

// Query (bi, ti), every head: its allowed keys in slot order j = 0..n-1 (valid, position at or
// before the query's, same segment). Head by head: score_j = Tree16(lanes: fused chain over d =
// l, l + 16, ... of q * k) * scale; p_j = Exp(score_j - max); den = Tree16(lanes: p_j summed in
// order of j by lane j % 16); out[d] = (fused chain over j of p_j * v_j[d]) / den. No allowed
// key: zeros.
void AttendQuery(const AttnArgs& a, int64_t bi, int64_t ti, std::vector<int32_t>* idx,
                 std::vector<float>* buf) {
  const int64_t s_n = a.s, d_n = a.d, g_n = a.h / a.hkv;
  const int32_t qp = a.q_pos[bi * a.t + ti], qs = a.q_seg[bi * a.t + ti];
  idx->clear();
  for (int64_t s = 0; s < s_n; ++s) {
    const int64_t ks = bi * s_n + s;
    if (a.k_valid[ks] && a.k_pos[ks] <= qp && a.k_seg[ks] == qs) {
      idx->push_back(static_cast<int32_t>(s));
    }
  }
  const int64_t n = static_cast<int64_t>(idx->size());
  float* out = a.out + (bi * a.t + ti) * a.h * d_n;
  if (n == 0) {
    for (int64_t i = 0; i < a.h * d_n; ++i) out[i] = 0.0f;
    return;
  }
  const int64_t padded = (n + 15) / 16 * 16;
  buf->resize(padded);
  float* p = buf->data();
  for (int64_t hk = 0; hk < a.hkv; ++hk) {
    const float* kh = a.k + (bi * a.hkv + hk) * s_n * d_n;
    const float* vh = a.v + (bi * a.hkv + hk) * s_n * d_n;
    for (int64_t gi = 0; gi < g_n; ++gi) {
      const int64_t head = hk * g_n + gi;
      const float* qh = a.q + ((bi * a.t + ti) * a.h + head) * d_n;
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kh + (*idx)[j] * d_n;
        Vec acc = Zero();
        for (int64_t c = 0; c < d_n; c += 16) acc = Fma(Load(qh + c), Load(kj + c), acc);
        p[j] = Tree16(acc) * a.scale;
        m = std::max(m, p[j]);
      }
      Vec total = Zero();
      const Vec mv = Set1(m);
      for (int64_t j = 0; j < padded; j += 16) {
        const Vec e = KeepN(Exp(Sub(LoadN(p + j, n - j), mv)), n - j);
        Store(p + j, e);
        total = Add(total, e);
      }
      const Vec den = Set1(Tree16(total));
      float* oh = out + head * d_n;
      for (int64_t c = 0; c < d_n; c += 16) {
        Vec acc = Zero();
        for (int64_t j = 0; j < n; ++j) acc = Fma(Set1(p[j]), Load(vh + (*idx)[j] * d_n + c), acc);
        Store(oh + c, Div(acc, den));
      }
    }
  }
}

void Attention(xla::ffi::ThreadPool& pool, const AttnArgs& a) {
  qurl_jax::RunParallel(pool, a.b * a.t, a.b * a.t * a.s * a.h * a.d * 2,
                        [&a](int64_t item) {
    thread_local std::vector<int32_t> idx;
    thread_local std::vector<float> buf;
    AttendQuery(a, item / a.t, item % a.t, &idx, &buf);
  });
}

// ------------------------------------------------------------------------------- log-probs
// z = logits / temperature; m = max z; S = Tree16(lanes: Exp(z_i - m) summed in order of i by
// lane i % 16); logp = (z[target] - m) - log(S), the log in double rounded to float.
float LogprobRow(const float* logits, int64_t v, int32_t target, float temperature) {
  const Vec tv = Set1(temperature);
  Vec mx = Set1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < v; i += 16) {
    const Vec z = Div(LoadN(logits + i, v - i), tv);
    mx = Max(mx, KeepNOr(z, v - i, -std::numeric_limits<float>::infinity()));
  }
  const float m = Max16(mx);
  const Vec mv = Set1(m);
  Vec total = Zero();
  for (int64_t i = 0; i < v; i += 16) {
    const Vec z = Div(LoadN(logits + i, v - i), tv);
    total = Add(total, KeepN(Exp(Sub(z, mv)), v - i));
  }
  const float log_s = static_cast<float>(std::log(static_cast<double>(Tree16(total))));
  const float zt = logits[target] / temperature;
  return (zt - m) - log_s;
}
