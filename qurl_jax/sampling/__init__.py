"""Rollout sampling: jitted prefill + early-exit decode over a KV cache, with exact log-probs.

Public API:
- `SamplingParams(max_new_tokens, temperature, top_k, top_p, greedy, eos_ids, behav_logp)`: what
  one call draws, one frozen value.
- `Sampler(config, dot_general, ..., max_concurrent_rows=..., platform=...)`: bucketed, cached
  programs; `Sampler.sample(params, prompts, settings, key=..., n=...) -> SampleOutput`, streamed
  through at most `max_concurrent_rows` rows at a time; `Sampler.lower_programs(abstract_params,
  rows, p_len, g_len)`: one chunk's prefill and decode programs, lowered, for memory analysis.
- `RefillSampler(...)`: the same interface with continuous batching: `max_concurrent_rows` row
  slots, each refilled with a waiting row as soon as its occupant finishes (long-tailed lengths
  keep the batch full); same key, same tokens as `Sampler`. `RefillRun`: what its last call did.
- `Engine`: what both samplers run (`sampler.engine`): buckets, cache layout, the prefill, the
  one decode step, the insert; `cache_slots`, `kv_bytes_per_row`, `prefill_slots`.
- `build_rollout_sampler(...)` (`qurl_jax.sampling.factory`): the sampler a run uses.
- `SampleOutput`, `FinishReason`: per-token tokens / logp / logp_untruncated / mask and per-row
  lengths and finish reasons, plus the left-padded prompts for the learner.
- `generate(sampler, params, texts, tokenizer, settings, ...)`: strings in, strings out.
- `sample_tokens`, `SamplingMode`: the single-step sampling math (greedy/temperature/top-k/top-p).
- `KVPolicyConfig`, `KVPolicy`, `Selection`: Sparse-RL's KV-cache compression (StreamingLLM,
  SnapKV, R-KV) for `Sampler(kv_policy=...)`; the cache then holds budget + interval slots per row.
- `CacheLayout`, `DenseKV`, `CompressedKV`: the KV cache layouts the engine runs.
"""

from qurl_jax.sampling._cache import CacheLayout, CompressedKV, DenseKV
from qurl_jax.sampling._distributions import SamplingMode, sample_tokens
from qurl_jax.sampling._engine import Engine
from qurl_jax.sampling._generate import generate
from qurl_jax.sampling._kv_policy import KVPolicy, KVPolicyConfig, Selection
from qurl_jax.sampling._output import FinishReason, SampleOutput
from qurl_jax.sampling._refill import RefillRun, RefillSampler
from qurl_jax.sampling._static import Sampler
from qurl_jax.sampling.settings import SamplingParams

__all__ = [
    "CacheLayout",
    "CompressedKV",
    "DenseKV",
    "Engine",
    "FinishReason",
    "KVPolicy",
    "KVPolicyConfig",
    "RefillRun",
    "RefillSampler",
    "SampleOutput",
    "Sampler",
    "SamplingMode",
    "SamplingParams",
    "Selection",
    "generate",
    "sample_tokens",
]
