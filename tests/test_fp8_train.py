"""FP8 training product (Jet-RL's unified precision flow): quantizers, custom gradient, parity with
the rollout's `fp8_block` forward, and the product under jit, remat, scan and sharding.

Expected values come from an independent NumPy emulation (ml_dtypes' float8_e4m3fn conversion,
scale = max|x| * float32(1 / 448), codes = E4M3(clip(x * (1 / scale), +-448)), loops over blocks and
groups, float64 accumulation), never from the functions under test. (The scale is AQT's
max|x| / 448; XLA rewrites a division by a constant into a product with its float32 reciprocal,
which differs from the correctly rounded quotient by one ulp for about half of all values.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax.bench import fp8 as bench
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import (
    ModelConfig,
    Transformer,
    init_params,
    param_logical_axes,
    positions_from_mask,
    token_logprobs,
)
from qurl_jax.parallel.sharding import batch_sharding, make_mesh, shard_params
from qurl_jax.quant import (
    QuantFormat,
    TrainKernel,
    bind_train_precision,
    fp8_block_linear,
    get_recipe,
    make_train_dot_general,
    mark_train_kernels,
    quantize_kernel,
    requantize,
    rollout_dot_general,
    train_dot_general,
)
from qurl_jax.quant._qtensor import quantize_row_groups
from qurl_jax.rl.objectives import ObjectiveConfig
from tests.tolerances import assert_product_close, fp8_accumulation_rtol

FP8 = QuantFormat.FP8_E4M3
LINEAR_DN = (((2,), (0,)), ((), ()))
E4M3_MAX = np.float32(448.0)


# ----------------------------------------------------------------------------- NumPy emulation


def np_quant_rows(x: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """x f32[R, C] in 1 x g groups along C (C zero-padded): codes f32[R, G*g], scales f32[R, G]."""
    r, c = x.shape
    ng = math.ceil(c / g)
    xp = np.zeros((r, ng * g), np.float32)
    xp[:, :c] = x
    codes = np.zeros_like(xp)
    scales = np.zeros((r, ng), np.float32)
    for j in range(ng):
        blk = xp[:, j * g:(j + 1) * g]
        amax = np.abs(blk).max(axis=1)
        amax = np.where(amax == 0, np.float32(1), amax).astype(np.float32)
        s = (amax * (np.float32(1) / E4M3_MAX)).astype(np.float32)
        inv = (np.float32(1) / s).astype(np.float32)
        y = np.clip(blk * inv[:, None], -E4M3_MAX, E4M3_MAX).astype(np.float32)
        codes[:, j * g:(j + 1) * g] = y.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)
        scales[:, j] = s
    return codes, scales


def np_quant_blocks(w: np.ndarray, br: int, bc: int) -> tuple[np.ndarray, np.ndarray]:
    """w f32[K, N] in br x bc blocks: (codes f32[K, N], scales f32[nK, nN])."""
    k, n = w.shape
    codes = np.zeros_like(w)
    scales = np.zeros((math.ceil(k / br), math.ceil(n / bc)), np.float32)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            q, s = np_quant_rows(blk.reshape(1, -1), blk.size)
            codes[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = q[0, :blk.size].reshape(blk.shape)
            scales[i, j] = s[0, 0]
    return codes, scales


def np_fp8_linear(x: np.ndarray, w: np.ndarray, dy: np.ndarray, mask: np.ndarray,
                  block: tuple[int, int] = (128, 128), tg: int = 128) -> tuple[np.ndarray, ...]:
    """(Y, dX, dW) in float64 for x f32[M, K], w f32[K, N], dy f32[M, N], mask bool[M].

    Forward X (1 x br) x W (br x bc blocks); dgrad dY (1 x bc) x W^T (same blocks); wgrad
    X^T (tg tokens, from the dequantized FP8 activations) x dY (tg tokens), all block by block.
    """
    (m, k), n = x.shape, w.shape[1]
    br, bc = min(block[0], k), min(block[1], n)
    x = np.where(mask[:, None], x, 0).astype(np.float32)
    dy = np.where(mask[:, None], dy, 0).astype(np.float32)
    wq, ws = np_quant_blocks(w, br, bc)
    xq, xs = np_quant_rows(x, br)
    dyq, dys = np_quant_rows(dy, bc)
    y, dx, dw = np.zeros((m, n)), np.zeros((m, k)), np.zeros((k, n))
    for i in range(ws.shape[0]):
        rows = slice(i * br, min((i + 1) * br, k))
        for j in range(ws.shape[1]):
            cols = slice(j * bc, min((j + 1) * bc, n))
            w_blk = wq[rows, cols].astype(np.float64) * ws[i, j]
            y[:, cols] += (xq[:, rows] * xs[:, i:i + 1]).astype(np.float64) @ w_blk
            dx[:, rows] += (dyq[:, cols] * dys[:, j:j + 1]).astype(np.float64) @ w_blk.T
    x_deq = (xq.reshape(m, xs.shape[1], br) * xs[..., None]).reshape(m, -1).astype(np.float32)
    # 128x1 groups of [M, K] are 1x128 groups of the transposes; tokens zero-padded to 128
    # (the product shrinks a group to M when M < 128: the same codes and scales).
    xtq, xts = np_quant_rows(np.ascontiguousarray(x_deq[:, :k].T), tg)
    dytq, dyts = np_quant_rows(np.ascontiguousarray(dy.T), tg)
    for t in range(xts.shape[1]):
        toks = slice(t * tg, (t + 1) * tg)
        dw += (xtq[:, toks] * xts[:, t:t + 1]).astype(np.float64) @ (
            dytq[:, toks] * dyts[:, t:t + 1]).astype(np.float64).T
    return y, dx, dw


def exact_operand(rng: np.random.Generator, rows: int, cols: int, power: int) -> np.ndarray:
    """f32[rows, cols] = 2^power * (integers in [-8, 8], +-448 in every 1x128 row group and every
    128x1 column group), so every scale is 2^power and every FP8 product and sum is exact."""
    a = rng.integers(-8, 9, size=(rows, cols)).astype(np.float32)
    i, j = np.indices((rows, cols))
    width = np.minimum(128, cols - (j // 128) * 128)  # width of column j's row group
    height = np.minimum(128, rows - (i // 128) * 128)  # height of row i's column group
    peak = (j % 128 == (i % 128) % width) | (i % 128 == (j % 128) % height)
    a[peak] = 448 * rng.choice([-1, 1], size=int(peak.sum()))
    return a * np.float32(2.0**power)


def _grads(x: np.ndarray, w: np.ndarray, dy: np.ndarray, mask: np.ndarray | None = None,
           ) -> tuple[np.ndarray, ...]:
    """(Y, dX, dW) of fp8_block_linear through jax.vjp, jitted."""

    @jax.jit
    def run(x, w, dy, mask):
        y, vjp = jax.vjp(lambda a, b: fp8_block_linear(a, b, token_mask=mask), x, w)
        return (y, *vjp(dy))

    mask = None if mask is None else jnp.asarray(mask)
    return tuple(np.asarray(a) for a in run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(dy), mask))


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ----------------------------------------------------------------------------- quantizers


@pytest.mark.parametrize("shape,g", [((5, 256), 128), ((7, 200), 128), ((3, 40), 64)])
def test_quantize_row_groups_matches_numpy_exactly(shape: tuple[int, int], g: int) -> None:
    rng = np.random.default_rng(0)
    # magnitudes over ~12 binades, so codes fall into E4M3 subnormals as well as normals
    x = (rng.normal(size=shape) * 2.0 ** rng.integers(-6, 6, size=shape)).astype(np.float32)
    codes, scales = quantize_row_groups(jnp.asarray(x), FP8, g)
    want_codes, want_scales = np_quant_rows(x, g)
    assert codes.dtype == jnp.float8_e4m3fn and codes.shape == want_codes.shape
    np.testing.assert_array_equal(np.asarray(codes, np.float32), want_codes)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)


def test_quantize_kernel_blocks_match_numpy_exactly() -> None:
    w = (np.random.default_rng(1).normal(size=(200, 300)) * 0.05).astype(np.float32)
    q = quantize_kernel(jnp.asarray(w), FP8, (128, 128), FP8)
    codes, scales = np_quant_blocks(w, 128, 128)
    np.testing.assert_array_equal(np.asarray(q.qvalue, np.float32), codes)
    np.testing.assert_array_equal(np.asarray(q.scale), scales)


def test_e4m3_round_trip_error_bound() -> None:
    """|x - deq(x)| <= 2^-4 |x| (3 mantissa bits, round to nearest) for normal codes, and at most
    half the subnormal spacing (2^-10 of the group's scale) below them."""
    rng = np.random.default_rng(2)
    x = (rng.normal(size=(16, 300)) * 2.0 ** rng.integers(-8, 4, size=(16, 300)))
    x = x.astype(np.float32)
    codes, scales = quantize_row_groups(jnp.asarray(x), FP8, 128)
    s = np.repeat(np.asarray(scales), 128, axis=1)[:, :300]
    deq = np.asarray(codes, np.float32)[:, :300] * s
    err = np.abs(deq - x)
    assert np.all(err <= 2.0**-4 * np.abs(x) + 2.0**-10 * s)
    assert np.all(np.abs(np.asarray(codes, np.float32)) <= 448)


def test_all_zero_groups_give_zero_codes_and_gradients() -> None:
    x = np.zeros((4, 200), np.float32)
    x[1, 130:] = 3.0  # one non-zero group; the others are all zero
    codes, scales = quantize_row_groups(jnp.asarray(x), FP8, 128)
    assert np.all(np.isfinite(np.asarray(scales)))
    deq = np.asarray(codes, np.float32)[:, :200] * np.repeat(np.asarray(scales), 128, 1)[:, :200]
    assert np.all(deq[x == 0] == 0)
    np.testing.assert_allclose(deq, x, rtol=1e-6)
    w = np.zeros((200, 150), np.float32)
    q = quantize_kernel(jnp.asarray(w), FP8, (128, 128), FP8)
    np.testing.assert_array_equal(np.asarray(q.dequantize()), w)
    y, dx, dw = _grads(np.zeros((3, 200), np.float32), w, np.zeros((3, 150), np.float32))
    for a in (y, dx, dw):
        assert np.all(a == 0)


def test_values_at_max_do_not_overflow() -> None:
    """x = +-max|x| of its group maps to +-448 exactly (x * (1/s) may round above 448; clipped)."""
    rng = np.random.default_rng(3)
    amax = (2.0 ** rng.uniform(-20, 20, size=512)).astype(np.float32)
    x = np.stack([amax, -amax, amax * 0.5], axis=1).astype(np.float32)
    codes, scales = quantize_row_groups(jnp.asarray(x), FP8, 3)
    codes = np.asarray(codes, np.float32)
    assert np.all(np.isfinite(codes))
    np.testing.assert_array_equal(np.abs(codes[:, :2]), 448.0)
    np.testing.assert_allclose(codes[:, 0] * np.asarray(scales)[:, 0], amax, rtol=2**-4)


# ----------------------------------------------------------------------------- custom gradient


def test_gradients_equal_numpy_emulation_exactly() -> None:
    """On operands whose every scale is a power of two and every FP8 product and partial sum is
    exact in float32, the forward and both gradients equal the emulation bit for bit where FP8
    products are summed in float32 (CPU), and within the FP8 GEMM's accumulation on a GPU
    (`fp8_accumulation_rtol`: an H200 missed exactness by up to 2^-11.9 of the |terms|). K = 200
    and N = 150 exercise the zero padding, 256 tokens give two wgrad groups."""
    rng = np.random.default_rng(4)
    x, dy = exact_operand(rng, 256, 200, -3), exact_operand(rng, 256, 150, -9)
    w = exact_operand(rng, 200, 150, -12)
    got = _grads(x, w, dy)
    want = np_fp8_linear(x, w, dy, np.ones(256, bool))
    if not fp8_accumulation_rtol():  # FP8 products summed in float32: exact
        for g, e in zip(got, want):
            np.testing.assert_array_equal(g, e.astype(np.float32))
    terms = np_fp8_linear(np.abs(x), np.abs(w), np.abs(dy), np.ones(256, bool))
    for g, e, t in zip(got, want, terms):
        assert_product_close(g, e, t, rtol=0.0)


@pytest.mark.parametrize("m", [150, 40])
def test_gradients_match_numpy_emulation(m: int) -> None:
    """Random operands with padding tokens (huge values, masked out), K, N and M not multiples of
    128: same codes and scales as the emulation, so only the accumulation differs (float32
    order, ~1e-7; on a GPU the FP8 GEMM's accumulator, `fp8_accumulation_rtol`); one differing
    code would move an output by ~1e-3 of its norm."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(m, 200)).astype(np.float32)
    w = (rng.normal(size=(200, 150)) * 0.05).astype(np.float32)
    dy = rng.normal(size=(m, 150)).astype(np.float32)
    mask = np.ones(m, bool)
    mask[-7:] = False
    x[~mask], dy[~mask] = 1e4, -1e4  # would dominate every scale they entered
    got = _grads(x, w, dy, mask)
    want = np_fp8_linear(x, w, dy, mask)
    terms = np_fp8_linear(np.abs(x), np.abs(w), np.abs(dy), mask)
    for g, e, t in zip(got, want, terms):
        assert_product_close(g, e, t, rtol=1e-5)
    assert np.all(got[0][~mask] == 0) and np.all(got[1][~mask] == 0)


def test_padding_tokens_leave_no_trace() -> None:
    """Masked trailing tokens give the same gradient as leaving them out (same wgrad groups)."""
    rng = np.random.default_rng(6)
    x = rng.normal(size=(150, 64)).astype(np.float32)
    w = (rng.normal(size=(64, 96)) * 0.05).astype(np.float32)
    dy = rng.normal(size=(150, 96)).astype(np.float32)
    mask = np.arange(150) < 140
    x[~mask] = 50.0
    _, dx, dw = _grads(x, w, dy, mask)
    _, dx_real, dw_real = _grads(x[:140], w, dy[:140])
    np.testing.assert_allclose(dw, dw_real, rtol=1e-6, atol=1e-6 * np.abs(dw_real).max())
    np.testing.assert_allclose(dx[:140], dx_real, rtol=1e-6, atol=1e-6)


def test_gradients_close_to_full_precision() -> None:
    """E4M3 keeps 3 mantissa bits: ~2-5% relative Frobenius error against float32 gradients
    (dW is larger: X is quantized twice, in 1x128 then 128x1 groups)."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(256, 200)).astype(np.float32)
    w = (rng.normal(size=(200, 150)) * 0.05).astype(np.float32)
    dy = rng.normal(size=(256, 150)).astype(np.float32)
    y, dx, dw = _grads(x, w, dy)
    x64, w64, dy64 = (a.astype(np.float64) for a in (x, w, dy))
    assert _rel(y, x64 @ w64) < 0.05
    assert _rel(dx, dy64 @ w64.T) < 0.05
    assert _rel(dw, x64.T @ dy64) < 0.07


@pytest.mark.parametrize("wrt", ["x", "w"])
def test_finite_differences_along_ste_direction(wrt: str) -> None:
    """The quantized forward is piecewise constant in the codes, so a small-step finite difference
    measures rounding jumps, not a slope. The product is linear in each operand, however, so a
    central difference with a step as large as the operand itself is exact for the unquantized
    product and shrinks the quantization noise to a few percent of the slope. Along the custom
    (straight-through) gradient it must match that gradient's norm within a few percent."""
    rng = np.random.default_rng(8)
    x = jnp.asarray(rng.normal(size=(2, 64, 200)).astype(np.float32))
    w = jnp.asarray((rng.normal(size=(200, 150)) * 0.05).astype(np.float32))
    r = jnp.asarray(rng.normal(size=(2, 64, 150)).astype(np.float32))
    f = jax.jit(lambda x, w: jnp.sum(r * fp8_block_linear(x, w)))
    gx, gw = jax.grad(f, (0, 1))(x, w)
    p, g = (x, gx) if wrt == "x" else (w, gw)
    d = g / jnp.linalg.norm(g)
    eps = 4 * float(jnp.linalg.norm(p))
    shifted = lambda s: f(p + s * d, w) if wrt == "x" else f(x, p + s * d)  # noqa: E731
    fd = (float(shifted(eps)) - float(shifted(-eps))) / (2 * eps)
    assert abs(fd - float(jnp.linalg.norm(g))) < 0.03 * float(jnp.linalg.norm(g))


# ----------------------------------------------------------------------------- learner == rollout


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("k,n", [(200, 150), (64, 96)])
def test_forward_equals_rollout_bitwise(jit: bool, k: int, n: int) -> None:
    rng = np.random.default_rng(9)
    x = jnp.asarray(rng.normal(size=(3, 5, k)).astype(np.float32))
    w = jnp.asarray((rng.normal(size=(k, n)) * 0.05).astype(np.float32))
    learner = lambda x, w: train_dot_general(  # noqa: E731
        x, TrainKernel(w, (min(128, k), min(128, n)), FP8), LINEAR_DN)
    rollout = lambda x, w: rollout_dot_general(  # noqa: E731
        x, quantize_kernel(w, FP8, (128, 128), act_format=FP8), LINEAR_DN)
    if jit:
        learner, rollout = jax.jit(learner), jax.jit(rollout)
    np.testing.assert_array_equal(np.asarray(learner(x, w)), np.asarray(rollout(x, w)))


def _tiny_config(**kw) -> ModelConfig:
    base = dict(model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=160,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)
    base.update(kw)
    return ModelConfig(**base)


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "float32"),
                                        (False, "bfloat16")])
