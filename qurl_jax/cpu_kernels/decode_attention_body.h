// The decode attention kernel's body over one instruction set's vectors (decode_attention.cc).
// Included once per instruction set, inside that set's namespace, after it has defined
//   QURL_TARGET   the function attribute that enables its instructions, and
//   struct V      its float vector: kLanes lanes, kMaxAcc accumulators for the value pass, and
//                 Zero, Set1, Load (f32, or int8 codes widened), Store, Add, Sub, Mul, Fmadd,
//                 Sum (of the lanes), Sum4 (each of four vectors' lanes, into float[4]), Exp
//                 (x <= 0) and KeepFinite (e where x != -inf, else 0).
// No include guard: each inclusion defines the kernel anew in its own namespace.

// One head's weighted sum of the values over the live slots [0, len), its D = DV vectors in
// registers: out = inv * sum_s p[s] * v_scale[s] * v[s].
template <int DV, typename KV>
QURL_TARGET void WeightedValues(int64_t len, const KV* v, int64_t d_n, const float* p,
                                const float* v_scale, const bool* mask, float inv, float* out) {
  typename V::F acc[DV];
  for (int c = 0; c < DV; ++c) acc[c] = V::Zero();
  for (int64_t s = 0; s < len; ++s) {
    if (!mask[s]) continue;
    const typename V::F w = V::Set1(p[s] * (v_scale ? v_scale[s] : 1.0f));
    const KV* vs = v + s * d_n;
    for (int c = 0; c < DV; ++c) acc[c] = V::Fmadd(w, V::Load(vs + V::kLanes * c), acc[c]);
  }
  const typename V::F scale = V::Set1(inv);
  for (int c = 0; c < DV; ++c) V::Store(out + V::kLanes * c, V::Mul(acc[c], scale));
}

