"""The rollout's 8-bit KV cache (`rollout.kv_precision`, `qurl_jax.models.kv_quant`).

- The quantizer against a NumPy reference: a scale per token and kv head (max |x| over head_dim
  / 127 for int8, / 448 for e4m3), zero vectors (scale 0, codes 0), the round trip's error bound.
- The cache holds what the model wrote, quantized once: layer 0's codes and scales after prefill
  and a decode step equal the reference quantizer on a full-precision cache's layer 0 keys and
  values (layer 0 sees the same inputs at either precision), pads included.
- JAX's paged kernels with 8-bit pages (the TPU kernel and the GPU kernel, both in Pallas'
  interpreter) equal the dense reference on the dequantized values.
- The samplers with int8 (and fp8) KV: static, refilling, paged (also in a pool so tight that
  rows are preempted and refilled) and Sparse-RL's compressed cache give the same greedy tokens
  and log-probs as each other, and differ from the bf16 cache's log-probs (the error is there).
- The learner sees it: KL(behav || prox) of one sampling step against the full-precision forward
  is 0 with the compute-dtype cache and 1.6e-5 (int8) / 3.3e-4 (fp8) with 8-bit pages here.
- Config: the field's choices, and a run saved before the field resumes only at 'bf16'.

Tolerances: samplers' float32 log-probs to 1e-3 (`LOGP_TOL`), tokens exactly. The paged cache
holds a row without its prompt pads, so sums run in another order (1e-5 in float32,
tests/test_paged_refill.py), and a last-bit difference in a key before it is quantized can move
its code by one step (max|x| / 127): measured 1.6e-4 in the preempting pool, against 1.3e-2
between the int8 and the float32 cache (which the tests require to differ by more than 1e-3).
The kernels as
tests/test_decode_attention.py (the TPU kernel's products at the TPU's default precision, one
bf16 pass, held to 2e-2).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from qurl_jax.config import run_config
from qurl_jax.config.base import base_config, validate
from qurl_jax.config.run_config import ResumeConfigError
from qurl_jax.models import KVCache, Transformer
from qurl_jax.models import decode_attention as da
from qurl_jax.models.kv_quant import (
    KVPrecision,
    KVScale,
    dequantize_kv,
    kv_precision,
    kv_scale,
    quantize_kv,
    sequence_scales,
)
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.sampling import KVPolicyConfig, RefillSampler, Sampler, SamplingParams
from tests.test_decode_attention import BF16_TOL, F32_TOL, reference
from tests.test_refill import LIMITS, PROMPTS6, _assert_prefix_equal
from tests.test_sampler import TINY, _random_params

CODES = {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
LOGP_TOL = 1e-3


def np_quantize(x: np.ndarray, precision: str) -> tuple[np.ndarray, np.ndarray]:
    """The reference: float64 absmax over the last axis, codes by NumPy (ml_dtypes for e4m3)."""
    x = np.asarray(x, np.float64)
    top = 127.0 if precision == "int8" else 448.0
    scale = np.abs(x).max(axis=-1) / top
    y = np.divide(x, scale[..., None], out=np.zeros_like(x), where=scale[..., None] > 0)
    if precision == "int8":
        return np.clip(np.round(y), -127, 127).astype(np.int8), scale
    return np.clip(y, -top, top).astype(ml_dtypes.float8_e4m3fn), scale


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_quantizer_matches_numpy_per_token_and_head(precision) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 2, 5, 16)).astype(np.float32) * np.array([1e-3, 1, 30])[:, None,
                                                                                         None, None]
    x[1, 0, 2] = 0.0  # a zero token (scale 0)
    x[2, 1, 4, 7] = 500.0  # an outlier: only its own token's scale grows
    codes, scale = jax.jit(quantize_kv, static_argnums=1)(jnp.asarray(x), CODES[precision])
    want_codes, want_scale = np_quantize(x, precision)
    assert codes.dtype == CODES[precision] and scale.dtype == jnp.float32
    assert scale.shape == x.shape[:-1]
    np.testing.assert_allclose(np.asarray(scale), want_scale, rtol=1e-6)
    got = np.asarray(codes).astype(np.float64)
    want = want_codes.astype(np.float64)
    # Codes equal the reference except where x / s sits on a rounding boundary (float32 vs 64).
    assert np.mean(got == want) > 0.99 and np.abs(got - want).max() <= (
        1 if precision == "int8" else 32)
    assert not got[1, 0, 2].any() and float(scale[1, 0, 2]) == 0.0
    assert float(scale[2, 1, 3]) == pytest.approx(want_scale[2, 1, 3])  # its neighbour's
    back = np.asarray(dequantize_kv(codes, scale, jnp.float32), np.float64)
    err = np.abs(back - x)
    # int8: half a step; e4m3: 3 mantissa bits, half an ulp of 1/16 relative, at least the
    # subnormal step at the bottom of the range.
    bound = (want_scale[..., None] * 0.5 * (1 + 1e-5) if precision == "int8" else
             np.maximum(np.abs(x) / 16, want_scale[..., None] * 2.0 ** -9) * (1 + 1e-5))
    assert (err <= bound + 1e-12).all(), err.max()


def test_field_choices_and_bytes() -> None:
    assert kv_precision("int8") is KVPrecision.INT8
    with pytest.raises(ValueError, match="kv_precision='int4'"):
        kv_precision("int4")
    # head_dim 128, 2 kv heads (the 1.5B model): 8-bit KV plus f32 scales is 0.516x bf16.
    bf16 = KVPrecision.BF16.bytes_per_token(2, 128, jnp.bfloat16)
    for p in ("int8", "fp8"):
        ratio = KVPrecision(p).bytes_per_token(2, 128, jnp.bfloat16) / bf16
        assert ratio == pytest.approx(264 / 512) and ratio <= 0.53
    cfg = TINY["qwen2"]
    f32 = Sampler(cfg, max_prompt_len=16, max_new_tokens=16)
    int8 = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, kv_precision="int8")
    per_slot = cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim + 8)
    assert int8.engine.kv_bytes_per_row(7, 9) == 32 * per_slot
    assert f32.engine.kv_bytes_per_row(7, 9) == 32 * cfg.num_layers * cfg.num_kv_heads * (
        2 * cfg.head_dim * 4)


def _prompts() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens, positions, mask) of two 5-token prompts, the first left-padded by 2."""
    tokens = np.array([[0, 0, 5, 17, 99], [12, 60, 3, 1, 2]], np.int32)
    mask = tokens > 0
    mask[1] = True
    return tokens, np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32), mask


