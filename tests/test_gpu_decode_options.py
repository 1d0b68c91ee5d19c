"""What the GPU decode programs do differently, run on the CPU: each gives exactly the numbers of
the plain path, so the GPU's programs change launches and copies, not tokens or log-probs, and
the CPU's own programs are untouched (`Engine`'s GPU options are off there).

- 8-bit kernels stored transposed (`quant.transpose_for_gpu`, `Engine.prepare` on GPU devices):
  the same integer products and scales; the two scale multiplications may round in another
  order (at most 1 ulp of float32); the parameter tree's shapes unchanged.
- One scatter per KV pool for every kv head (`_engine.put_all_heads`): the pools of
  `put_tokens`.
- Decode loops in chunks of steps (`Engine.decode_while`, `decode_chunk`): the same tokens,
  log-probs, lengths and step counts as one step per iteration; bit for bit for the static
  sampler, and for the refilling sampler (whose rows then meet other rows in a step, as they do
  whenever its schedule changes) within the 1e-5 its tests hold it to against the static one;
  dense and paged caches; a chunk that would pass a paged call's reserved steps stops there.
The deviceless compiles of the GPU programs: tests/test_explain.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax import quant
from qurl_jax.models.transformer import put_tokens
from qurl_jax.sampling import RefillSampler, Sampler, SamplingParams
from qurl_jax.sampling._engine import GPU_COMMAND_BUFFER, Engine, put_all_heads
from tests.test_refill import LIMITS, PROMPTS6
from tests.test_sampler import TINY, _random_params


@pytest.mark.parametrize("recipe", ["int8", "fp8"])
def test_kernels_stored_transposed_give_the_same_products(recipe):
    cfg = TINY["qwen2"]
    params = quant.requantize(_random_params(cfg), recipe)
    moved = quant.transpose_for_gpu(params)
    is_q = lambda x: isinstance(x, quant.QuantizedTensor)  # noqa: E731
    flat, moved_flat = (jax.tree.leaves(t, is_leaf=is_q) for t in (params, moved))
    transposed = 0
    for a, b in zip(flat, moved_flat, strict=True):
        assert jnp.shape(a) == jnp.shape(b)  # flax checks the parameters' shapes
        if not is_q(a) or not b.transposed:
            continue
        transposed += 1
        assert b.qvalue.shape == a.qvalue.shape and b.scale.shape == a.scale.shape
        np.testing.assert_array_equal(np.asarray(b.stored().qvalue), np.asarray(a.qvalue).T)
        np.testing.assert_array_equal(np.asarray(b.dequantize()), np.asarray(a.dequantize()))
        x = jax.random.normal(jax.random.key(1), (5, a.shape[0]), jnp.float32)
        dims = (((1,), (0,)), ((), ()))
        np.testing.assert_allclose(np.asarray(quant.rollout_dot_general(x, b, dims)),
                                   np.asarray(quant.rollout_dot_general(x, a, dims)),
                                   rtol=2.0**-23, atol=0)
    assert transposed == 7 * cfg.num_layers  # every linear kernel; the embedding stays
    assert moved["embed_tokens"]["embedding"] is params["embed_tokens"]["embedding"]
    again = quant.transpose_for_gpu(moved)  # kernels already stored transposed stay as they are
    for a, b in zip(moved_flat, jax.tree.leaves(again, is_leaf=is_q), strict=True):
        if is_q(a):
            assert b.transposed == a.transposed
            np.testing.assert_array_equal(np.asarray(b.qvalue), np.asarray(a.qvalue))
    # The whole model's logits.
    model = quant.make_dot_general(recipe)
    from qurl_jax.models.transformer import Transformer

    tokens = jnp.array([[5, 9, 2, 7]], jnp.int32)
    logits = [Transformer(cfg, model).apply({"params": p}, tokens, jnp.arange(4)[None])[0]
              for p in (params, moved)]
    np.testing.assert_allclose(np.asarray(logits[0]), np.asarray(logits[1]), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("scales", [False, True])
def test_one_scatter_per_pool_writes_what_one_per_head_writes(scales):
    hkv, pages, ps, d, rows = 3, 5, 4, 8, 4
    key = jax.random.key(0)
    shape = (hkv, pages, ps) if scales else (hkv, pages, ps, d)
    pool = jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16)
    new = jax.random.normal(jax.random.key(1), (rows, hkv, 1) + (() if scales else (d,)))
    page = jnp.array([4, 0, pages, 2], jnp.int32)  # row 2 targets page P: dropped
    offset = jnp.array([3, 1, 0, 0], jnp.int32)
    np.testing.assert_array_equal(np.asarray(put_all_heads(pool, page, offset, new)),
                                  np.asarray(put_tokens(pool, page, offset, new)))


def test_engine_options_stay_off_the_cpu():
    engine = Engine(TINY["qwen2"])
    assert engine.platform == "cpu" and engine.decode_chunk == 1
    assert engine.compiler_options() == {}
    assert engine.command_buffer == GPU_COMMAND_BUFFER  # used on GPU devices only
    with pytest.raises(ValueError, match="decode_chunk=-1"):
        Engine(TINY["qwen2"], decode_chunk=-1)


@pytest.fixture(scope="module")
def tiny() -> tuple:
    cfg = TINY["qwen2"]
    return cfg, _random_params(cfg)


def _same(out, ref, atol: float = 0.0) -> None:
    for name in ("tokens", "mask", "lengths", "finish_reason"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                      np.asarray(getattr(ref, name)), err_msg=name)
    for name in ("logp", "logp_untruncated"):
        np.testing.assert_allclose(np.asarray(getattr(out, name)),
                                   np.asarray(getattr(ref, name)), rtol=0, atol=atol,
                                   err_msg=name)
    assert int(out.num_steps) == int(ref.num_steps)


def test_chunked_static_decode_is_the_plain_decode(tiny):
    cfg, params = tiny
    kw = dict(key=jax.random.key(4), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                 temperature=1.0))
    free = np.asarray(Sampler(cfg, max_prompt_len=16, max_new_tokens=16).sample(
        params, PROMPTS6, **kw).tokens)
    # EOS ids that end every row by its 7th token, rows at different steps: the last chunk of 5
    # runs past the last row's end.
    kw["settings"] = kw["settings"].replace(eos_ids=tuple(sorted(set(free[:, 6].tolist()))))
    outs = [Sampler(cfg, max_prompt_len=16, max_new_tokens=16, decode_chunk=chunk).sample(
        params, PROMPTS6, **kw) for chunk in (1, 5)]
    lengths = np.asarray(outs[0].lengths)
    assert lengths.max() <= 7 and lengths.min() < lengths.max()
    assert int(outs[0].num_steps) == lengths.max() and lengths.max() % 5
    _same(outs[1], outs[0])


@pytest.mark.parametrize("pages", [pytest.param(0, marks=pytest.mark.slow), 40])
def test_chunked_refill_decode_gives_the_same_rows(tiny, pages):
    """A chunk checks the call's stop conditions only at its end (rows that finish inside it
    wait for it), and with a paged pool stops at the call's reserved steps (6, not a multiple of
    4): the same rows come out."""
    cfg, params = tiny
    kw = dict(key=jax.random.key(6), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                 temperature=1.0))
    common = dict(max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=4, refill_min=1)
    if pages:
        common.update(kv_pages=pages, kv_page_size=4, max_steps_per_call=6)
    outs = [RefillSampler(cfg, decode_chunk=chunk, **common).sample(
        params, PROMPTS6, length_limits=LIMITS, **kw) for chunk in (1, 4)]
    _same(outs[1], outs[0], atol=1e-5)
