"""The end-of-run rollout speed check: tokens/s of the quantized actor vs the fp32 actor.

`compare_rollout_speed` samples the same prompts with the same key through each (sampler, params)
pair, with EOS disabled so every engine generates the same number of tokens, after one untimed
call that compiles. The trainer calls it at the end of a run when `train.report_speed` is set
(`Trainer.rollout_speed`); the figures are the summary table's "rollout speed" rows.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from qurl_jax.parallel.distributed import to_host
from qurl_jax.sampling import RefillSampler, Sampler, SamplingParams


def compare_rollout_speed(engines: Sequence[tuple[str, Sampler | RefillSampler, Any]],
                          prompts: Sequence[Sequence[int]], settings: SamplingParams, *,
                          key: jax.Array, n: int) -> dict[str, float]:
    """Tokens/s per engine.

    Args:
      engines: (name, sampler, params) per engine; the first is the reference.
      prompts: token ids of the prompts, each sampled `n` times.
      settings: what to draw (EOS ids, if any, are dropped: every row runs to the limit).
      key: PRNG key, the same for every engine.
      n: samples per prompt.

    Returns:
      `{name}_tokens_per_s` for every engine, and `speedup` (the last engine's tokens/s over the
      first's) when there are two or more.
    """
    kwargs = dict(key=key, n=n, settings=settings.replace(eos_ids=()))
    result = {}
    for name, sampler, params in engines:
        jax.block_until_ready(sampler.sample(params, prompts, **kwargs).tokens)  # compile
        start = time.perf_counter()
        out = jax.block_until_ready(sampler.sample(params, prompts, **kwargs))
        result[f"{name}_tokens_per_s"] = float(np.asarray(to_host(out.lengths)).sum()) / (
            time.perf_counter() - start)
    if len(engines) > 1:
        first, last = engines[0][0], engines[-1][0]
        result["speedup"] = result[f"{last}_tokens_per_s"] / result[f"{first}_tokens_per_s"]
    return result