def _prefill_then_decode(cfg: Any, params: Any, cache: KVCache) -> KVCache:
    """`cache` after `_prompts`' prefill and one decode step of each row."""
    tokens, positions, mask = _prompts()
    model = Transformer(cfg)

    @jax.jit
    def run(cache):
        _, cache = model.apply({"params": params}, tokens, positions, mask, cache=cache)
        tok = jnp.array([[7], [8]], jnp.int32)
        _, cache = model.apply({"params": params}, tok, cache.next_pos[:, None], cache=cache)
        return cache

    return run(cache)


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_cache_holds_the_written_keys_quantized_once(precision) -> None:
    cfg = TINY["qwen2"]
    params = _random_params(cfg)
    full = _prefill_then_decode(cfg, params, KVCache.zeros(cfg, 2, 8))
    quant = _prefill_then_decode(cfg, params, KVCache.zeros(cfg, 2, 8, precision=precision))
    assert quant.k[0].dtype == CODES[precision] and quant.k_scale[0].shape == (2, 2, 8)
    np.testing.assert_array_equal(np.asarray(quant.pos), np.asarray(full.pos))
    for codes, scales, values in ((quant.k[0], quant.k_scale[0], full.k[0]),
                                  (quant.v[0], quant.v_scale[0], full.v[0])):
        want_codes, want_scale = np_quantize(np.asarray(values), precision)
        np.testing.assert_allclose(np.asarray(scales), want_scale, rtol=1e-6)
        got = np.asarray(codes).astype(np.float64)
        assert np.mean(got == want_codes.astype(np.float64)) > 0.99
        assert not got[:, :, 6:].any() and not np.asarray(scales)[:, :, 6:].any()  # unwritten


def _paged_case(precision: str, seed: int = 1):
    from tests.test_decode_attention import HKV, PAGE, B, D, H

    rng = np.random.default_rng(seed)
    table = np.array([[5, 0, 0, 0], [7, 0, 0, 0], [2, 6, 0, 0], [9, 1, 11, 3], [4, 10, 0, 0],
                      [0, 0, 0, 0]], np.int32)
    q = jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((HKV, 12, PAGE, D)) * 3, jnp.float32)
            for _ in range(2))
    (kq, ks), (vq, vs) = quantize_kv(k, CODES[precision]), quantize_kv(v, CODES[precision])
    return q, kq, ks, vq, vs, table


