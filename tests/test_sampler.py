"""Tests for qurl_jax.sampling: parity with transformers greedy decoding, exact log-probs, sampling
statistics, truncation, early exit, reproducibility, sharding and input validation.

Expected values come from independent computations: transformers' `generate`, a plain full-sequence
forward pass of our model (the learner's view) and numpy softmax / sorting, never from the sampler.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats
import torch
import transformers

from qurl_jax.models import ModelConfig, Transformer, init_params, param_logical_axes
from qurl_jax.models.hf import to_transformers
from qurl_jax.parallel.sharding import make_mesh, shard_params
from qurl_jax.sampling import (
    FinishReason,
    Sampler,
    SamplingMode,
    SamplingParams,
    generate,
    sample_tokens,
)
from tests.conftest import tiny_model

STORIES = "/work/shared/models/stories260K/stories260K.bin"

TINY = {name: tiny_model(name) for name in ("qwen2", "llama")}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [12], [200, 201, 202, 9]]


def _random_params(config: ModelConfig, seed: int = 0, std: float = 0.1) -> dict:
    """Random params drawn with numpy into the model's tree (no compilation): N(0, std) for
    kernels, embeddings and biases, 1 for norm gains. std 0.1 (5x the default init) makes
    next-token distributions peaked, so greedy arg-maxes have margins far above float32 noise;
    std 0.02 gives broad, near-uniform ones."""
    rng = np.random.default_rng(seed)
    shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))

    def draw(path, leaf):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.ones(leaf.shape, leaf.dtype)
        return jnp.asarray(rng.normal(0.0, std, leaf.shape), leaf.dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes)


def _hf_model(config: ModelConfig, params: dict) -> transformers.PreTrainedModel:
    return to_transformers(config, params, bos_token_id=None, eos_token_id=None, pad_token_id=0)


def _hf_greedy(model: transformers.PreTrainedModel, prompts: list[list[int]], max_new: int
               ) -> np.ndarray:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
            min_new_tokens=max_new, pad_token_id=0, eos_token_id=None,
        )
    return out[:, width:].numpy()


@functools.cache
def _jitted_forward(config: ModelConfig, dot_general) -> Callable[..., jax.Array]:
    model = Transformer(config, dot_general)
    return jax.jit(lambda p, t, pos, m: model.apply({"params": p}, t, pos, m)[0])


def _forward(config: ModelConfig, params: dict, tokens, positions, mask=None,
             dot_general=jax.lax.dot_general) -> jax.Array:
    """Plain (cache-free) forward of our model: the learner's view. f32[B, T, V]."""
    return _jitted_forward(config, dot_general)(params, tokens, positions, mask)