def test_tiny_transformer_learner_logits_match_rollout(tied: bool, dtype: str) -> None:
    """The hook on float32 master params gives the rollout's logits on `requantize`d params. An
    untied lm_head stays unquantized on both sides; in bfloat16 the hook still quantizes the
    float32 master (a TrainKernel is not cast), as `requantize` does. Measured max abs gap of the
    logits: 0.0 in float32 and bfloat16 (same codes, scales and accumulation order)."""
    config = _tiny_config(tie_word_embeddings=tied, dtype=dtype)
    params = init_params(config, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, config.vocab_size)
    mask = jnp.arange(12)[None, :] >= jnp.array([[0], [3]])  # second row left-padded
    positions = positions_from_mask(mask)

    @jax.jit
    def learner(params):
        model, p = bind_train_precision(Transformer(config), params, "fp8_block", token_mask=mask)
        return model.apply({"params": p}, tokens, positions, mask)[0]

    @jax.jit
    def rollout(params):
        model = Transformer(config, dot_general=rollout_dot_general)
        return model.apply({"params": params}, tokens, positions, mask)[0]

    got = learner(params)
    want = rollout(requantize(params, "fp8_block"))
    # Equality with the rollout, whose q/k/v/o/gate/up/down products are quantized, also shows
    # that the learner quantized exactly those layers (and not an untied lm_head).
    gap = float(jnp.max(jnp.abs(got - want)[mask]))
    assert gap == 0.0, gap


