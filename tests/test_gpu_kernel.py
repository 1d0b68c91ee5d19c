"""The GPU decode step's fused kernels (`quant.w8a8_product`, `quant.FusedDecode`, the decode
attention's one-launch split combine), run in Pallas' interpreter on the CPU (compiled on a GPU,
under the accelerator runner) against the reference path: AQT's W8A8 product
(`rollout_dot_general`) and the model's own layer.

Tolerances. The int8 kernels compute the reference's operations in its order (AQT's absmax and
reciprocal, int32 products, the token scale then the channel scale, the bias / residual / SwiGLU
in the compute dtype), so they are held to equality. Both sides are compiled without XLA's excess
precision (`xla_allow_excess_precision=False`): with it XLA:CPU may keep a bf16 intermediate of
either side in float32, which the GPU's Triton code does not. FP8 products accumulate in float32
in blocks of the contraction (XLA's dot in another order): float32 results within a few ulps
(rtol 1e-6), bf16 results equal. The RMSNorm inside the kernel sums squares in blocks too; it
rounds as XLA's reduction does at these sizes (equal), and on the GPU may differ in the last bit of
rstd, a code by one. Compiled on a GPU, either side may also contract a product and a sum into
one FMA: there the outputs are held to a float32 ulp or two, and bf16 outputs to one bf16 ulp.
The deviceless compiles of the fused decode program: tests/test_explain.py."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax import quant
from qurl_jax.models import decode_attention as ragged
from qurl_jax.models.transformer import PagedKVCache, Transformer, cast_floats
from qurl_jax.parallel.sharding import make_mesh
from qurl_jax.quant import _gpu_kernel as gk
from qurl_jax.quant._qtensor import quantize_groups, quantize_kernel
from qurl_jax.sampling import Sampler, SamplingParams
from tests.test_sampler import PROMPTS, TINY, _random_params

# The kernels run compiled on a GPU (the accelerator runner), in Pallas' interpreter elsewhere.
INTERPRET = jax.default_backend() != "gpu"
EXACT = {"xla_allow_excess_precision": False}
DIMS = (((1,), (0,)), ((), ()))
FORMATS = (quant.QuantFormat.INT8, quant.QuantFormat.FP8_E4M3)


def _kernel(key: jax.Array, k: int, n: int, fmt: quant.QuantFormat) -> quant.QuantizedTensor:
    w = jax.random.normal(key, (k, n), jnp.float32) * 0.1
    return quantize_kernel(w, fmt, (k, 1), fmt).store_transposed()


def _rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """The model's RMSNorm (`transformer.RMSNorm`)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return gain.astype(x.dtype) * normed.astype(x.dtype)


