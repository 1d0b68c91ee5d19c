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

// Where a block-scaled micro-tile's group partial goes (see GemmItem): its rows' activation
// scales (stride a_scale_ld), the weight scale (one value, or per column when per_column), and
// the accumulator it updates by a fused multiply-add (row stride ld), from 0 when `fresh`.
struct Combine {
  const float* a_scale;
  int64_t a_scale_ld;
  const float* b_scale;
  bool per_column;
  float* dst;
  int64_t ld;
  bool fresh;
};

// One micro-tile: rows [0, MR) of A (row stride lda) times the panel's kNR columns starting at
// `col` (panel row stride kNB), over kc contraction rows. Plain (comb == nullptr): each C element
// continues its fused chain from C (or from 0 when `first`). Block-scaled: the chain starts at 0
// (the group's partial P), then dst = fma(P * a_scale[r], b_scale, fresh ? 0 : dst).
// The contraction loop on its own (noinline, restrict): the accumulators stay in registers.
// Inlined into its caller, GCC kept storing all of them to the stack every iteration.
template <int MR>
__attribute__((noinline)) void KLoop(const float* __restrict a, int64_t lda,
                                     const float* __restrict bp, int64_t kc,
                                     Vec (&__restrict acc)[MR][kNV]) {
  Vec r0[MR][kNV];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) r0[r][j] = acc[r][j];
  }
  for (int64_t kk = 0; kk < kc; ++kk) {
    Vec b[kNV];
    for (int j = 0; j < kNV; ++j) b[j] = Load(bp + kk * kNB + 16 * j);
    for (int r = 0; r < MR; ++r) {
      const Vec av = Set1(a[r * lda + kk]);
      for (int j = 0; j < kNV; ++j) r0[r][j] = Fma(av, b[j], r0[r][j]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) acc[r][j] = r0[r][j];
  }
}

template <int MR>
void Micro(const float* a, int64_t lda, const float* panel, int64_t col, int64_t kc, float* c,
           int64_t ldc, int64_t ncols, bool first, const Combine* comb) {
  Vec acc[MR][kNV];
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) {
      const int64_t left = ncols - 16 * j;
      acc[r][j] = (!comb && !first && left > 0) ? LoadN(c + r * ldc + 16 * j, left) : Zero();
    }
  }
  KLoop<MR>(a, lda, panel + col, kc, acc);
  for (int r = 0; r < MR; ++r) {
    for (int j = 0; j < kNV; ++j) {
      const int64_t left = ncols - 16 * j;
      if (left <= 0) continue;
      if (!comb) {
        StoreN(c + r * ldc + 16 * j, acc[r][j], left);
        continue;
      }
      const Vec sb = comb->per_column ? LoadN(comb->b_scale + 16 * j, left)
                                      : Set1(comb->b_scale[0]);
      const Vec u = Mul(acc[r][j], Set1(comb->a_scale[r * comb->a_scale_ld]));
      float* dst = comb->dst + r * comb->ld + 16 * j;
      StoreN(dst, Fma(u, sb, comb->fresh ? Zero() : LoadN(dst, left)), left);
    }
  }
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
      int64_t j = 0;
      for (; j + 16 <= cols; j += 16) Store(row + j, DecodeE4M3(src + j));
      for (; j < cols; ++j) row[j] = kE4M3[src[j]];
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

template <int MR>
void MicroRows(const GemmArgs& g, const float* panel, int64_t col, int64_t m0, int64_t n0,
               int64_t k0, int64_t kc, bool first, const Combine* comb) {
  const int64_t ncols = std::min<int64_t>(kNR, g.n - n0 - col);
  Micro<MR>(g.a + m0 * g.lda + k0, g.lda, panel, col, kc, g.c + m0 * g.ldc + n0 + col, g.ldc,
            ncols, first, comb);
}

