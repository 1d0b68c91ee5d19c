"""Rollout sampling: jitted prefill + early-exit decode over a KV cache, with exact log-probs.

Public API:
- `Sampler(config, dot_general, ...)`: bucketed, cached programs; `Sampler.sample(params, prompts,
  key=..., n=..., max_new_tokens=..., temperature=..., top_k=..., top_p=..., greedy=...,
  eos_ids=...) -> SampleOutput`.
- `SampleOutput`, `FinishReason`: per-token tokens / logp / logp_untruncated / mask and per-row
  lengths and finish reasons, plus the left-padded prompts for the learner.
- `generate(sampler, params, texts, tokenizer, ...)`: strings in, strings out (CLI, evaluation).
- `sample_tokens`, `SamplingMode`: the single-step sampling math (greedy/temperature/top-k/top-p).
"""

from qurl_jax.sampling._distributions import SamplingMode, sample_tokens
from qurl_jax.sampling._generate import generate
from qurl_jax.sampling._sampler import FinishReason, SampleOutput, Sampler

__all__ = [
    "FinishReason",
    "SampleOutput",
    "Sampler",
    "SamplingMode",
    "generate",
    "sample_tokens",
]
