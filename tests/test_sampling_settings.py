"""SamplingParams (one frozen value for a call's settings) and the rollout sampler factory."""

import jax
import numpy as np
import pytest

from qurl_jax.sampling import KVPolicyConfig, RefillSampler, Sampler, SamplingMode, SamplingParams
from qurl_jax.sampling.factory import (
    RolloutSamplerSettings,
    build_eval_sampler,
    build_rollout_sampler,
)


def test_sampling_params_is_one_frozen_value() -> None:
    p = SamplingParams(max_new_tokens=8, eos_ids=[7, 3, 7])
    assert p.eos_ids == (3, 7)  # sorted, distinct
    with pytest.raises(AttributeError):
        p.temperature = 0.5
    assert p.replace(top_k=5).top_k == 5 and p.top_k == 0
    assert hash(p) == hash(SamplingParams(max_new_tokens=8, eos_ids=(3, 7)))


@pytest.mark.parametrize("fields,match", [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": 17}, "max_new_tokens=17"),
    ({"temperature": 0.0}, "temperature=0.0"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": -1}, "top_k=-1"),
    ({"eos_ids": (256,)}, "eos_ids"),
    ({"behav_logp": "other"}, "behav_logp"),
])
def test_check_names_the_bad_field(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{"max_new_tokens": 4, **fields}).check(vocab_size=256, max_new_tokens=16)


def test_static_and_traced_parts() -> None:
    p = SamplingParams(max_new_tokens=4, temperature=0.7, top_k=300, top_p=0.9, eos_ids=range(9))
    assert p.mode(256) == SamplingMode(greedy=False, top_k=0, top_p=True)  # k >= V: no top-k
    assert SamplingParams(max_new_tokens=4, greedy=True, top_k=5).mode(256) == SamplingMode(
        greedy=True)
    d = p.decoding(jax.random.key(0))
    np.testing.assert_array_equal(d.eos_ids, list(range(9)) + [-1] * 7)  # padded to 8s
    assert float(d.temperature) == pytest.approx(0.7)
    greedy = SamplingParams(max_new_tokens=4, greedy=True, temperature=0.0).decoding(
        jax.random.key(0))
    assert float(greedy.temperature) == 1.0 and greedy.eos_ids.shape == (8,)
    logp, untruncated = np.zeros(2), np.ones(2)
    assert p.behaviour_logp(logp, untruncated) is logp
    assert p.replace(behav_logp="untruncated").behaviour_logp(logp, untruncated) is untruncated


@pytest.mark.parametrize("refill,rows,slots,kind", [
    ("auto", 16, 0, Sampler), ("auto", 16, 16, Sampler), ("auto", 16, 8, RefillSampler),
    ("on", 16, 0, RefillSampler), ("off", 16, 8, Sampler)])
def test_factory_picks_the_rollout_sampler(tiny_model_config, refill, rows, slots, kind) -> None:
    cfg = tiny_model_config("llama")
    settings = RolloutSamplerSettings(refill=refill, max_concurrent_rows=slots, rows_per_step=rows,
                                      kv_policy=KVPolicyConfig(policy="snapkv", budget=8,
                                                               interval=4, window=2))
    sampler = build_rollout_sampler(cfg, jax.lax.dot_general, settings, max_prompt_len=16,
                                    max_new_tokens=16)
    assert type(sampler) is kind and sampler.max_concurrent_rows == slots
    assert sampler.engine.kv_policy.compresses
    # The evaluation refills its rows whenever the rollout caps its concurrent rows.
    eval_kind = RefillSampler if slots else Sampler
    evaluation = build_eval_sampler(cfg, settings, max_prompt_len=16, max_new_tokens=16)
    assert type(evaluation) is eval_kind and not evaluation.engine.kv_policy.compresses
    # eval.kv_cache='rollout': the policy under the rollout's compressed cache.
    compressed = build_eval_sampler(cfg, settings, True, max_prompt_len=16, max_new_tokens=16)
    assert type(compressed) is eval_kind and compressed.engine.kv_policy == settings.kv_policy


def test_factory_settings_reject_an_unknown_refill_mode() -> None:
    with pytest.raises(ValueError, match="rollout.refill='sometimes'"):
        RolloutSamplerSettings(refill="sometimes")