// Rows [m0, m0 + mb) x columns [n0, n0 + kNB) of C, the whole contraction in order.
//
// Block-scaled products combine the G group partials as XLA:CPU's emulation
// (`quant._dot_general.block_scaled_matmul`) does: with u_G = P_G * a_scale[m, G],
//   main = 8 * floor(G / 8); lane l (0..7) = fused chain of u_G * b_scale over G < main with
//   G % 8 == l, from 0; tail = fused chain over G >= main, from 0;
//   c = (((lane0 + lane1) + (lane2 + lane3)) + ((lane4 + lane5) + (lane6 + lane7))) + tail.
// The lanes live in `lanes` [8, mb, kNB] while the groups run, the tail in C.
void GemmItem(const GemmArgs& g, int64_t m0, int64_t mb, int64_t n0, std::vector<float>* scratch,
              std::vector<float>* lanes) {
  const int64_t step = g.group ? g.group : kKC;
  scratch->resize(step * kNB);
  float* panel = scratch->data();
  const int64_t main = g.group ? g.groups / 8 * 8 : 0;
  if (main) lanes->resize(8 * mb * kNB);
  for (int64_t k0 = 0; k0 < g.k; k0 += step) {
    const int64_t kc = std::min(step, g.k - k0);
    PackPanel(g, k0, kc, n0, panel);
    const bool first = k0 == 0;
    const int64_t gi = k0 / step;  // the group, for block-scaled products
    for (int64_t col = 0; col < kNB && n0 + col < g.n; col += kNR) {
      Combine comb{};
      if (g.group) {
        const int64_t n = n0 + col;
        comb.per_column = g.block_n == 1;
        // kNR divides block_n > 1, so a tile never spans two weight blocks.
        comb.b_scale = g.b_scale + gi * g.b_scale_ld + (comb.per_column ? n : n / g.block_n);
        comb.a_scale_ld = g.groups;
        if (gi < main) {
          comb.ld = kNB;
          comb.fresh = gi < 8;
        } else {
          comb.ld = g.ldc;
          comb.fresh = gi == main;
        }
      }
      int64_t r = 0;
      auto rows = [&](auto micro, int64_t at) {
        if (g.group) {
          comb.a_scale = g.a_scale + (m0 + at) * g.groups + gi;
          comb.dst = gi < main ? lanes->data() + ((gi % 8) * mb + at) * kNB + col
                               : g.c + (m0 + at) * g.ldc + n0 + col;
        }
        micro(g, panel, col, m0 + at, n0, k0, kc, first, g.group ? &comb : nullptr);
      };
      for (; r + kMR <= mb; r += kMR) rows(MicroRows<kMR>, r);
      switch (mb - r) {
        case 0: break;
#define QURL_TAIL(n) case n: rows(MicroRows<n>, r); break;
        QURL_TAIL(1) QURL_TAIL(2) QURL_TAIL(3) QURL_TAIL(4) QURL_TAIL(5)
#undef QURL_TAIL
        default: break;
      }
    }
  }
  if (!main) return;
  const int64_t cols = std::min(kNB, g.n - n0);
  const bool tail = main < g.groups;
  for (int64_t r = 0; r < mb; ++r) {
    float* c = g.c + (m0 + r) * g.ldc + n0;
    for (int64_t j = 0; j < cols; j += 16) {
      Vec l[8];
      for (int i = 0; i < 8; ++i) l[i] = LoadN(lanes->data() + (i * mb + r) * kNB + j, cols - j);
      const Vec tree = Add(Add(Add(l[0], l[1]), Add(l[2], l[3])),
                           Add(Add(l[4], l[5]), Add(l[6], l[7])));
      StoreN(c + j, Add(tree, tail ? LoadN(c + j, cols - j) : Zero()), cols - j);
    }
  }
}

void Gemm(xla::ffi::ThreadPool& pool, const GemmArgs& g) {
  const int64_t mbs = (g.m + kMB - 1) / kMB, nbs = (g.n + kNB - 1) / kNB;
  qurl_jax::RunParallel(pool, mbs * nbs, g.m * g.n * g.k, [&g, nbs](int64_t item) {
    thread_local std::vector<float> scratch, lanes;
    const int64_t mi = item / nbs, ni = item % nbs;
    const int64_t m0 = mi * kMB;
    GemmItem(g, m0, std::min(kMB, g.m - m0), ni * kNB, &scratch, &lanes);
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