def test_mark_train_kernels_follows_the_recipe_layers() -> None:
    params = init_params(_tiny_config(tie_word_embeddings=False), jax.random.key(0))
    marked = mark_train_kernels(params, "fp8_block")
    attn = marked["layers_0"]["self_attn"]
    assert isinstance(attn["q_proj"]["kernel"], TrainKernel)
    assert attn["q_proj"]["kernel"].block == (64, 64)
    assert not isinstance(attn["q_proj"]["bias"], TrainKernel)
    assert isinstance(marked["layers_1"]["mlp"]["down_proj"]["kernel"], TrainKernel)
    assert isinstance(marked["lm_head"]["kernel"], jax.Array)  # same [in, out] pattern, not marked
    with_head = mark_train_kernels(params, get_recipe("fp8_block", quantize_lm_head=True))
    assert isinstance(with_head["lm_head"]["kernel"], TrainKernel)
    assert mark_train_kernels(params, "fp") is params


def test_rejects_non_block_recipes_and_bad_inputs() -> None:
    assert make_train_dot_general("fp") is jax.lax.dot_general
    assert make_train_dot_general("fp8_block") is train_dot_general
    for name in ("int8", "fp8", "int8_weight_only"):
        with pytest.raises(ValueError, match="block-scaled FP8"):
            make_train_dot_general(name)
    kernel = TrainKernel(jnp.ones((8, 4)), (8, 4), FP8)
    with pytest.raises(ValueError, match="dimension_numbers"):
        train_dot_general(jnp.ones((3, 4)), kernel, (((1,), (1,)), ((), ())))
    with pytest.raises(ValueError, match="token_mask"):
        fp8_block_linear(jnp.ones((2, 3, 8)), jnp.ones((8, 4)), token_mask=jnp.ones((6,), bool))


