"""The CPU decode attention kernel (qurl_jax.cpu_kernels.decode_attention), on each of its paths
(AVX512 and AVX2; an AVX512 CPU runs both): against a jnp reference on masks, lengths and head
sizes; inside the model's decode step; inside the sampler."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.cpu_kernels import decode_attention as cpu_attention
from qurl_jax.models import KVCache, ModelConfig, Transformer, init_params
from qurl_jax.sampling import Sampler, SamplingParams

requires_kernel = pytest.mark.skipif(
    not cpu_attention.available(),
    reason="the kernel needs an x86 CPU with AVX2 and FMA and a C++ compiler",
)
# The kernel's paths this CPU runs, best first.
PATHS = ["avx512", "avx2"][["avx512", "avx2", ""].index(cpu_attention.kernel_isa()):2]


def _reference(q, k, v, mask, length):
    d = q.shape[-1]
    scores = jnp.einsum("bhgd,bhsd->bhgs", q, k, precision="highest") / math.sqrt(d)
    ok = mask[:, None, None, :] & (jnp.arange(k.shape[2]) < length)[None, None, None, :]
    probs = jax.nn.softmax(jnp.where(ok, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhgs,bhsd->bhgd", probs, v, precision="highest")
    return jnp.where(ok.any(-1)[..., None], out, 0.0)


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
@pytest.mark.parametrize(
    "b,h,g,s,d,length",
    [(1, 1, 1, 1, 16, 1), (3, 2, 3, 37, 32, 25), (2, 2, 6, 513, 64, 513), (2, 1, 4, 40, 128, 17),
     (4, 4, 1, 70, 64, 70), (2, 2, 2, 20, 16, 33),  # length past the cache is clipped
     (16, 2, 6, 513, 64, 500),  # large enough to be shared with the thread pool
     (2, 1, 3, 30, 512, 30)],  # more accumulators than registers: D in chunks
)
def test_kernel_matches_reference(b, h, g, s, d, length, isa) -> None:
    rng = np.random.default_rng(b * 100 + s)
    q, k, v = (jnp.asarray(rng.normal(size=shape) * 2, jnp.float32)
               for shape in [(b, h, g, d), (b, h, s, d), (b, h, s, d)])
    mask = jnp.asarray(rng.random((b, s)) < 0.8).at[:, 0].set(True)
    got = jax.jit(functools.partial(cpu_attention.decode_attention, isa=isa))(q, k, v, mask,
                                                                             length)
    np.testing.assert_allclose(np.asarray(got), np.asarray(_reference(q, k, v, mask, length)),
                               atol=1e-5, rtol=1e-5)  # scores up to ~40: f32 rounding
    # An int8 cache: codes and a scale per slot, dequantized in registers.
    kc, vc = (jnp.asarray(rng.integers(-127, 128, (b, h, s, d)), jnp.int8) for _ in range(2))
    ks, vs = (jnp.asarray(rng.random((b, h, s)) * 0.05, jnp.float32) for _ in range(2))
    got = cpu_attention.decode_attention(q, kc, vc, mask, length, ks, vs, isa=isa)
    want = _reference(q, kc * ks[..., None], vc * vs[..., None], mask, length)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
def test_kernel_rows_without_valid_slots_are_zero_and_length_limits_reads(isa) -> None:
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=shape), jnp.float32)
               for shape in [(2, 1, 2, 16), (2, 1, 8, 16), (2, 1, 8, 16)])
    mask = jnp.array([[False] * 8, [True] * 8])
    attend = functools.partial(cpu_attention.decode_attention, isa=isa)
    out = np.asarray(attend(q, k, v, mask, 8))
    assert (out[0] == 0).all() and np.isfinite(out).all()
    # Slots at and past `length` are never read: NaN there changes nothing.
    poisoned = (k.at[:, :, 5:].set(jnp.nan), v.at[:, :, 5:].set(jnp.nan))
    np.testing.assert_array_equal(np.asarray(attend(q, *poisoned, mask, 5)),
                                  np.asarray(attend(q, k, v, mask, 5)))


def test_kernel_rejects_bad_shapes() -> None:
    q = jnp.zeros((1, 1, 1, 24), jnp.float32)  # head size not a multiple of 16
    kv = jnp.zeros((1, 1, 4, 24), jnp.float32)
    with pytest.raises(ValueError, match="D % 16"):
        cpu_attention.decode_attention(q, kv, kv, jnp.ones((1, 4), bool), 4)
    with pytest.raises(ValueError, match="decode_attention"):
        cpu_attention.decode_attention(q.astype(jnp.bfloat16), kv, kv, jnp.ones((1, 4), bool), 4)


CONFIG = ModelConfig(model_type="qwen2", vocab_size=101, hidden_size=64, intermediate_size=128,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                     tie_word_embeddings=True)


@requires_kernel
def test_model_decode_step_with_kernel_matches_xla() -> None:
    params = init_params(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (3, 7), 0, CONFIG.vocab_size)
    mask = jnp.array([[False, False, True, True, True, True, True]] + [[True] * 7] * 2)
    positions = jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)

    def run(hook):
        model = Transformer(CONFIG, decode_attention=hook)
        cache = KVCache.zeros(CONFIG, 3, 10)
        _, cache = model.apply({"params": params}, tokens[:, :6], positions[:, :6], mask[:, :6],
                               cache=cache)
        logits, _ = model.apply({"params": params}, tokens[:, 6:], positions[:, 6:], None,
                                cache=cache)
        return np.asarray(logits)

    np.testing.assert_allclose(run(cpu_attention.decode_attention), run(None), atol=1e-5)


@requires_kernel
@pytest.mark.parametrize("isa", PATHS)
def test_sampler_with_kernel_matches_xla_attention(monkeypatch, isa) -> None:
    params = init_params(CONFIG, jax.random.key(0))
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    monkeypatch.setattr(cpu_attention, "kernel_isa", lambda: isa)

    def sample():
        sampler = Sampler(CONFIG, max_prompt_len=8, max_new_tokens=10)
        out = sampler.sample(params, prompts, SamplingParams(greedy=True, max_new_tokens=10),
                             key=jax.random.key(0))
        return np.asarray(out.tokens), np.asarray(out.logp)

    tokens, logp = sample()
    monkeypatch.setattr(cpu_attention, "usable", lambda *a: False)
    tokens_xla, logp_xla = sample()
    np.testing.assert_array_equal(tokens, tokens_xla)
    np.testing.assert_allclose(logp, logp_xla, atol=1e-5)