def _assert_close(got, want, fmt, dtype, norm: bool = False) -> None:
    """Equal, or within a few float32 ulps where the kernel sums in another order than XLA: an
    FP8 product's float32 accumulation, or with `norm` the RMSNorm's sum of squares (float32
    outputs; in bf16 the roundings hide it)."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    if not INTERPRET and dtype == jnp.bfloat16:
        np.testing.assert_allclose(got, want, rtol=2.0**-8, atol=1e-6)
    elif INTERPRET and (dtype == jnp.bfloat16 or (fmt is quant.QuantFormat.INT8 and not norm)):
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_fused_products_are_aqts_products(fmt, dtype):
    m, k, eps = 32, 128, 1e-6
    keys = jax.random.split(jax.random.key(0), 10)
    x = (jax.random.normal(keys[0], (m, k)) * 3).astype(dtype).at[3].set(0)  # a zero row
    q, kk, v = (_kernel(keys[i], k, n, fmt) for i, n in ((1, 64), (2, 32), (3, 32)))
    biases = [jax.random.normal(keys[i], (n,)).astype(dtype) for i, n in ((4, 64), (5, 32),
                                                                           (6, 32))]
    gain = (1 + 0.1 * jax.random.normal(keys[7], (k,))).astype(dtype)
    residual = jax.random.normal(keys[8], (m, 64)).astype(dtype)
    gate, up = _kernel(keys[9], k, 64, fmt), _kernel(keys[1], k, 64, fmt)
    run = functools.partial(gk.w8a8_product, interpret=INTERPRET)

    def fused(x):
        codes, scale = gk.norm_quantize(x, gain, eps, fmt, interpret=INTERPRET)
        return (run(x, [q, kk, v], biases=biases),  # q/k/v with biases, three outputs
                run(x, [q, kk, v], norm=(gain, eps)),  # the input norm in the prologue
                run(x, [q], residual=residual),  # o_proj / down_proj
                run(codes, [gate, up], x_scale=scale, swiglu=True, dtype=dtype),  # gate/up
                (codes, scale))

    def reference(x):
        dot = lambda a, w: quant.rollout_dot_general(a, w, DIMS).astype(dtype)  # noqa: E731
        h = _rms_norm(x, gain, eps)
        codes, scale = quantize_groups(h.astype(jnp.float32), fmt, (1,))
        return ([dot(x, w) + b for w, b in zip((q, kk, v), biases, strict=True)],
                [dot(h, w) for w in (q, kk, v)],
                [residual + dot(x, q)],
                [jax.nn.silu(dot(h, gate)) * dot(h, up)],
                (codes, scale[:, 0]))

    got = jax.jit(fused, compiler_options=EXACT)(x)
    want = jax.jit(reference, compiler_options=EXACT)(x)
    for name, g, w in zip(("biases", "norm", "residual", "swiglu"), got[:4], want[:4],
                          strict=True):
        assert len(g) == len(w), name
        for a, b in zip(g, w, strict=True):
            assert a.dtype == dtype and a.shape == b.shape, name
            _assert_close(a, b, fmt, dtype, norm=name in ("norm", "swiglu"))
    # The row kernel's codes and scales are AQT's quantizer's of the model's norm.
    _assert_close(got[4][0], want[4][0], fmt, dtype, norm=True)
    _assert_close(got[4][1], want[4][1], fmt, dtype, norm=True)


def test_tiles_and_what_the_kernel_refuses():
    # The 1.5B model's products at 128 rows a device: tiles dividing every shape, blocks a wave.
    for k, ns, passes, x_bytes, swiglu in ((1536, (1536, 256, 256), 3, 2, False),
                                           (1536, (1536,), 2, 2, False),
                                           (1536, (8960,), 1, 1, True),
                                           (8960, (1536,), 2, 2, False)):
        t = gk.choose_tiles(128, k, ns, passes, x_bytes, 1, swiglu)
        assert k % t.depth == 0 and 128 % t.rows == 0 and all(n % t.cols == 0 for n in ns)
        assert t.rows * t.cols * (2 if swiglu else 1) <= 128 * 128
    assert gk.choose_tiles(128, 48, (64,), 2, 2, 1) is None  # K not a multiple of 32
    assert gk.choose_tiles(8, 64, (64,), 2, 2, 1) is None  # rows padded to 16 by the caller
    x = jnp.ones((16, 64), jnp.float32)
    stored = _kernel(jax.random.key(0), 64, 32, quant.QuantFormat.INT8)
    plain = quantize_kernel(jnp.ones((64, 32)), quant.QuantFormat.INT8, (64, 1),
                            quant.QuantFormat.INT8)
    with pytest.raises(ValueError, match="stored transposed"):
        gk.w8a8_product(x, [plain], interpret=True)
    with pytest.raises(ValueError, match="swiglu needs two kernels"):
        gk.w8a8_product(x, [stored], swiglu=True, interpret=True)
    with pytest.raises(ValueError, match="no tiling"):
        gk.w8a8_product(jnp.ones((16, 64)), [_kernel(jax.random.key(1), 64, 24,
                                                     quant.QuantFormat.INT8)], interpret=True)


@pytest.fixture(scope="module")
def layer_params():
    cfg = TINY["qwen2"]
    params = quant.requantize(_random_params(cfg), "int8")
    return cfg, params, cast_floats(quant.transpose_for_gpu(params), cfg.compute_dtype)


def test_fused_decode_applies_only_to_what_it_takes(layer_params):
    _, params, prepared = layer_params
    fused = quant.FusedDecode(interpret=True)
    assert fused.applies(prepared["layers_0"])
    assert not fused.applies(params["layers_0"])  # kernels not stored transposed
    adapter = {**prepared["layers_0"], "mlp": {**prepared["layers_0"]["mlp"],
                                               "lora": {"a": jnp.zeros((64, 4))}}}
    assert not fused.applies(adapter)  # a parameter beside the kernels (a LoRA adapter)
    beside = {**prepared["layers_0"], "self_attn": {**prepared["layers_0"]["self_attn"],
                                                    "lora_q": {"a": jnp.zeros((64, 4))}}}
    assert not fused.applies(beside)
    weight_only = quant.transpose_for_gpu(quant.requantize(_random_params(TINY["qwen2"]),
                                                           "int8_weight_only"))
    assert not fused.applies(weight_only["layers_0"])
    split = quant.FusedDecode(mesh=make_mesh(tensor=2))
    assert not split.applies(prepared["layers_0"])  # weights split over a tensor axis


def test_a_fused_paged_decode_step_is_the_models_step(layer_params):
    """Two decode steps of the tiny Qwen2 model (q/k/v biases, int8) over a paged cache, both
    reading it through JAX's paged kernel and the one-launch split combine
    (`decode_attention._combine_splits`): the fused layer gives the model's logits and pages
    (float32: within a few ulps, the norm's sum of squares in another order). A dense cache:
    `test_the_sampler_runs_the_fused_products_per_batch_shard`."""
    cfg, _, prepared = layer_params
    hook = functools.partial(ragged.paged_decode_attention, impl="pallas", platform="cpu",
                             interpret=True)
    models = [Transformer(cfg, quant.make_dot_general("int8"), paged_attention=hook,
                          fused_decode=fused) for fused in (None, quant.FusedDecode(True))]
    rows = 3
    tokens = jnp.array([[5, 9], [17, 2], [200, 31]], jnp.int32)
    cache = PagedKVCache.zeros(cfg, rows, rows * 2, 4, 2)
    cache = cache.replace(page_table=jnp.arange(rows * 2, dtype=jnp.int32).reshape(rows, 2))

    def steps(model, cache):
        logits = []
        for t in range(tokens.shape[1]):
            out, cache = model.apply({"params": prepared}, tokens[:, t:t + 1],
                                     cache.n_used[:, None], cache=cache)
            logits.append(out)
        return jnp.stack(logits), cache

    (want, want_cache), (got, got_cache) = (
        jax.jit(functools.partial(steps, m), compiler_options=EXACT)(cache) for m in models)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2e-6)
    for a, b in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)


def test_the_sampler_runs_the_fused_products_per_batch_shard(layer_params, monkeypatch):
    """The engine's fused products ('interpret': on the CPU, kernels stored transposed by
    `prepare`), per batch shard on a 2-device mesh: the same tokens and log-probs as XLA's
    products, each layer's four products one kernel each."""
    cfg, params, _ = layer_params
    calls = []
    product = gk.w8a8_product
    monkeypatch.setattr(gk, "w8a8_product", lambda *a, **k: calls.append(1) or product(*a, **k))
    mesh = make_mesh(data=2)
    kw = dict(key=jax.random.key(0), n=2, settings=SamplingParams(max_new_tokens=6,
                                                                 temperature=1.0))
    outs = {fused: Sampler(cfg, quant.make_dot_general("int8"), max_prompt_len=16,
                           max_new_tokens=8, mesh=mesh, fused_products=fused).sample(
        params, PROMPTS, **kw) for fused in ("off", "interpret")}
    assert len(calls) == 4 * cfg.num_layers  # traced once, in the decode step
    np.testing.assert_array_equal(np.asarray(outs["interpret"].tokens),
                                  np.asarray(outs["off"].tokens))
    np.testing.assert_allclose(np.asarray(outs["interpret"].logp), np.asarray(outs["off"].logp),
                               rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="fused_products='gpu'"):
        Sampler(cfg, fused_products="gpu")