# ----------------------------------------------------------------- jit, remat, scan, sharding


def _lm_loss(config: ModelConfig, params, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """Learner-like objective: summed next-token log-prob of the real tokens, through the hook."""
    model, p = bind_train_precision(Transformer(config), params, "fp8_block", token_mask=mask)
    logits, _ = model.apply({"params": p}, tokens, positions_from_mask(mask), mask)
    logp = token_logprobs(logits[:, :-1], tokens[:, 1:])
    return -jnp.sum(logp * (mask[:, 1:] & mask[:, :-1]))


def _batch(config: ModelConfig, b: int, t: int) -> tuple[jax.Array, jax.Array]:
    tokens = jax.random.randint(jax.random.key(2), (b, t), 0, config.vocab_size)
    pads = jnp.arange(b) % 3  # left padding of 0, 1 or 2 tokens
    return tokens, jnp.arange(t)[None, :] >= pads[:, None]


def _assert_trees_close(a, b, rel: float) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert _rel(np.asarray(x), np.asarray(y)) <= rel


@pytest.fixture(scope="module")
def tiny_loss_grad():
    """(config, params, tokens, mask, loss, grads): jitted loss and gradient on 8 x 32 tokens."""
    config = _tiny_config()
    params = init_params(config, jax.random.key(0))
    tokens, mask = _batch(config, 8, 32)
    loss, grads = jax.jit(jax.value_and_grad(functools.partial(_lm_loss, config)))(
        params, tokens, mask)
    return config, params, tokens, mask, loss, grads


def test_loss_grad_under_remat(tiny_loss_grad) -> None:
    config, params, tokens, mask, ref_loss, ref = tiny_loss_grad
    loss = jax.checkpoint(functools.partial(_lm_loss, config))
    got_loss, got = jax.jit(jax.value_and_grad(loss))(params, tokens, mask)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    _assert_trees_close(got, ref, 1e-5)


def test_loss_grad_scan_accumulation(tiny_loss_grad) -> None:
    """A 2-step lax.scan over micro-batches of 128 tokens (the wgrad token groups of the full batch)
    gives the full batch's summed loss and gradient."""
    config, params, tokens, mask, ref_loss, ref = tiny_loss_grad
    grad = jax.value_and_grad(functools.partial(_lm_loss, config))

    @jax.jit
    def accumulated(params, tokens, mask):
        def body(acc, mb):
            loss_i, g = grad(params, *mb)
            return (acc[0] + loss_i, jax.tree.map(jnp.add, acc[1], g)), None

        micro = (tokens.reshape(2, 4, -1), mask.reshape(2, 4, -1))
        init = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, params))
        return jax.lax.scan(body, init, micro)[0]

    got_loss, got = accumulated(params, tokens, mask)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    _assert_trees_close(got, ref, 1e-5)