@pytest.mark.parametrize("precision", ["int8", "fp8"])
@pytest.mark.parametrize("impl,kwargs", [
    ("xla", {}),
    ("pallas", {"interpret": True}),  # the GPU kernel: k_scales_pages / v_scales_pages
    ("pallas", {"interpret": True, "platform": "tpu"}),  # the TPU kernel: QuantizedTensor pages
], ids=["xla", "gpu-kernel", "tpu-kernel"])
@pytest.mark.parametrize("row_scales", [False, True], ids=["per-token", "per-sequence"])
def test_paged_kernels_on_8bit_pages_equal_the_dequantized_reference(precision, impl, kwargs,
                                                                      row_scales) -> None:
    """Per token: the TPU kernel takes `QuantizedTensor` pages. Per sequence (every page of a
    row at its row's scales, as such a cache holds them): plain 8-bit pages, scaled outside."""
    from tests.test_decode_attention import LENGTHS, STARTS

    q, kq, ks, vq, vs, table = _paged_case(precision)
    lengths = np.where(STARTS > 0, LENGTHS - STARTS, LENGTHS)
    if row_scales:
        rng = np.random.default_rng(5)
        row_k, row_v = (rng.uniform(0.01, 0.05, (table.shape[0], ks.shape[0])) for _ in range(2))
        ks, vs = np.array(ks), np.array(vs)
        for r in range(table.shape[0] - 1, -1, -1):  # row 0's page 0 is also row 5's first
            for page in set(table[r]):
                ks[:, page], vs[:, page] = row_k[r][:, None], row_v[r][:, None]
        ks, vs = jnp.asarray(ks), jnp.asarray(vs)
        lengths[5] = 0  # row 5 shares row 0's pages: it reads none
    fn = jax.jit(lambda q, kq, vq, ks, vs: da.paged_decode_attention(
        q, kq, vq, table, lengths, k_scales=ks, v_scales=vs, impl=impl, row_scales=row_scales,
        **kwargs))
    out = fn(q, kq, vq, ks, vs)
    keys = dequantize_kv(da.gather_pages(kq, table), da.gather_pages(ks, table), jnp.float32)
    values = dequantize_kv(da.gather_pages(vq, table), da.gather_pages(vs, table), jnp.float32)
    want = reference(q, keys, values, np.zeros(len(lengths), np.int32), lengths)
    tol = BF16_TOL if kwargs.get("platform") == "tpu" else 5 * F32_TOL
    err = np.abs(np.asarray(out, np.float64) - want)
    assert err.max() < tol, err.max(axis=(1, 2))
    assert not np.asarray(out[lengths == 0]).any()


def test_cpu_kernel_reads_int8_codes_like_the_dequantized_cache() -> None:
    from qurl_jax.cpu_kernels import decode_attention as cpu_decode

    if not cpu_decode.available():
        pytest.skip("CPU decode attention kernel not available here")
    rng = np.random.default_rng(2)
    b, hkv, g, s, d = 3, 2, 3, 40, 32
    q = jnp.asarray(rng.standard_normal((b, hkv, g, d)), jnp.float32)
    (kq, ks), (vq, vs) = (quantize_kv(jnp.asarray(rng.standard_normal((b, hkv, s, d)) * 3,
                                                  jnp.float32), jnp.int8) for _ in range(2))
    mask = jnp.asarray(rng.random((b, s)) > 0.3).at[2].set(False)  # row 2: no valid slot
    out = jax.jit(cpu_decode.decode_attention)(q, kq, vq, mask, 30, ks, vs)
    keys, values = dequantize_kv(kq, ks, jnp.float32), dequantize_kv(vq, vs, jnp.float32)
    grouped = q.reshape(b, hkv * g, d)
    live = np.asarray(mask) & (np.arange(s) < 30)
    want = np.zeros((b, hkv * g, d))
    for r in range(b):  # the rows' valid slots as contiguous windows of a packed cache
        idx = np.flatnonzero(live[r])
        if idx.size:
            want[r] = reference(grouped[r:r + 1], keys[r:r + 1, :, idx], values[r:r + 1, :, idx],
                                np.zeros(1, np.int32), np.array([idx.size], np.int32))[0]
    np.testing.assert_allclose(np.asarray(out).reshape(b, hkv * g, d), want, atol=5 * F32_TOL)
    assert not np.asarray(out[2]).any()
    with pytest.raises(ValueError, match="int8 cache"):
        cpu_decode.decode_attention(q, kq, vq, mask, 30, ks[:, :, :4], vs)


def test_paged_kernel_needs_both_scales() -> None:
    q, kq, ks, vq, vs, table = _paged_case("int8")
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        da.paged_decode_attention(q, kq, vq, table, np.ones(6, np.int32), k_scales=ks,
                                  impl="xla")


