"""Exact on-policy numerics (`train.on_policy_numerics='exact'`, `models.exact`): the fixed-order
kernels against NumPy summed in the documented order, and the rollout's log-probs against the
learner's, bit for bit, through every sampler.

The references below never call the code under test: a fused multiply-add is computed in long
double (the 64-bit mantissa holds the f32 x f32 product exactly; the one rounding to float32
is the fused one's), every other operation in float32 NumPy, one operation at a time.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qurl_jax.bench import on_policy
from qurl_jax.cpu_kernels import fixed_order
from qurl_jax.models import ModelConfig
from qurl_jax.runtime.errors import ConfigError
from tests.cli import REPO

pytestmark = pytest.mark.skipif(not fixed_order.available(),
                                reason="the fixed-order CPU kernels need AVX2 + FMA")

F32 = np.float32


# -------------------------------------------------------------------- NumPy, documented order
def fma(a, b, c) -> np.ndarray:
    """Fused a * b + c of float32 arrays, rounded once to float32."""
    ld = np.longdouble
    return (np.asarray(a, F32).astype(ld) * np.asarray(b, F32).astype(ld)
            + np.asarray(c, F32).astype(ld)).astype(F32)


def tree16(lanes: np.ndarray) -> np.ndarray:
    """The 16 lanes [..., 16] added halves first: (l + l+8), then +4, +2, +1."""
    s = lanes.astype(F32)
    while s.shape[-1] > 1:
        h = s.shape[-1] // 2
        s = s[..., :h] + s[..., h:]
    return s[..., 0]


def lane_chunks(x: np.ndarray) -> np.ndarray:
    """x [..., E] as [..., ceil(E / 16), 16], zero-padded: lane l of chunk c is x[16 c + l]."""
    e = x.shape[-1]
    pad = -(-e // 16) * 16 - e
    x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1)
    return x.reshape(x.shape[:-1] + (-1, 16))


def np_exp(x: np.ndarray) -> np.ndarray:
    """The kernels' exp: clamp at -87, n = round(x log2 e), r = x - n ln2 in two fused steps,
    Horner on the degree-6 Taylor polynomial (fused), times 2^n."""
    x = np.maximum(np.asarray(x, F32), F32(-87.0))
    n = np.rint(x * F32(1.44269504088896341))
    r = fma(-n, F32(0.693359375), x)
    r = fma(-n, F32(-2.12194440e-4), r)
    p = np.full_like(x, F32(1.0 / 720))
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = fma(p, r, np.full_like(x, F32(c)))
    return p * np.ldexp(F32(1.0), n.astype(np.int32)).astype(F32)


def np_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    acc = np.zeros((a.shape[0], b.shape[1]), F32)
    for k in range(a.shape[1]):
        acc = fma(a[:, k:k + 1], b[k][None], acc)
    return acc


def np_block_matmul(a, a_scale, b, b_scale, block_n):
    """Group partials P_G (fused chains); u_G = P_G * a_scale; eight lanes of fused chains of
    u_G * b_scale over the first 8 * floor(G / 8) groups (group G in lane G % 8), a tail chain
    over the rest, (((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))) + tail."""
    m, n = a.shape[0], b.shape[1]
    groups = a_scale.shape[1]
    g = a.shape[1] // groups
    cols = np.arange(n) // block_n
    main = groups // 8 * 8
    lanes = [np.zeros((m, n), F32) for _ in range(8)]
    tail = np.zeros((m, n), F32)
    for group in range(groups):
        partial = np.zeros((m, n), F32)
        for k in range(group * g, (group + 1) * g):
            partial = fma(a[:, k:k + 1], b[k][None], partial)
        u = partial * a_scale[:, group:group + 1]
        if group < main:
            lanes[group % 8] = fma(u, b_scale[group, cols][None], lanes[group % 8])
        else:
            tail = fma(u, b_scale[group, cols][None], tail)
    tree = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5])
                                                              + (lanes[6] + lanes[7]))
    return tree + tail


def np_rms_norm(x, gain, eps):
    chunks = lane_chunks(x)
    acc = np.zeros(x.shape[:-1] + (16,), F32)
    for c in range(chunks.shape[-2]):
        acc = fma(chunks[..., c, :], chunks[..., c, :], acc)
    mean = tree16(acc) / F32(x.shape[-1])
    r = F32(1.0) / np.sqrt(mean + F32(eps))
    return gain * (x * r[..., None])


def np_attention(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg):
    b, t, h, d = q.shape
    g = h // k.shape[1]
    scale = F32(1.0 / np.sqrt(d))
    out = np.zeros_like(q)
    for bi in range(b):
        for ti in range(t):
            keys = [s for s in range(k.shape[2]) if k_valid[bi, s] and k_pos[bi, s] <= q_pos[bi, ti]
                    and k_seg[bi, s] == q_seg[bi, ti]]
            if not keys:
                continue
            for head in range(h):
                kh, qh = k[bi, head // g, keys], q[bi, ti, head]
                acc = np.zeros((len(keys), 16), F32)
                for c in range(d // 16):
                    acc = fma(qh[None, 16 * c:16 * c + 16], kh[:, 16 * c:16 * c + 16], acc)
                scores = tree16(acc) * scale
                p = np_exp(scores - scores.max())
                den = tree16(_ordered_lane_sum(lane_chunks(p)))
                o = np.zeros(d, F32)
                for j, s in enumerate(keys):
                    o = fma(np.full(d, p[j], F32), v[bi, head // g, s], o)
                out[bi, ti, head] = o / den
    return out


def _ordered_lane_sum(chunks: np.ndarray) -> np.ndarray:
    """Lane-wise sum of chunks [C, 16] in chunk order, from 0."""
    acc = np.zeros(16, F32)
    for c in chunks:
        acc = acc + c
    return acc


def np_logprobs(logits, targets, temperature):
    z = (logits / F32(temperature)).astype(F32)
    m = z.max(axis=-1)
    chunks = lane_chunks(np_exp(z - m[:, None]))
    mask = lane_chunks(np.ones_like(z))  # padded lanes hold 0, not exp(0 - m)
    total = np.zeros((z.shape[0], 16), F32)
    for c in range(chunks.shape[1]):
        total = total + chunks[:, c] * mask[:, c]
    log_s = np.log(tree16(total).astype(np.float64)).astype(F32)
    return (z[np.arange(z.shape[0]), targets] - m) - log_s


# ---------------------------------------------------------------------------------- kernels
RNG = np.random.default_rng(0)


def test_matmul_is_the_fused_chain_over_k_for_any_rows_and_either_layout():
    a = RNG.standard_normal((300, 70)).astype(F32)
    b = RNG.standard_normal((70, 37)).astype(F32)
    want = np_matmul(a[:13], b)
    got = np.asarray(fixed_order.matmul(jnp.asarray(a[:13]), jnp.asarray(b)))
    np.testing.assert_array_equal(got, want)
    # The same rows inside a 300-row call, and against the transposed layout (the tied head).
    np.testing.assert_array_equal(np.asarray(fixed_order.matmul(jnp.asarray(a), jnp.asarray(b)))
                                  [:13], want)
    np.testing.assert_array_equal(np.asarray(fixed_order.matmul(
        jnp.asarray(a[:13]), jnp.asarray(np.ascontiguousarray(b.T)), transposed=True)), want)


@pytest.mark.parametrize("groups, block_n", [(3, 64), (11, 64), (17, 1)])
def test_block_scaled_fp8_matmul_combines_group_partials_in_the_documented_order(groups,
                                                                               block_n):
    m, g, n = 9, 16, 70
    a = (RNG.standard_normal((m, groups * g)) * 30).astype(ml_dtypes.float8_e4m3fn).astype(F32)
    codes = (RNG.standard_normal((groups * g, n)) * 30).astype(ml_dtypes.float8_e4m3fn)
    a_scale = RNG.uniform(0.1, 2.0, (m, groups)).astype(F32)
    b_scale = RNG.uniform(0.1, 2.0, (groups, -(-n // block_n))).astype(F32)
    got = np.asarray(fixed_order.matmul_e4m3(jnp.asarray(a), jnp.asarray(a_scale),
                                             jnp.asarray(codes), jnp.asarray(b_scale), block_n))
    np.testing.assert_array_equal(got, np_block_matmul(a, a_scale, codes.astype(F32), b_scale,
                                                       block_n))


_XLA_EMULATION_SCRIPT = """
import jax, jax.numpy as jnp, numpy as np
from qurl_jax.quant._dot_general import block_scaled_matmul, fast_block_scaled_matmul
from qurl_jax.runtime import xla_cpu
rng = np.random.default_rng(0)
shapes = [(64, 5, 576, 128), (200, 12, 192, 128), (640, 9, 128, 1), (100, 5, 64, 1),
          (896, 17, 1536, 1), (100, 9, 64, 1), (48, 3, 576, 128), (128, 3, 96, 128)]