@pytest.mark.parametrize("x_spec,w_spec", [
    ((("data", "fsdp"), None, None), ("fsdp", "tensor")),  # q/k/v/gate/up: K over fsdp
    ((("data", "fsdp"), None, "tensor"), ("tensor", "fsdp")),  # o/down: K over tensor
])
def test_sharded_product_matches_single_device(x_spec: tuple, w_spec: tuple) -> None:
    """The product, its dX and dW on operands split like the learner's (1x128 groups and 128x128
    blocks spanning devices) equal the single-device result to float32 rounding."""
    assert jax.device_count() == 8
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    rng = np.random.default_rng(10)
    x = rng.normal(size=(4, 32, 256)).astype(np.float32)
    w = (rng.normal(size=(256, 256)) * 0.05).astype(np.float32)
    r = jnp.asarray(rng.normal(size=(4, 32, 256)).astype(np.float32))
    mask = jnp.asarray(rng.random((4, 32)) > 0.1)
    f = jax.jit(jax.value_and_grad(
        lambda x, w, m: jnp.sum(r * fp8_block_linear(x, w, token_mask=m)), (0, 1)))
    ref_loss, ref = f(jnp.asarray(x), jnp.asarray(w), mask)
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(*x_spec)))
    ws = jax.device_put(w, NamedSharding(mesh, PartitionSpec(*w_spec)))
    ms = jax.device_put(mask, NamedSharding(mesh, PartitionSpec(*x_spec[:2])))
    got_loss, got = f(xs, ws, ms)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-6)
    _assert_trees_close(got, ref, 1e-6)