# ----------------------------------------------------------------- per-sequence scales
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_sequence_scales_and_codes_at_a_given_scale_match_numpy(precision) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 2, 6, 16)).astype(np.float32) * 4
    valid = np.ones((3, 6), bool)
    valid[0, :2] = False  # left pads: not in the scale
    x[0, 1, 1] = 1e4  # ... however large
    valid[2] = False  # a row with no valid token: scale 0
    scales = jax.jit(sequence_scales, static_argnums=2)(x, valid, CODES[precision])
    top = 127.0 if precision == "int8" else 448.0
    want = np.where(valid[:, None, :, None], np.abs(x), 0).max(axis=(2, 3)) / top
    assert scales.shape == (3, 2, 1)
    np.testing.assert_allclose(np.asarray(scales)[..., 0], want, rtol=1e-6)
    # Codes at the row's scale, a later token past its range clipped to the code range.
    later = x[:, :, :1] * 3
    codes, got_scale = quantize_kv(jnp.asarray(later), CODES[precision], scales)
    assert got_scale.shape == (3, 2, 1)
    ref = np.clip(np.divide(later, np.asarray(scales)[..., None],
                            out=np.zeros_like(later), where=np.asarray(scales)[..., None] > 0),
                  -top, top)
    ref = np.round(ref) if precision == "int8" else ref.astype(ml_dtypes.float8_e4m3fn)
    got = np.asarray(codes).astype(np.float64)
    assert np.mean(got == np.asarray(ref, np.float64)) > 0.99
    assert np.abs(got).max() <= top and not got[2].any()
    assert kv_scale("sequence") is KVScale.SEQUENCE
    with pytest.raises(ValueError, match="kv_scale='page'"):
        kv_scale("page")


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_a_sequence_keeps_its_prompts_scale_in_every_slot(precision) -> None:
    """Per-sequence scales in the dense cache: a prefill (left-padded row included) sets each
    row's scale from its own prompt tokens, a decode step writes its token at that scale
    (clipped), and every written slot of a row holds the row's scale."""
    cfg = TINY["qwen2"].replace(kv_scale="sequence")
    params = _random_params(cfg)
    tokens, positions, mask = _prompts()
    full = Transformer(cfg.replace(kv_scale="token"))
    full_cache = jax.jit(lambda c: full.apply(
        {"params": params}, tokens, positions, mask, cache=c)[1])(KVCache.zeros(cfg, 2, 8))
    quant = _prefill_then_decode(cfg, params, KVCache.zeros(cfg, 2, 8, precision=precision))
    top = 127.0 if precision == "int8" else 448.0
    written = np.asarray(quant.pos) >= 0  # [B, S]
    for layer in range(cfg.num_layers):
        for scales, prompt in ((quant.k_scale[layer], full_cache.k[layer]),
                               (quant.v_scale[layer], full_cache.v[layer])):
            prompt = np.asarray(prompt, np.float64)
            want = np.where((np.asarray(full_cache.pos) >= 0)[:, None, :, None],
                            np.abs(prompt), 0).max(axis=(2, 3)) / top  # [B, Hkv]
            got = np.asarray(scales)
            for r in range(2):
                row = got[r][:, written[r]]  # [Hkv, written slots]: one value per kv head
                np.testing.assert_array_equal(row, np.repeat(row[:, :1], row.shape[1], 1))
                if layer == 0:  # later layers' inputs carry the 8-bit cache's error
                    np.testing.assert_allclose(row[:, 0], want[r], rtol=1e-6)
                assert not got[r][:, 6:].any()  # slots never written (a pad's hold the row's)


@pytest.fixture(scope="module")
def qwen() -> tuple:
    cfg = TINY["qwen2"]
    return cfg, _random_params(cfg)


SIZES = dict(max_prompt_len=16, max_new_tokens=16)


def _sample(sampler, params, seed=3, **settings):
    settings = dict(greedy=True) | settings
    return sampler.sample(params, PROMPTS6, key=jax.random.key(seed), n=2,
                          settings=SamplingParams(max_new_tokens=16, **settings))


def _assert_same(out, ref, atol=LOGP_TOL) -> None:
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(out.mask), np.asarray(ref.mask))
    for name in ("logp", "logp_untruncated"):
        np.testing.assert_allclose(np.asarray(getattr(out, name)), np.asarray(getattr(ref, name)),
                                   atol=atol, err_msg=name)


@pytest.mark.parametrize("precision,scale", [
    ("int8", "token"), pytest.param("fp8", "token", marks=pytest.mark.slow),
    ("int8", "sequence"), pytest.param("fp8", "sequence", marks=pytest.mark.slow)])