for dots in ("xla", "learner"):
    opts = xla_cpu.learner_compiler_options(dots)
    for m, groups, n, block_n in shapes:
        a = jnp.asarray(rng.standard_normal((m, groups * 128)) * 30, jnp.float8_e4m3fn)
        b = jnp.asarray(rng.standard_normal((groups * 128, n)) * 30, jnp.float8_e4m3fn)
        sa = jnp.asarray(rng.uniform(0.01, 2.0, (m, groups)), jnp.float32)
        sb = jnp.asarray(rng.uniform(0.01, 2.0, (groups, -(-n // block_n))), jnp.float32)
        xla = jax.jit(block_scaled_matmul, static_argnums=4, compiler_options=opts)
        fast = jax.jit(fast_block_scaled_matmul, static_argnums=4, compiler_options=opts)
        kernel = "qurl_fixed_matmul_e4m3" in fast.lower(a, sa, b, sb, block_n).as_text()
        equal = bool(jnp.array_equal(fast(a, sa, b, sb, block_n), xla(a, sa, b, sb, block_n)))
        print(dots, m, groups, n, block_n, int(kernel), int(equal))
"""


def test_the_fp8_learners_product_is_xlas_emulation_bit_for_bit():
    """`fast_block_scaled_matmul` (the FP8 learner's three products) gives the bits of XLA:CPU's
    emulation, with YNNPACK's products and with Eigen's (`train.cpu_dots`), at XLA's default
    optimisation level (not the suite's flags: a subprocess), where it takes the kernel
    (M >= 64, N a multiple of 64, 8 or more groups only at a multiple of 8 rows); elsewhere it
    is XLA's own (the last three shapes)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", _XLA_EMULATION_SCRIPT], check=True, env=env,
                         cwd=REPO, capture_output=True, text=True, timeout=600).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith(("xla", "learner"))]
    assert len(rows) == 16
    for dots, m, groups, n, block_n, kernel, equal in rows:
        assert equal == "1", (dots, m, groups, n, block_n)
        xla_only = (m, groups, n) in (("100", "9", "64"), ("48", "3", "576"), ("128", "3", "96"))
        assert kernel == ("0" if xla_only else "1"), (m, groups, n)


def test_rms_norm_sums_squares_in_lanes_and_the_tree():
    x = (RNG.standard_normal((5, 70)) * 3).astype(F32)
    gain = RNG.uniform(0.5, 2.0, 70).astype(F32)
    np.testing.assert_array_equal(np.asarray(fixed_order.rms_norm(jnp.asarray(x),
                                                                  jnp.asarray(gain), 1e-5)),
                                  np_rms_norm(x, gain, 1e-5))


def test_attention_reduces_each_querys_allowed_keys_in_slot_order():
    b, t, h, hkv, s, d = 2, 6, 4, 2, 23, 32
    q = RNG.standard_normal((b, t, h, d)).astype(F32)
    k, v = (RNG.standard_normal((b, hkv, s, d)).astype(F32) for _ in range(2))
    q_pos = RNG.integers(0, 20, (b, t)).astype(np.int32)
    k_pos = RNG.integers(0, 20, (b, s)).astype(np.int32)
    k_valid = RNG.random((b, s)) < 0.8
    q_pos[0, 0] = -1  # sees no key: zeros
    q_seg = RNG.integers(0, 2, (b, t)).astype(np.int32)
    k_seg = RNG.integers(0, 2, (b, s)).astype(np.int32)
    got = np.asarray(fixed_order.attention(*map(jnp.asarray, (q, k, v, q_pos, k_pos, k_valid,
                                                               q_seg, k_seg))))
    np.testing.assert_array_equal(got, np_attention(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg))
    assert not got[0, 0].any() and got[1].any()


def test_logprobs_sum_the_vocabulary_in_lanes_and_the_tree():
    logits = (RNG.standard_normal((6, 1000)) * 4).astype(F32)
    targets = RNG.integers(0, 1000, 6)
    got = np.asarray(fixed_order.logprobs(jnp.asarray(logits), jnp.asarray(targets), 0.7))
    np.testing.assert_array_equal(got, np_logprobs(logits, targets, 0.7))


_ISA_SCRIPT = """
import numpy as np, jax.numpy as jnp
from qurl_jax.cpu_kernels import fixed_order
rng = np.random.default_rng(1)
a, b = rng.standard_normal((37, 300)).astype('f4'), rng.standard_normal((300, 50)).astype('f4')
x = rng.standard_normal((9, 200)).astype('f4')
out = [fixed_order.matmul(jnp.asarray(a), jnp.asarray(b)),
       fixed_order.rms_norm(jnp.asarray(x), jnp.ones(200), 1e-6),
       fixed_order.logprobs(jnp.asarray(x), jnp.arange(9), 0.9)]
np.savez(__import__('sys').argv[1], *[np.asarray(o) for o in out])
"""


def test_avx512_and_avx2_builds_give_the_same_bits(tmp_path):
    """The kernels compiled for AVX2 (forced with QURL_JAX_CPU_KERNELS_ISA) and the default
    build agree bit for bit: a rollout on one machine and a learner on another would too."""
    outs = []
    for isa in ("", "avx2"):
        path = tmp_path / f"out{isa}.npz"
        env = dict(os.environ, QURL_JAX_CPU_KERNELS_ISA=isa, JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, "-c", _ISA_SCRIPT, str(path)], check=True, env=env,
                       cwd=REPO, timeout=300)
        outs.append(np.load(path))
    for name in outs[0].files:
        np.testing.assert_array_equal(outs[0][name], outs[1][name])


# ----------------------------------------------------------------------- rollout vs learner
# The outlier model, shrunk for the default suite: two layers, 128 wide (one FP8 block).
SMALL = on_policy.OUTLIER_CONFIG.replace(vocab_size=256, hidden_size=128, intermediate_size=384,
                                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32)


def _gap(config: ModelConfig, precision: str, sampler: str, numerics: str, greedy: bool,
         prompts: int = 4, tokens: int = 12) -> dict[str, float]:
    config, params = on_policy.outlier_model(config.replace(numerics=numerics))
    # Prompts of 3 to 21 tokens in one batch: left pads of different widths.
    prompt_ids = on_policy.random_prompts(config, prompts, seed=1, shortest=3, longest=21)
    metrics, _ = on_policy.end_to_end(config, params, prompt_ids, precision=precision,
                                      sampler=sampler, n=2, max_new_tokens=tokens,
                                      temperature=0.7, greedy=greedy, seed=3)
    return metrics


@pytest.mark.parametrize("sampler", ("static", "paged"))  # all three: the slow tests below
def test_exact_fp8_block_rollout_logprobs_are_the_learners(sampler):
    m = _gap(SMALL, "fp8_block", sampler, "exact", greedy=False)
    assert m["tokens"] > 40
    assert m["equal_share"] == 1.0 and m["logp_gap_abs_max"] == 0.0
    assert m["kl_behav_prox_k3"] == 0.0


def test_exact_fp32_greedy_rollout_logprobs_are_the_learners():
    m = _gap(SMALL, "fp", "static", "exact", greedy=True)
    assert m["equal_share"] == 1.0 and m["logp_gap_abs_max"] == 0.0


def test_default_numerics_leave_a_gap():
    """Without exact numerics the same rollout and learner disagree (the test above can fail)."""
    m = _gap(SMALL, "fp8_block", "static", "default", greedy=False)
    assert m["logp_gap_abs_max"] > 0.0 and m["equal_share"] < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ("fp", "fp8_block"))
@pytest.mark.parametrize("greedy", (False, True))
@pytest.mark.parametrize("sampler", on_policy.SAMPLERS)
def test_exact_rollouts_of_the_outlier_model(precision, greedy, sampler):
    m = _gap(on_policy.OUTLIER_CONFIG, precision, sampler, "exact", greedy, prompts=8,
             tokens=24)
    assert m["equal_share"] == 1.0 and m["kl_behav_prox_k3"] == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("precision", ("fp", "fp8_block"))
def test_exact_rollouts_of_smollm2(precision):
    """SmolLM2-135M-Instruct's real weights (the fetched GGUF file), 8 prompts x 2 samples of
    up to 16 tokens per sampler."""
    pytest.importorskip("gguf")
    from qurl_jax.models.fetch import model_path

    if not os.path.exists(model_path()):
        pytest.skip("python -m qurl_jax.models.fetch first")
    config, params = on_policy.load_model("smollm2")
    config = config.replace(numerics="exact")
    prompts = on_policy.random_prompts(config, 8, seed=0)
    for sampler in on_policy.SAMPLERS:
        for greedy in (False, True):
            m, _ = on_policy.end_to_end(config, params, prompts, precision=precision,
                                        sampler=sampler, n=2, max_new_tokens=16, greedy=greedy)
            assert m["equal_share"] == 1.0 and m["kl_behav_prox_k3"] == 0.0, (sampler, greedy, m)


# ---------------------------------------------------------------------------------- config
def test_exact_numerics_reject_rollouts_the_learner_does_not_run():
    from qurl_jax.config.base import load_config_file, validate

    c = load_config_file(os.path.join(REPO, "configs", "arith_tiny.py"))
    validate(c)
    c.train.on_policy_numerics = "exact"
    c.rollout.precision = "int8"
    with pytest.raises(ConfigError, match="rollout.precision='int8'"):
        validate(c)
    c.rollout.precision = "fp8_block"
    with pytest.raises(ConfigError, match="rollout.quantize_vocab"):
        validate(c)
    c.rollout.quantize_vocab = False
    c.rollout.kv_precision = "int8"
    with pytest.raises(ConfigError, match="rollout.kv_precision"):
        validate(c)
    c.rollout.kv_precision = "bf16"
    validate(c)
    c.model.lora.rank, c.model.lora.base_precision = 8, "fp8"
    with pytest.raises(ConfigError, match="model.lora.rank=8"):
        validate(c)
    c.model.lora.rank = 0
    c.train.on_policy_numerics = "bitwise"
    with pytest.raises(ConfigError, match="train.on_policy_numerics"):
        validate(c)