@pytest.mark.slow
def test_sharded_loss_grad_matches_single_device() -> None:
    """fsdp=2 x tensor=4 on 8 host devices: params split by their logical axes, batch over fsdp.

    Not to float32 rounding: sharded reductions change the activations by ulps, and each FP8
    layer turns a relative perturbation d into roughly sqrt(0.06 d) (the fraction of values that
    cross a rounding boundary, times an E4M3 step), so 14 quantized products grow 5e-7 into ~1-3%
    per gradient leaf (measured: a 1e-7 relative perturbation of the embedding on one device moves
    the gradients by ~1.5% as well). The FP8 gradients are 5-10% away from float32 ones.
    """
    assert jax.device_count() == 8
    config = _tiny_config(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4,
                          head_dim=32, vocab_size=128)
    params = init_params(config, jax.random.key(0))
    tokens, mask = _batch(config, 4, 32)
    grad = jax.jit(jax.value_and_grad(functools.partial(_lm_loss, config)))
    ref_loss, ref = grad(params, tokens, mask)
    mesh = make_mesh(data=1, fsdp=2, tensor=4)
    sharded = shard_params(params, param_logical_axes(config), mesh)
    q_kernel = sharded["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert {s.data.shape for s in q_kernel.addressable_shards} == {(64, 32)}
    batch = [jax.device_put(a, batch_sharding(mesh, 2)) for a in (tokens, mask)]
    got_loss, got = grad(sharded, *batch)
    np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
    _assert_trees_close(got, ref, 0.05)


def test_bench_runs_on_tiny_shapes() -> None:
    times = bench.time_linear(tokens=64, k=64, n=32, repeats=1)
    assert set(times) == {"f32", "fp8_block"} and all(t > 0 for t in times.values())


# ------------------------------------------------------------ the learner: Jet-RL's unified flow


def test_unified_flow_is_on_policy() -> None:
    """Responses from the fp8_block rollout (prefill + KV-cached decode); pi_prox recomputed by the
    learner in fp8_block (Jet-RL) and in fp (BF16-train + FP8-rollout). Same codes and scales on
    both sides of the unified flow leave only float32 accumulation order (measured: k3 0, |k1|
    ~1e-8, max gap ~1e-6 against k3 ~1e-5, k1 ~2e-4, max gap ~1e-2 for fp)."""
    config = _tiny_config()
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(3, config.vocab_size, rng.integers(3, 12))))
               for _ in range(4)]
    kw = dict(n=2, max_new_tokens=16, eos_ids=(0, 1, 2))  # EOS: responses of different lengths
    unified = bench.unified_flow_mismatch(config, params, prompts, train_precision="fp8_block",
                                          **kw)
    baseline = bench.unified_flow_mismatch(config, params, prompts, train_precision="fp", **kw)
    for name, m in (("fp8_block/fp8_block", unified), ("fp/fp8_block", baseline)):
        print(f"train/rollout {name}: KL(behav||prox) k3 {m['kl_behav_prox_k3']:.3e} k1 "
              f"{m['kl_behav_prox_k1']:+.3e} max |logp gap| {m['logp_gap_abs_max']:.3e} over "
              f"{m['tokens']:.0f} tokens")
    assert unified["tokens"] == baseline["tokens"] >= 32
    assert unified["kl_behav_prox_k3"] <= 1e-5
    assert 100 * unified["kl_behav_prox_k3"] <= baseline["kl_behav_prox_k3"]
    assert 100 * abs(unified["kl_behav_prox_k1"]) <= abs(baseline["kl_behav_prox_k1"])
    assert 100 * unified["logp_gap_abs_max"] <= baseline["logp_gap_abs_max"]