def test_static_refilling_and_paged_samplers_agree(qwen, precision, scale) -> None:
    cfg, params = qwen
    cfg = cfg.replace(kv_scale=scale)
    static = _sample(Sampler(cfg, kv_precision=precision, **SIZES), params)
    refill = _sample(RefillSampler(cfg, kv_precision=precision, max_concurrent_rows=4,
                                   refill_min=1, **SIZES), params)
    paged = _sample(RefillSampler(cfg, kv_precision=precision, max_concurrent_rows=4,
                                  refill_min=1, kv_pages=40, kv_page_size=8, **SIZES), params)
    _assert_same(refill, static)
    _assert_same(paged, static)
    # The 8-bit cache's error is in the reported log-probs (logp_behav).
    bf16 = _sample(Sampler(cfg, **SIZES), params)
    gap = np.abs(np.asarray(static.logp) - np.asarray(bf16.logp)).max()
    assert gap > LOGP_TOL, gap
    if scale == "sequence":  # not the per-token cache's numbers
        token = _sample(Sampler(cfg.replace(kv_scale="token"), kv_precision=precision, **SIZES),
                        params)
        assert np.abs(np.asarray(static.logp) - np.asarray(token.logp)).max() > LOGP_TOL


@pytest.mark.slow
def test_paged_pool_that_preempts_rows_gives_the_static_tokens(qwen) -> None:
    # 4 pages of 8 hold one full row: rows are preempted, their pages handed to others, and
    # re-admitted (prefilled and quantized again from their prompt).
    cfg, params = qwen
    static = _sample(Sampler(cfg, kv_precision="int8", **SIZES), params, temperature=0.8,
                     top_k=40, greedy=False)
    paged = RefillSampler(cfg, kv_precision="int8", max_concurrent_rows=4, refill_min=1,
                          kv_pages=4, kv_page_size=8, **SIZES)
    out = paged.sample(params, PROMPTS6, key=jax.random.key(3), n=2, length_limits=LIMITS,
                       settings=SamplingParams(max_new_tokens=16, temperature=0.8, top_k=40))
    _assert_prefix_equal(out, static, LIMITS, atol=LOGP_TOL)
    assert paged.last_run.preemptions >= 3


@pytest.mark.slow
def test_compressed_cache_8bit(qwen) -> None:
    """Sparse-RL's cache at int8: a budget that holds the sequence equals the dense int8
    sampler; a small one (scores on the dequantized keys, codes moved as they are) gives the
    static sampler's blocked compression and the refilling sampler's per-step one alike."""
    cfg, params = qwen
    prompts = [[5, 17, 99, 3, 250, 41, 7, 8, 9, 10, 11, 12], [12, 13, 14, 15, 16, 17, 18, 19, 20]]
    kw = dict(key=jax.random.key(7), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                  temperature=1.0))
    policy = KVPolicyConfig(policy="rkv", budget=8, interval=4, window=2)
    sizes = dict(SIZES, min_bucket=8, kv_precision="int8")
    dense = Sampler(cfg, **sizes).sample(params, prompts, **kw)
    wide = Sampler(cfg, kv_policy=dataclasses.replace(policy, budget=32), **sizes).sample(
        params, prompts, **kw)
    _assert_same(wide, dense)
    static = Sampler(cfg, kv_policy=policy, **sizes).sample(params, prompts, **kw)
    refill = RefillSampler(cfg, kv_policy=policy, max_concurrent_rows=2, **sizes).sample(
        params, prompts, **kw)
    _assert_same(refill, static)
    assert not np.array_equal(np.asarray(static.tokens), np.asarray(dense.tokens))  # it evicts


def test_config_field_reaches_the_rollout_sampler_only() -> None:
    from qurl_jax.config.settings import rollout_sampler_settings
    from qurl_jax.sampling.factory import build_eval_sampler, build_rollout_sampler

    c = base_config()
    c.model.source = "tiny"
    c.data.max_prompt_len = c.rollout.max_new_tokens = c.eval.max_new_tokens = 64
    assert c.rollout.kv_precision == "bf16"
    c.rollout.kv_precision = "fp8"
    validate(c)
    settings = rollout_sampler_settings(c)
    assert settings.kv_precision is KVPrecision.FP8
    cfg = TINY["qwen2"]
    rollout = build_rollout_sampler(cfg, jax.lax.dot_general, settings, **SIZES)
    assert rollout.engine.kv_precision is KVPrecision.FP8
    assert build_eval_sampler(cfg, settings, **SIZES).engine.kv_precision is KVPrecision.BF16
    c.rollout.kv_scale = "sequence"
    rollout = build_rollout_sampler(cfg, jax.lax.dot_general, rollout_sampler_settings(c),
                                    **SIZES)
    assert rollout.engine.config.kv_scale == "sequence"
    c.rollout.kv_scale = "page"
    with pytest.raises(ConfigError, match="rollout.kv_scale='page'"):
        validate(c)
    c.rollout.kv_scale = "token"
    c.rollout.kv_precision = "int4"
    with pytest.raises(ConfigError, match="rollout.kv_precision='int4'"):
        validate(c)


