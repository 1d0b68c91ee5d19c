"""Rollout sampling: jitted prefill + early-exit decode over a KV cache, with exact log-probs.

Public API:
- `Sampler(config, dot_general, ..., max_concurrent_rows=..., platform=...)`: bucketed, cached
  programs; `Sampler.sample(params, prompts, key=..., n=..., max_new_tokens=..., temperature=...,
  top_k=..., top_p=..., greedy=..., eos_ids=...) -> SampleOutput`, streamed through at most
  `max_concurrent_rows` rows at a time; `Sampler.lower_programs(abstract_params, rows, p_len,
  g_len)`: one chunk's prefill and decode programs, lowered, for memory analysis.
- `SampleOutput`, `FinishReason`: per-token tokens / logp / logp_untruncated / mask and per-row
  lengths and finish reasons, plus the left-padded prompts for the learner.
- `RefillSampler(...)`: the same interface with continuous batching: `max_concurrent_rows` row
  slots, each refilled with a waiting row as soon as its occupant finishes (long-tailed lengths
  keep the batch full); same key, same tokens as `Sampler`. `RefillRun`: what its last call did.
- `generate(sampler, params, texts, tokenizer, ...)`: strings in, strings out (CLI, evaluation).
- `sample_tokens`, `SamplingMode`: the single-step sampling math (greedy/temperature/top-k/top-p).
- `KVPolicyConfig`, `KVPolicy`, `Selection`: Sparse-RL's KV-cache compression (StreamingLLM,
  SnapKV, R-KV) for `Sampler(kv_policy=...)`; the cache then holds budget + interval slots per row.
"""

from qurl_jax.sampling._distributions import SamplingMode, sample_tokens
from qurl_jax.sampling._generate import generate
from qurl_jax.sampling._kv_policy import KVPolicy, KVPolicyConfig, Selection
from qurl_jax.sampling._refill import RefillRun, RefillSampler
from qurl_jax.sampling._sampler import FinishReason, SampleOutput, Sampler

__all__ = [
    "FinishReason",
    "KVPolicy",
    "KVPolicyConfig",
    "RefillRun",
    "RefillSampler",
    "SampleOutput",
    "Sampler",
    "SamplingMode",
    "Selection",
    "generate",
    "sample_tokens",
]