LEARNER_B, LEARNER_P, LEARNER_G = 8, 6, 5


def _learner_batch(config: ModelConfig, seed: int) -> dict[str, jax.Array]:
    """B rows of [left-padded prompt (P) | response (G slots, random lengths)]."""
    rng = np.random.default_rng(seed)
    b, p, g = LEARNER_B, LEARNER_P, LEARNER_G
    prompt = np.arange(p)[None] >= (p - rng.integers(2, p + 1, b))[:, None]
    resp = np.arange(g)[None] < rng.integers(1, g + 1, b)[:, None]
    attn = np.concatenate([prompt, resp], axis=1)
    return {
        "tokens": jnp.asarray(rng.integers(0, config.vocab_size, (b, p + g)), jnp.int32),
        "positions": jnp.asarray(positions_from_mask(attn), jnp.int32),
        "attn_mask": jnp.asarray(attn),
        "resp_mask": jnp.asarray(resp, jnp.float32),
        "logp_behav": jnp.asarray(-rng.uniform(0.5, 4.0, (b, g)), jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=b), jnp.float32),
    }


def _fp8_learner(config: ModelConfig, mesh, **kw) -> Learner:
    # Adam eps = 1 makes the step proportional to the gradient, so step differences measure
    # gradient differences (with eps = 1e-8 a near-zero gradient element steps by +-lr).
    kw.setdefault("precision", "fp8_block")
    return Learner(config, ObjectiveConfig(entropy_coef=0.01),
                   OptimConfig(learning_rate=1e-2, weight_decay=0.1, eps=1.0), mesh,
                   temperature=0.9, **kw)