def test_a_run_saved_before_the_field_resumes_at_bf16(tmp_path) -> None:
    c = base_config()
    run_config.check_and_save(c, str(tmp_path), resuming=False)
    path = tmp_path / run_config.FILE
    saved = json.loads(path.read_text())
    del saved["rollout.kv_precision"], saved["rollout.kv_scale"]
    path.write_text(json.dumps(saved))
    run_config.check_and_save(c, str(tmp_path), resuming=True)  # bf16: the old runs' cache
    c.rollout.kv_scale = "sequence"
    with pytest.raises(ResumeConfigError, match=r"config.rollout.kv_scale is 'sequence'"):
        run_config.check_and_save(c, str(tmp_path), resuming=True)
    c.rollout.kv_scale = "token"
    c.rollout.kv_precision = "int8"
    with pytest.raises(ResumeConfigError,
                       match=r"config.rollout.kv_precision is 'int8' but .* started with 'bf16'"):
        run_config.check_and_save(c, str(tmp_path), resuming=True)


def _compiled_int8_paged_decode(target: str, paged: bool = True, kv_scale: str = "token"
                                ) -> tuple[Any, str]:
    """(model config, compiled HLO text) of the paged sampler's decode program, int8 KV (scales
    per `kv_scale`), on `target`'s first 8 compile-only devices (data 2 x fsdp 2 x tensor 2);
    skips where the target's compiler is absent. `paged=False`: the refilling sampler's dense
    cache instead."""
    from qurl_jax.models import param_logical_axes
    from qurl_jax.parallel.sharding import logical_shardings, make_mesh
    from tests.compile_only import compiler_or_skip

    t = compiler_or_skip(target)
    cfg = TINY["qwen2"].replace(dtype="bfloat16", head_dim=128, kv_scale=kv_scale)
    mesh = make_mesh(data=2, fsdp=2, tensor=2, devices=t.devices()[:8])
    shapes = jax.eval_shape(lambda: _random_params(cfg))
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            shapes, logical_shardings(param_logical_axes(cfg), shapes, mesh))
    pool = dict(kv_page_size=16, kv_pages=32) if paged else {}
    paged = RefillSampler(cfg, mesh=mesh, max_concurrent_rows=8, refill_min=1,
                          kv_precision="int8", **pool, **SIZES)
    with jax.default_matmul_precision("default"):
        return cfg, paged.lower_programs(abstract, rows=16, p_len=16, g_len=16, n=2)[
            "decode"].compile().as_text()


@pytest.mark.slow
def test_tpu_decode_loop_reads_8bit_pages_without_a_float_copy() -> None:
    """Compile-only, v5p-16's 8 devices (data 2 x fsdp 2 x tensor 2), int8 KV: the decode loop
    carries s8 pools and f32 scales per token, JAX's TPU paged kernel takes the s8 pages as its
    operands, and no page is converted to a float copy. (The kernel's wrapper broadcasts the
    scales to the pages' shape, f32[Hkv, P, page_size, D], before the call: see
    docs/paged_kv.md.)"""
    import re

    cfg, text = _compiled_int8_paged_decode("tpu:v5p-16")
    # A device's pool: kv heads 2 / tensor 2, pages 32 / 4 batch shards, 16 tokens, D 128.
    page = "1,8,16,128"
    loop_state = next(line for line in text.splitlines()
                      if re.match(r"\s*%wide\S*param\S* = \(", line))
    assert loop_state.count(f"s8[{page}]") == 2 * cfg.num_layers, loop_state[:400]
    assert len(re.findall(r"f32\[1,8,16\]\{", loop_state)) == 2 * cfg.num_layers  # scales
    assert f"bf16[{page}]" not in loop_state and f"f32[{page}]" not in loop_state
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == cfg.num_layers
    for call in calls:
        operands = call.split("operand_layout_constraints=")[1].split("frontend_attributes")[0]
        assert operands.count(f"s8[{page}]") == 2, operands
    # No page dequantized outside the kernel: nothing converts an s8 pool to a float.
    converts = [line for line in text.splitlines()
                if re.search(rf"= (f32|bf16)\[{page}\].* convert\(", line)]
    assert not converts, converts[:2]
    # What the loop does write at a pool's size: the wrapper's broadcast scales, K and V of
    # every layer, each token (what `plan.interconnect` charges an 8-bit cache on TPU).
    from qurl_jax.plan import collectives

    written = collectives.loop_body_float_arrays(text, 8 * 16 * 128)
    assert [t for _, t, _ in written] == [f"f32[{page}]"] * (2 * cfg.num_layers), written