def _reference_logits(config: ModelConfig, params: dict, out, dot_general=jax.lax.dot_general
                      ) -> np.ndarray:
    """Learner-side logits f64[N, G, V] for each response position: one plain forward over the
    left-padded prompt + response."""
    tokens, mask, positions = out.sequences()
    logits = _forward(config, params, tokens, positions, mask, dot_general)
    p_len = out.prompt_tokens.shape[1]
    return np.asarray(logits[:, p_len - 1: -1], np.float64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def qwen() -> tuple[ModelConfig, dict, Sampler]:
    cfg = TINY["qwen2"]
    return cfg, _random_params(cfg), Sampler(cfg, max_prompt_len=16, max_new_tokens=16)


@pytest.fixture(scope="module")
def llama() -> tuple[ModelConfig, dict, Sampler]:
    cfg = TINY["llama"]
    sampler = Sampler(cfg, prompt_buckets=(8, 16), gen_buckets=(4, 16))
    return cfg, _random_params(cfg, seed=1), sampler


# ------------------------------------------------------------------------------------------------
# Parity with transformers.


def test_greedy_matches_transformers_qwen2(qwen) -> None:
    cfg, params, sampler = qwen
    expected = _hf_greedy(_hf_model(cfg, params), PROMPTS, 12)
    # n = 2 (the program the other greedy tests reuse): both copies of a prompt decode alike.
    out = sampler.sample(params, PROMPTS, SamplingParams(max_new_tokens=12, greedy=True),
                         key=jax.random.key(0), n=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.repeat(expected, 2, axis=0))
    assert np.asarray(out.mask).all()
    np.testing.assert_array_equal(np.asarray(out.lengths), [12] * 6)
    assert (np.asarray(out.finish_reason) == FinishReason.LENGTH).all()


def test_greedy_matches_transformers_llama(llama) -> None:
    cfg, params, sampler = llama
    expected = _hf_greedy(_hf_model(cfg, params), PROMPTS, 12)
    out = sampler.sample(params, PROMPTS, SamplingParams(max_new_tokens=12, greedy=True),
                         key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)


@pytest.mark.skipif(not os.path.exists(STORIES), reason="stories260K checkpoint not available")
def test_greedy_matches_transformers_stories260k() -> None:
    from qurl_jax.models.llama2c import load_llama2c

    cfg, params = load_llama2c(STORIES)
    prompts = [[1, 403, 407, 261, 378], [1, 78], [1, 306, 263, 365, 309, 296, 290, 263, 325]]
    expected = _hf_greedy(_hf_model(cfg, params), prompts, 24)
    sampler = Sampler(cfg, max_prompt_len=16, max_new_tokens=32)
    out = sampler.sample(params, prompts, SamplingParams(max_new_tokens=24, greedy=True),
                         key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(out.tokens), expected)


# ------------------------------------------------------------------------------------------------
# Log-probabilities.


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 12, 0.9)])
def test_logp_matches_learner_recomputation(qwen, temperature: float, top_k: int, top_p: float
                                            ) -> None:
    cfg, params, sampler = qwen
    out = sampler.sample(params, PROMPTS,
                         SamplingParams(max_new_tokens=10, temperature=temperature, top_k=top_k,
                                        top_p=top_p),
                         key=jax.random.key(3), n=2)
    mask = np.asarray(out.mask)
    assert mask.all()
    tokens = np.asarray(out.tokens)
    ref = _log_softmax(_reference_logits(cfg, params, out) / temperature)  # [N, G, V]
    ref_tok = np.take_along_axis(ref, tokens[..., None], axis=-1)[..., 0]
    np.testing.assert_allclose(np.asarray(out.logp_untruncated), ref_tok, atol=1e-4)
    logp = np.asarray(out.logp)
    if top_k == 0 and top_p == 1.0:
        np.testing.assert_array_equal(logp, np.asarray(out.logp_untruncated))
        return
    # Truncated: logp = log(p_tok / mass of the kept set), the kept set computed here in numpy
    # (top-k first, then the nucleus of the renormalised top-k distribution).
    probs = np.exp(ref)
    order = np.argsort(-probs, axis=-1)
    sorted_p = np.take_along_axis(probs, order, axis=-1)[..., :top_k]
    sorted_p = sorted_p / sorted_p.sum(-1, keepdims=True)
    above = np.cumsum(sorted_p, axis=-1) - sorted_p
    kept_sorted = above < top_p
    kept = np.zeros(probs.shape, bool)
    np.put_along_axis(kept, order[..., :top_k], kept_sorted, axis=-1)
    assert np.take_along_axis(kept, tokens[..., None], axis=-1).all(), "token outside kept set"
    kept_mass = np.where(kept, probs, 0).sum(-1)
    assert (kept_mass < 0.99).mean() > 0.5  # the cut is active at most positions
    np.testing.assert_allclose(logp, ref_tok - np.log(kept_mass), atol=1e-4)
    assert (logp >= np.asarray(out.logp_untruncated) - 1e-6).all()


# ------------------------------------------------------------------------------------------------
# Sampling statistics.


def _first_token_probs(cfg: ModelConfig, params: dict, prompt: list[int]) -> np.ndarray:
    tokens = jnp.asarray([prompt], jnp.int32)
    positions = jnp.arange(len(prompt), dtype=jnp.int32)[None]
    logits = _forward(cfg, params, tokens, positions)
    return np.exp(_log_softmax(np.asarray(logits[0, -1], np.float64)))