// k_scale, v_scale: per-slot scales of an int8 cache (nullptr for f32).
template <typename KV>
QURL_TARGET void AttendOne(const Shapes& sh, const float* q, const KV* k, const KV* v,
                           const float* k_scale, const float* v_scale, const bool* mask,
                           float* out, std::vector<float>* scratch) {
  const int64_t g_n = sh.groups, d_n = sh.dim, len = sh.length, dv = d_n / V::kLanes;
  // Each head's scores padded to whole vectors with -inf (exactly 0 after the exponential).
  const int64_t stride = (len + V::kLanes - 1) / V::kLanes * V::kLanes;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  // One per-thread buffer, reused across calls (this runs per (row, kv head) every decode step):
  // scores [G, stride], then the row maxima and sums [G] each.
  scratch->resize(g_n * (stride + 2));
  float* scores = scratch->data();
  float* row_max = scores + g_n * stride;
  float* row_sum = row_max + g_n;
  std::fill(row_max, row_max + g_n, neg_inf);
  for (int64_t g = 0; g < g_n; ++g) {
    std::fill(scores + g * stride + len, scores + (g + 1) * stride, neg_inf);
  }
  // Scores four slots at a time: four independent chains of products, whose lanes are summed
  // together (V::Sum4).
  bool any = false;
  for (int64_t s0 = 0; s0 < len; s0 += 4) {
    const int64_t n4 = std::min<int64_t>(4, len - s0);
    bool live = false;
    for (int64_t i = 0; i < n4; ++i) live |= mask[s0 + i];
    if (!live) {
      for (int64_t g = 0; g < g_n; ++g) std::fill_n(scores + g * stride + s0, n4, neg_inf);
      continue;
    }
    any = true;
    const KV* k0 = k + s0 * d_n;  // slots past `len` repeat the last one (never stored)
    const KV* k1 = k + (s0 + std::min<int64_t>(1, n4 - 1)) * d_n;
    const KV* k2 = k + (s0 + std::min<int64_t>(2, n4 - 1)) * d_n;
    const KV* k3 = k + (s0 + n4 - 1) * d_n;
    for (int64_t g = 0; g < g_n; ++g) {
      const float* qg = q + g * d_n;
      typename V::F qc = V::Load(qg);
      typename V::F a[4] = {V::Mul(qc, V::Load(k0)), V::Mul(qc, V::Load(k1)),
                            V::Mul(qc, V::Load(k2)), V::Mul(qc, V::Load(k3))};
      for (int64_t c = 1; c < dv; ++c) {
        const int64_t o = V::kLanes * c;
        qc = V::Load(qg + o);
        a[0] = V::Fmadd(qc, V::Load(k0 + o), a[0]);
        a[1] = V::Fmadd(qc, V::Load(k1 + o), a[1]);
        a[2] = V::Fmadd(qc, V::Load(k2 + o), a[2]);
        a[3] = V::Fmadd(qc, V::Load(k3 + o), a[3]);
      }
      float sum[4];
      V::Sum4(a, sum);
      for (int64_t i = 0; i < n4; ++i) {
        const int64_t slot = s0 + i;
        const float slot_scale = k_scale ? sh.scale * k_scale[slot] : sh.scale;
        const float score = mask[slot] ? sum[i] * slot_scale : neg_inf;
        scores[g * stride + slot] = score;
        row_max[g] = std::max(row_max[g], score);
      }
    }
  }
  if (!any) {
    for (int64_t i = 0; i < g_n * d_n; ++i) out[i] = 0.0f;
    return;
  }
  // Probabilities (unnormalised) in place; masked slots (-inf) become exactly 0.
  for (int64_t g = 0; g < g_n; ++g) {
    const typename V::F m = V::Set1(row_max[g]);
    typename V::F total = V::Zero();
    float* sg = scores + g * stride;
    for (int64_t s = 0; s < stride; s += V::kLanes) {
      const typename V::F x = V::Load(sg + s);
      const typename V::F e = V::KeepFinite(x, V::Exp(V::Sub(x, m)));
      V::Store(sg + s, e);
      total = V::Add(total, e);
    }
    row_sum[g] = V::Sum(total);
  }
  // Weighted sums of the values: per head with D in registers for the usual head sizes (a
  // compile-time loop), else G heads and D / kLanes vectors at a time within the register budget.
  if (dv == 2 || dv == 4 || dv == 8) {
    for (int64_t g = 0; g < g_n; ++g) {
      auto pass = dv == 2 ? WeightedValues<2, KV> : dv == 4 ? WeightedValues<4, KV>
                                                            : WeightedValues<8, KV>;
      pass(len, v, d_n, scores + g * stride, v_scale, mask, 1.0f / row_sum[g], out + g * d_n);
    }
    return;
  }
  const int64_t c_chunk = std::min<int64_t>(dv, V::kMaxAcc);
  const int64_t g_chunk = V::kMaxAcc / c_chunk;
  for (int64_t g0 = 0; g0 < g_n; g0 += g_chunk) {
    const int64_t gc = std::min(g_chunk, g_n - g0);
    for (int64_t c0 = 0; c0 < dv; c0 += c_chunk) {
      const int64_t cc = std::min(c_chunk, dv - c0);
      typename V::F acc[V::kMaxAcc];
      for (int64_t i = 0; i < gc * cc; ++i) acc[i] = V::Zero();
      for (int64_t s = 0; s < len; ++s) {
        if (!mask[s]) continue;
        const KV* vs = v + s * d_n + V::kLanes * c0;
        const float vscale = v_scale ? v_scale[s] : 1.0f;
        for (int64_t c = 0; c < cc; ++c) {
          const typename V::F vc = V::Load(vs + V::kLanes * c);
          for (int64_t g = 0; g < gc; ++g) {
            acc[g * cc + c] = V::Fmadd(V::Set1(scores[(g0 + g) * stride + s] * vscale), vc,
                                       acc[g * cc + c]);
          }
        }
      }
      for (int64_t g = 0; g < gc; ++g) {
        const typename V::F inv = V::Set1(1.0f / row_sum[g0 + g]);
        for (int64_t c = 0; c < cc; ++c) {
          V::Store(out + (g0 + g) * d_n + V::kLanes * (c0 + c), V::Mul(acc[g * cc + c], inv));
        }
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