@pytest.mark.slow
def test_tpu_decode_loop_with_sequence_scales_writes_no_float_array_of_a_pool() -> None:
    """Compile-only as above with `kv_scale='sequence'`: JAX's TPU paged kernel takes plain s8
    pages (no `QuantizedTensor`, so its wrapper broadcasts nothing), the scales are applied on
    the queries and outputs, and the decode loop writes no float array of a pool's size."""
    import re

    from qurl_jax.plan import collectives

    cfg, text = _compiled_int8_paged_decode("tpu:v5p-16", kv_scale="sequence")
    page = "1,8,16,128"
    loop_state = next(line for line in text.splitlines()
                      if re.match(r"\s*%wide\S*param\S* = \(", line))
    assert loop_state.count(f"s8[{page}]") == 2 * cfg.num_layers, loop_state[:400]
    calls = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
    assert len(calls) == cfg.num_layers
    for call in calls:
        operands = call.split("operand_layout_constraints=")[1].split("frontend_attributes")[0]
        assert operands.count(f"s8[{page}]") == 2 and f"f32[{page}]" not in operands, operands
    assert not [line for line in text.splitlines() if re.search(rf"= (f32|bf16)\[{page}\]", line)]
    assert collectives.loop_body_float_arrays(text, 8 * 16 * 128) == []


@pytest.mark.slow
def test_gpu_decode_loop_reads_8bit_pages_without_a_float_copy() -> None:
    """Compile-only, h100-8 (data 2 x fsdp 2 x tensor 2, JAX's CUDA plugin: the `gpu-compile`
    extra), int8 KV: the decode loop carries s8 pools and f32 scales per token, every layer's
    call of JAX's GPU paged kernel (a Triton custom call) takes the s8 pages and their f32
    scales as they are (no broadcast of the scales, unlike the TPU kernel's wrapper), and no
    value of a page's shape is a float anywhere in the program."""
    import re

    cfg, text = _compiled_int8_paged_decode("gpu:h100-8")
    lines = text.splitlines()
    page, scales = "s8[1,8,16,128]", "f32[1,8,16]"  # a device's pool and its per-token scales
    loop = next(line for line in lines if " while(" in line)
    assert loop.count(page) == 2 * cfg.num_layers, loop[:400]
    assert loop.count(scales) == 2 * cfg.num_layers, loop[:400]
    types = {m[1]: m[2] for m in (re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+) = ([^ {]+)", line)
                                  for line in lines) if m}
    calls = [line for line in lines if 'custom_call_target="__gpu$xla.gpu.triton"' in line]
    assert len(calls) == cfg.num_layers
    for call in calls:
        operands = re.search(r"custom-call\((.*?)\), custom_call_target", call)[1].split(",")
        kinds = [types.get(o.split("*/")[-1].strip().lstrip("%")) for o in operands]
        assert kinds.count(page) == 2 and kinds.count(scales) == 2, kinds
    assert not [line for line in lines if re.search(r"= (f32|bf16)\[1,8,16,128\]", line)]
    from qurl_jax.plan import collectives

    assert collectives.loop_body_float_arrays(text, 8 * 16 * 128) == []


@pytest.mark.slow
def test_gpu_dense_decode_loop_dequantizes_an_8bit_cache() -> None:
    """Compile-only, h100-8 as above, the refilling sampler's dense cache at int8: JAX's dense
    GPU decode kernel takes float keys and values, so the loop writes a bf16 copy of every
    layer's K and V each token (what the engine's start-up warning and `plan.interconnect`'s
    byte count say)."""
    from qurl_jax.plan import collectives

    cfg, text = _compiled_int8_paged_decode("gpu:h100-8", paged=False)
    import re

    # One layer's cache on a device [rows, kv heads, slots, D], read off the loop's s8 buffers.
    loop = next(line for line in text.splitlines() if " while(" in line)
    shape = re.search(r"s8\[(\d+),(\d+),(\d+),128\]", loop).groups()
    elements = int(np.prod([int(d) for d in shape])) * 128
    written = collectives.loop_body_float_arrays(text, elements)
    assert len(written) == 2 * cfg.num_layers, written
    assert {t for _, t, _ in written} == {f"bf16[{','.join(shape)},128]"}