def _learner_step(learner: Learner, params, batch):
    """(pi_prox f32[B, G], step = new params - params, metrics) of one logprobs + update."""
    placed = learner.shard_params(params)
    batch = learner.shard_batch(batch)
    batch["logp_prox"] = learner.logprobs(placed, batch)
    new, _, metrics = learner.update(placed, learner.init_opt_state(placed), batch)
    step = jax.tree.map(lambda a, b: np.asarray(a) - np.asarray(b), jax.device_get(new), params)
    return np.asarray(batch["logp_prox"]), step, jax.device_get(metrics)


@pytest.mark.slow
def test_fp8_learner_step_unchanged_by_remat_scan_and_chunks() -> None:
    """The scanned layers get stacked TrainKernels and still run the FP8 product: logits and
    update equal the unrolled FP8 learner's (same groups, so to float32 rounding), and both are
    far from the fp learner's."""
    config = _tiny_config()
    params = init_params(config, jax.random.key(6))
    batch = _learner_batch(config, 6)
    mesh = make_mesh()
    logp, step, metrics = _learner_step(_fp8_learner(config, mesh), params, batch)
    knobs = dict(remat="full", scan_layers=True, logprob_chunk=3, logprob_batch_size=2)
    k_logp, k_step, k_metrics = _learner_step(_fp8_learner(config, mesh, **knobs), params, batch)
    np.testing.assert_allclose(k_logp, logp, atol=1e-6)
    np.testing.assert_allclose(k_metrics["update/loss"], metrics["update/loss"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(k_step), jax.tree.leaves(step), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-8)
    fp_learner = _fp8_learner(config, mesh, precision="fp", **knobs)
    fp_logp = np.asarray(fp_learner.logprobs(fp_learner.shard_params(params),
                                             fp_learner.shard_batch(batch)))
    assert np.abs(fp_logp - k_logp).max() > 1e-2  # measured 0.085: the scan ran FP8


@pytest.mark.slow
def test_fp8_learner_step_sharded_matches_single_device() -> None:
    """fsdp=4 x tensor=2 on 8 host devices with micro-batches, remat and the layer scan vs one
    device with micro-batches. Sharded reductions move activations by ulps, which FP8 rounding
    amplifies (see test_sharded_loss_grad_matches_single_device): the step agrees to ~1e-3
    relative (measured 7.7e-4), while fp vs fp8_block steps differ by ~8%."""
    assert jax.device_count() == 8
    config = _tiny_config()
    params = init_params(config, jax.random.key(6))
    batch = _learner_batch(config, 6)
    single = _learner_step(_fp8_learner(config, make_mesh(), num_micro_batches=2), params, batch)
    learner = _fp8_learner(config, make_mesh(data=1, fsdp=4, tensor=2), num_micro_batches=2,
                           remat="dots", scan_layers=True)
    q = learner.shard_params(params)["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert len(q.sharding.device_set) == 8 and q.addressable_shards[0].data.shape == (16, 32)
    sharded = _learner_step(learner, params, batch)
    np.testing.assert_allclose(sharded[0], single[0], atol=1e-5)
    np.testing.assert_allclose(sharded[2]["update/loss"], single[2]["update/loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(sharded[1]), jax.tree.leaves(single[1]), strict=True):
        assert np.abs(b).max() > 0
        assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