def _chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square p-value, pooling cells with expected count < 5 into one cell."""
    expected = probs * counts.sum()
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    return float(scipy.stats.chi2.sf(stat, len(obs) - 1))


def test_first_token_distribution_matches_softmax(qwen) -> None:
    cfg, _, sampler = qwen
    # Default (unpeaked) init: a broad distribution over all 256 tokens.
    params = _random_params(cfg, seed=2, std=0.02)
    prompt = [5, 17, 99]
    probs = _first_token_probs(cfg, params, prompt)
    rows = 4000
    out = sampler.sample(params, [prompt], SamplingParams(max_new_tokens=1), key=jax.random.key(0),
                         n=rows)
    counts = np.bincount(np.asarray(out.tokens[:, 0]), minlength=cfg.vocab_size)
    assert _chi_square_pvalue(counts, probs) > 1e-3
    tv = 0.5 * np.abs(counts / rows - probs).sum()
    # E[TV] for 4000 draws over ~256 near-uniform cells is about 0.1; a biased sampler is far off.
    assert tv < 0.14, tv
    # The check has power: the same counts are rejected against a sharper distribution.
    wrong = np.exp(_log_softmax(np.log(probs) / 0.5))
    assert _chi_square_pvalue(counts, wrong) < 1e-6


@pytest.mark.parametrize("top_p", [0.999, 0.5])
def test_truncated_first_token_distribution(qwen, top_p: float) -> None:
    # top_k = 5 for both: at top_p = 0.999 the top-k cut binds, at 0.5 the nucleus does (the
    # nucleus is taken within the renormalised top-k distribution, as in transformers).
    cfg, params, sampler = qwen
    top_k, prompt = 5, [12]
    probs = _first_token_probs(cfg, params, prompt)
    order = np.argsort(-probs)[:top_k]
    renorm_k = probs[order] / probs[order].sum()
    kept = order[np.cumsum(renorm_k) - renorm_k < top_p]
    assert 1 < len(kept) <= top_k
    if top_p < 0.9:
        assert len(kept) < top_k
    rows = 4000
    out = sampler.sample(params, [prompt],
                         SamplingParams(max_new_tokens=1, top_k=top_k, top_p=top_p),
                         key=jax.random.key(5), n=rows)
    first = np.asarray(out.tokens[:, 0])
    assert np.isin(first, kept).all()
    renorm = np.zeros_like(probs)
    renorm[kept] = probs[kept] / probs[kept].sum()
    counts = np.bincount(first, minlength=cfg.vocab_size)
    assert _chi_square_pvalue(counts[kept], renorm[kept]) > 1e-3
    np.testing.assert_allclose(np.asarray(out.logp[:, 0]), np.log(renorm[first]), atol=1e-4)
    np.testing.assert_allclose(np.asarray(out.logp_untruncated[:, 0]), np.log(probs[first]),
                               atol=1e-4)


def test_sample_tokens_never_leaves_kept_set() -> None:
    # Pure step function on hand-made logits: kept sets are known by construction.
    logits = jnp.asarray(np.tile(np.log([0.4, 0.3, 0.2, 0.05, 0.05]), (2000, 1)), jnp.float32)
    key = jax.random.key(7)
    sample = jax.jit(sample_tokens, static_argnums=4)
    tok, logp, logp_full = sample(logits, key, 1.0, 1.0, SamplingMode(top_k=2))
    assert set(np.unique(np.asarray(tok))) == {0, 1}
    np.testing.assert_allclose(np.asarray(logp), np.log(np.where(tok == 0, 4 / 7, 3 / 7)),
                               rtol=1e-5)
    np.testing.assert_allclose(np.asarray(logp_full), np.log(np.where(tok == 0, 0.4, 0.3)),
                               rtol=1e-5)
    # Nucleus 0.75: 0.4 + 0.3 = 0.7 < 0.75, so token 2 is needed too; tokens 3 and 4 never appear.
    tok, logp, _ = sample(logits, key, 1.0, 0.75, SamplingMode(top_p=True))
    assert set(np.unique(np.asarray(tok))) == {0, 1, 2}
    np.testing.assert_allclose(np.asarray(logp)[np.asarray(tok) == 2], np.log(0.2 / 0.9),
                               rtol=1e-5)
    tok, _, _ = sample(logits, key, 1.0, 1.0, SamplingMode(greedy=True))
    assert (np.asarray(tok) == 0).all()


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_sample_tokens_large_vocab_distribution(top_p: float) -> None:
    # V = 1000 spans four blocks of the two-level inverse CDF (the last one padded); a tenth of the
    # vocabulary is masked with -inf and must never be drawn. The nucleus for top_p < 1 is derived
    # here by sorting, the sampler finds it by bisection.
    rng = np.random.default_rng(0)
    v, rows = 1000, 20000
    logits = rng.normal(0.0, 2.0, v)
    logits[rng.choice(v, 100, replace=False)] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    order = np.argsort(-probs)
    above = np.cumsum(probs[order]) - probs[order]
    kept = order[above < top_p]
    target = np.zeros(v)
    target[kept] = probs[kept] / probs[kept].sum()
    mode = SamplingMode(top_p=top_p < 1.0)
    sample = jax.jit(sample_tokens, static_argnums=4)
    tok, logp, logp_full = sample(jnp.asarray(np.tile(logits, (rows, 1)), jnp.float32),
                                  jax.random.key(1), 1.0, top_p, mode)
    tok = np.asarray(tok)
    assert np.isin(tok, kept).all()
    counts = np.bincount(tok, minlength=v)
    assert _chi_square_pvalue(counts[kept], target[kept]) > 1e-3
    np.testing.assert_allclose(np.asarray(logp), np.log(target[tok]), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logp_full), np.log(probs[tok]), rtol=1e-4)


# ------------------------------------------------------------------------------------------------
# Loop control, reproducibility, bucketing.


def test_early_exit_and_eos_handling(qwen) -> None:
    cfg, params, sampler = qwen
    kw = dict(key=jax.random.key(0), n=2)
    greedy = SamplingParams(max_new_tokens=16, greedy=True)
    free = np.asarray(sampler.sample(params, PROMPTS, greedy, **kw).tokens)
    # EOS ids chosen from tokens the rows produce early; the steps needed follow from `free`.
    eos = {int(free[0, 2]), int(free[2, 4]), int(free[4, 3])}
    is_eos = np.isin(free, list(eos))
    first = np.where(is_eos.any(1), is_eos.argmax(1) + 1, 16)
    out = sampler.sample(params, PROMPTS, greedy.replace(eos_ids=tuple(eos)), **kw)
    assert int(out.num_steps) == first.max() < 16
    np.testing.assert_array_equal(np.asarray(out.lengths), first)
    cols = np.arange(16)[None, :]
    np.testing.assert_array_equal(np.asarray(out.mask), cols < first[:, None])
    np.testing.assert_array_equal(np.asarray(out.tokens),
                                  np.where(cols < first[:, None], free, sampler.engine.pad_id))
    assert (np.asarray(out.finish_reason) == FinishReason.EOS).all()
    assert (np.asarray(out.logp)[~np.asarray(out.mask)] == 0).all()
    # Without EOS every row runs to the limit.
    out = sampler.sample(params, PROMPTS, greedy.replace(max_new_tokens=5), **kw)
    assert int(out.num_steps) == 5
    assert (np.asarray(out.finish_reason) == FinishReason.LENGTH).all()


def test_reproducible_and_key_dependent(qwen) -> None:
    cfg, params, sampler = qwen
    kw = dict(n=2, settings=SamplingParams(max_new_tokens=8, temperature=1.0))
    a = sampler.sample(params, PROMPTS, key=jax.random.key(11), **kw)
    b = sampler.sample(params, PROMPTS, key=jax.random.key(11), **kw)
    c = sampler.sample(params, PROMPTS, key=jax.random.key(12), **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.logp), np.asarray(b.logp))
    assert (np.asarray(a.tokens) != np.asarray(c.tokens)).any()
    # n samples per prompt: prompt-major rows, each carrying its own prompt.
    pm = np.asarray(a.prompt_mask)
    np.testing.assert_array_equal(pm.sum(1), np.repeat([len(p) for p in PROMPTS], 2))
    np.testing.assert_array_equal(np.asarray(a.prompt_tokens)[3, pm[3]], PROMPTS[1])


def test_buckets_limit_compilations(llama) -> None:
    cfg, params, sampler = llama  # prompt buckets (8, 16), generation buckets (4, 16)
    kw = dict(key=jax.random.key(0))
    greedy = SamplingParams(max_new_tokens=12, greedy=True)
    sampler.sample(params, [[1, 2, 3], [4], [5, 6]], greedy, **kw)
    before = sampler.num_programs
    # Same batch size, prompts up to 8 tokens, 5..16 new tokens: the same (8, 16) programs.
    sampler.sample(params, [[1] * 8, [2] * 5, [3]], greedy.replace(max_new_tokens=16), **kw)
    out = sampler.sample(params, [[7, 8], [9], [10]], greedy.replace(max_new_tokens=5), **kw)
    assert sampler.num_programs == before
    assert out.prompt_tokens.shape == (3, 8) and out.tokens.shape == (3, 5)
    # A 9-token prompt moves to the 16 bucket: one more program, no more.
    out = sampler.sample(params, [[1] * 9, [2], [3]], greedy, **kw)
    assert sampler.num_programs == before + 1
    assert out.prompt_tokens.shape == (3, 16) and out.tokens.shape == (3, 12)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 17 tokens"):
        sampler.sample(params, [[1] * 17], greedy.replace(max_new_tokens=4), **kw)


# ------------------------------------------------------------------------------------------------
# Sharding, text interface, bad input.


def test_sharded_chunked_greedy_matches_single_device(qwen) -> None:
    cfg, params, sampler = qwen
    prompts = PROMPTS * 2
    expected = sampler.sample(params, prompts, SamplingParams(max_new_tokens=10, greedy=True),
                              key=jax.random.key(0), n=2)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(cfg), mesh)
    # 4 batch shards x n = 2: chunks of 4 prompts (8 rows), so 6 prompts run as 4 + 2 (+ 2 pads).
    sharded_sampler = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, mesh=mesh,
                              max_concurrent_rows=8)
    out = sharded_sampler.sample(sharded, prompts, SamplingParams(max_new_tokens=10, greedy=True),
                                 key=jax.random.key(0), n=2)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(out.logp), np.asarray(expected.logp), atol=1e-5)
    assert out.tokens.shape == (12, 10)
    assert sharded_sampler.num_programs == 1


# ------------------------------------------------------------------------------------------------
# Bounded concurrent rows, program hooks, platform gating.


def test_chunking_does_not_change_results(qwen) -> None:
    # One group (n = 2 rows) per chunk, two groups per chunk (3 prompts: 2 + 1 and a padding
    # prompt), all at once: per-row random streams make the draws independent of the chunking.
    cfg, params, all_at_once = qwen
    kw = dict(key=jax.random.key(7), n=2,
              settings=SamplingParams(max_new_tokens=8, temperature=1.0, top_k=40))
    outs = [all_at_once.sample(params, PROMPTS, **kw)]
    for rows in (2, 4):
        chunked = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=rows)
        outs.append(chunked.sample(params, PROMPTS, **kw))
        assert chunked.num_programs == 1  # every chunk runs the same two programs
    ref = outs[0]
    assert len(set(np.asarray(ref.tokens)[:, 0].tolist())) > 1  # rows draw different tokens
    for out in outs[1:]:
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.logp_untruncated),
                                   np.asarray(ref.logp_untruncated), atol=1e-6)
        for name in ("mask", "lengths", "finish_reason", "prompt_tokens", "prompt_mask"):
            np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                          np.asarray(getattr(ref, name)), err_msg=name)
        assert int(out.num_steps) == int(ref.num_steps) == 8


def test_max_concurrent_rows_must_hold_a_group(qwen) -> None:
    cfg, params, _ = qwen
    with pytest.raises(ValueError, match="max_concurrent_rows=-1"):
        Sampler(cfg, max_concurrent_rows=-1)
    sampler = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=3)
    with pytest.raises(ValueError, match=r"max_concurrent_rows=3 holds no whole group.*n=4"):
        sampler.sample(params, PROMPTS, SamplingParams(max_new_tokens=4), key=jax.random.key(0),
                       n=4)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def test_lower_programs_compile_and_report_memory(qwen) -> None:
    cfg, params, sampler = qwen
    rows, n, p_len, g_len = 4, 2, 8, 16
    lowered = sampler.lower_programs(_abstract(params), rows, p_len, g_len, n=n)
    assert set(lowered) == {"prefill", "decode", "prepare"}
    memory = {name: low.compile().memory_analysis() for name, low in lowered.items()}
    cache_bytes = (2 * cfg.num_layers * rows * cfg.num_kv_heads * (p_len + g_len)
                   * cfg.head_dim * 4)
    # The prefill returns the chunk's cache; the decode program takes it donated (aliased).
    assert memory["prefill"].output_size_in_bytes >= cache_bytes
    assert memory["decode"].argument_size_in_bytes >= cache_bytes
    assert memory["decode"].alias_size_in_bytes >= cache_bytes
    with pytest.raises(ValueError, match="rows=3"):
        sampler.lower_programs(_abstract(params), 3, p_len, g_len, n=n)


def test_cpu_only_decode_work_follows_the_platform() -> None:
    from qurl_jax.quant import get_recipe, make_dot_general, requantize

    cfg = TINY["qwen2"]  # tied LM head
    assert Sampler(cfg).engine.platform == jax.default_backend()
    assert Sampler(cfg, mesh=make_mesh(data=2)).engine.platform == "cpu"
    abstract = _abstract(jax.eval_shape(lambda p: requantize(p, "int8"), _random_params(cfg)))

    def decode_text(platform: str, program: str = "prepare") -> str:
        sampler = Sampler(cfg, make_dot_general("int8"), max_prompt_len=8, max_new_tokens=8,
                          platform=platform)
        assert sampler.engine.platform == platform
        lowered = sampler.lower_programs(abstract, 2, 8, 8, lowering_platforms=(platform,))
        return lowered[program].as_text()

    # On CPU the decode loop's parameters (prepared once per call, in a program of their own)
    # hold the tied head's transpose [V, E] -> [E, V] behind a barrier; for an accelerator the
    # loop runs the plain tied model: no copy of the embedding, no CPU kernel call.
    head_transpose = re.compile(rf"stablehlo.transpose .*\(tensor<{cfg.vocab_size}x"
                                rf"{cfg.hidden_size}xf32>\)")
    # (The GPU program's ragged decode attention kernel has barriers of its own: the head's is
    # the one over [E, V].)
    head_barrier = re.compile(rf"stablehlo.optimization_barrier .*: tensor<{cfg.hidden_size}x"
                              rf"{cfg.vocab_size}xf32>")
    cpu = decode_text("cpu")
    assert head_barrier.search(cpu) and head_transpose.search(cpu)
    assert not head_transpose.search(decode_text("cpu", "decode"))
    cuda = decode_text("cuda")
    assert not head_barrier.search(cuda) and not head_transpose.search(cuda)
    # No CPU kernel's FFI call (`@qurl_...`; the CPU's decode program has them): the GPU decode
    # program's own Pallas kernels name this package's source files in their debug info.
    assert "@qurl_" in decode_text("cpu", "decode")
    assert "@qurl_" not in cuda and "@qurl_" not in decode_text("cuda", "decode")

    # int8 vocabulary tables: on CPU the head's codes are cast to the compute dtype once, behind
    # the barrier, outside the loop (XLA:CPU would cast the whole head every step); an
    # accelerator's loop casts them inside the product (fused there).
    recipe = get_recipe("int8", quantize_vocab=True)
    abstract = _abstract(jax.eval_shape(lambda p: requantize(p, recipe), _random_params(cfg)))
    codes_cast = re.compile(rf"stablehlo.convert .*\(tensor<{cfg.hidden_size}x{cfg.vocab_size}"
                            r"xi8>\) -> tensor<")
    cpu = decode_text("cpu")
    assert head_barrier.search(cpu) and len(codes_cast.findall(cpu)) == 1
    assert not codes_cast.findall(decode_text("cpu", "decode"))
    assert not head_barrier.search(decode_text("cuda"))


_WORDS = ["<pad>", "<eos>", "<user>", "<assistant>"] + [f"w{i}" for i in range(252)]


def _word_tokenizer() -> transformers.PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(_WORDS)}, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                              eos_token="<eos>")
    hf.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant> {% endif %}"
    )
    return hf


def test_generate_text_roundtrip(qwen) -> None:
    cfg, params, sampler = qwen
    tokenizer = _word_tokenizer()
    kw = dict(key=jax.random.key(0), n=2)
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    got = generate(sampler, params, ["w5 w17 w99", "w12", "w200 w1"], tokenizer,
                   greedy.replace(eos_ids=()), **kw)
    # Word w<i> is token i + 4; <pad> (0) and <eos> (1) are special and dropped from the text.
    out = sampler.sample(params, [[9, 21, 103], [16], [204, 5]], greedy, **kw)
    expected = [" ".join(_WORDS[t] for t in row if t >= 2) for row in np.asarray(out.tokens)]
    assert got == expected
    chat = generate(sampler, params, ["w5", "w6", "w7"], tokenizer, greedy, chat_template=True,
                    **kw)
    out = sampler.sample(params, [[2, 9, 3], [2, 10, 3], [2, 11, 3]],
                         greedy.replace(eos_ids=(1,)), **kw)
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    assert chat == [" ".join(_WORDS[t] for t in row[:n] if t >= 2)
                    for row, n in zip(tokens, lengths, strict=True)]


@pytest.mark.parametrize(
    "prompts,kwargs,match",
    [
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1] * 17], {}, r"prompts\[0\] has 17 tokens"),
        ([[1, 2]], {"n": 0}, r"n=0"),
        ([], {}, "prompts is empty"),
        ([[1, 2]], {"max_new_tokens": 17}, "max_new_tokens=17"),
        ([[1, 300]], {}, r"prompts\[0\] has token ids outside"),
        ([[1, 2]], {"temperature": 0.0}, "temperature=0.0"),
        ([[1, 2]], {"top_p": 0.0}, "top_p=0.0"),
    ],
)
def test_bad_input_raises(qwen, prompts, kwargs, match) -> None:
    cfg, params, sampler = qwen
    settings = {"max_new_tokens": 4, **kwargs}
    n = settings.pop("n", 1)
    with pytest.raises(ValueError, match=match):
        sampler.sample(params, prompts, SamplingParams(**settings), key=jax.random.key(0), n=n)


@pytest.mark.parametrize("quantize_vocab", [False, True])
def test_int8_rollout_params_same_code_path(qwen, quantize_vocab: bool) -> None:
    # With int8 vocabulary tables the CPU decode loop runs the tied head as an untied [E, V]
    # copy of the codes in the compute dtype (`prepare`): the same log-probs as the model's own
    # tied int8 head.
    from qurl_jax.quant import get_recipe, make_dot_general, requantize

    cfg, params, _ = qwen
    recipe = get_recipe("int8", quantize_vocab=quantize_vocab)
    qparams = requantize(params, recipe)
    hook = make_dot_general(recipe)
    sampler = Sampler(cfg, hook, max_prompt_len=16, max_new_tokens=16)
    out = sampler.sample(qparams, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0.7),
                         key=jax.random.key(4), n=2)
    # Expected: the quantized model's plain forward over prompt + response (the same hook and
    # params without a cache), i.e. the cached decode changes nothing but the cost.
    ref = _log_softmax(_reference_logits(cfg, qparams, out, hook) / 0.7)
    tokens = np.asarray(out.tokens)
    ref_tok = np.take_along_axis(ref, tokens[..., None], axis=-1)[..., 0]
    # The activations are quantized per token: a last-bit difference between the cached decode
    # and the plain forward (other summation order) can move one activation's code by one step,
    # and that token's log-prob by up to ~1e-3 (7.1e-4 measured, 1 token of 60, on an Intel Xeon
    # with AVX512 VNNI). Nearly every token agrees to float rounding; none by more than a step.
    gap = np.abs(np.asarray(out.logp) - ref_tok)
    assert (gap <= 1e-4).mean() >= 0.95 and gap.max() <= 2e-3, (gap.max(), (gap > 1e-4).sum())