@pytest.mark.slow
@pytest.mark.parametrize("scale", ["token", "sequence"])
def test_8bit_paged_pool_on_a_mesh_equals_one_device(qwen, monkeypatch, scale) -> None:
    """8 host devices (data 2 x fsdp 2 x tensor 2), int8 KV: the paged sampler with JAX's GPU
    paged kernel per shard (Pallas' interpreter; each shard writes its own pages' codes and
    scales, reads per-sequence scales off its own first pages, and reads the pages with its
    local page ids) gives the one-device static sampler's tokens and log-probs."""
    from qurl_jax.models import param_logical_axes
    from qurl_jax.parallel.sharding import make_mesh, shard_params

    cfg, params = qwen
    cfg = cfg.replace(kv_scale=scale)
    traced = []
    kernel = da._gpu_paged
    monkeypatch.setattr(da, "_gpu_paged", lambda *a, **k: traced.append(a[5]) or kernel(*a, **k))
    kw = dict(key=jax.random.key(3), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                  temperature=0.8))
    ref = Sampler(cfg, kv_precision="int8", **SIZES).sample(params, PROMPTS6, **kw)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    paged = RefillSampler(cfg, decode_attention="pallas", kv_precision="int8", mesh=mesh,
                          max_concurrent_rows=8, refill_min=1, kv_pages=16, kv_page_size=8,
                          **SIZES)
    out = paged.sample(shard_params(params, param_logical_axes(cfg), mesh), PROMPTS6,
                       length_limits=LIMITS, **kw)
    _assert_prefix_equal(out, ref, LIMITS, atol=LOGP_TOL)
    assert traced and all(s is not None for s in traced)  # the kernel read scales


def test_kl_behav_prox_holds_the_8bit_cache_error(qwen) -> None:
    """The 8-bit cache's error reaches the learner as part of logp_behav: on the same sampling
    step (same params, prompts and key), KL(behav || prox) against the learner's full-precision
    forward is float rounding with the compute-dtype cache and clearly above it with int8 or fp8
    pages, and the same metric the trainer logs (`mismatch_metrics`) reports it."""
    from qurl_jax.rl.objectives import mismatch_metrics
    from tests.test_sampler import _log_softmax, _reference_logits

    cfg, params = qwen
    kl = {}
    for precision in ("bf16", "int8", "fp8"):
        out = _sample(Sampler(cfg, kv_precision=precision, **SIZES), params, greedy=False,
                      temperature=1.0)
        ref = _log_softmax(_reference_logits(cfg, params, out))
        prox = np.take_along_axis(ref, np.asarray(out.tokens)[..., None], axis=-1)[..., 0]
        m = mismatch_metrics(jnp.asarray(prox, jnp.float32), out.logp, out.mask)
        kl[precision] = float(m["kl_behav_prox_k3"])
    assert kl["bf16"] < 1e-9, kl
    assert kl["int8"] > 1e-6 and kl["fp8"] > 1e-6 and min(kl["int8"], kl["fp8"]) > 1e3 * kl[
        "bf16"], kl


def test_an_8bit_cache_read_as_floats_is_named_once(caplog) -> None:
    """Where JAX's kernel for the cache takes no codes (GPU dense; TPU paged, whose wrapper
    broadcasts the scales), the engine warns once per process; a paged GPU pool, a bf16 cache,
    XLA's attention and the CPU say nothing."""
    import logging

    from qurl_jax.sampling import _engine

    cfg = TINY["qwen2"]
    kw = dict(max_prompt_len=16, max_new_tokens=16)
    _engine._warn_float_copy.cache_clear()
    with caplog.at_level(logging.WARNING, logger=_engine.__name__):
        Sampler(cfg, kv_precision="int8", platform="gpu", **kw)
        Sampler(cfg, kv_precision="fp8", platform="gpu", **kw)  # once per process
        gpu = [r.getMessage() for r in caplog.records]
        caplog.clear()
        Sampler(cfg, platform="gpu", **kw)
        Sampler(cfg, kv_precision="int8", platform="gpu", decode_attention="xla", **kw)
        RefillSampler(cfg, kv_precision="int8", platform="gpu", max_concurrent_rows=4,
                      kv_pages=40, kv_page_size=8, **kw)
        Sampler(cfg, kv_precision="int8", **kw)
        quiet = [r.getMessage() for r in caplog.records]
        RefillSampler(cfg.replace(kv_scale="sequence"), kv_precision="int8", platform="tpu",
                      max_concurrent_rows=4, kv_pages=40, kv_page_size=8, **kw)
        quiet += [r.getMessage() for r in caplog.records]  # plain 8-bit pages on TPU
        RefillSampler(cfg, kv_precision="int8", platform="tpu", max_concurrent_rows=4,
                      kv_pages=40, kv_page_size=8, **kw)
        tpu = [r.getMessage() for r in caplog.records]
    assert len(gpu) == 1 and "dense GPU decode kernel" in gpu[0] and "rollout.kv_pages" in gpu[0]
    assert quiet == []
    assert len(tpu) == 1 and "broadcasts the per-token scales" in tpu[0]
    assert "rollout.kv_scale='sequence'" in tpu[0]
    _engine._warn_float_copy.cache_clear()
