"""The one place that decides which sampler a run's rollouts use (`build_rollout_sampler`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.transformer import DotGeneral
from qurl_jax.sampling._engine import DECODE_ATTENTION
from qurl_jax.sampling._kv_policy import KVPolicyConfig
from qurl_jax.sampling._refill import RefillSampler
from qurl_jax.sampling._static import Sampler

REFILL_MODES = ("on", "off", "auto")
__all__ = ["DECODE_ATTENTION", "REFILL_MODES", "RolloutSamplerSettings", "build_eval_sampler",
           "build_rollout_sampler"]


@dataclasses.dataclass(frozen=True)
class RolloutSamplerSettings:
    """How a run's rollouts are sampled (typed from `config.rollout`, see
    `qurl_jax.config.rollout_sampler_settings`).

    refill: continuous batching (`RefillSampler`): 'on', 'off' (the static chunked `Sampler`) or
      'auto' = on when rows wait for a slot (max_concurrent_rows < rows_per_step), the only case
      where refilling can help.
    max_concurrent_rows: rows decoded at once (0 = all of a step's rows).
    rows_per_step: a step's rollout rows (prompts per step x samples per prompt).
    kv_policy: Sparse-RL's KV compression of the rollout actor.
    decode_attention: how decode steps read the KV cache ('auto' | 'xla' | 'pallas';
      `Engine`'s argument of that name): 'auto' reads only live slots where a kernel exists.
    """

    refill: str = "auto"
    max_concurrent_rows: int = 0
    rows_per_step: int = 0
    kv_policy: KVPolicyConfig = dataclasses.field(default_factory=KVPolicyConfig)
    decode_attention: str = "auto"

    def __post_init__(self) -> None:
        if self.refill not in REFILL_MODES:
            raise ValueError(f"rollout.refill={self.refill!r} must be one of {REFILL_MODES}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"model.decode_attention={self.decode_attention!r} must be one of "
                             f"{DECODE_ATTENTION}")

    @property
    def refills(self) -> bool:
        """Whether the rollouts use the refilling sampler."""
        if self.refill == "auto":
            return 0 < self.max_concurrent_rows < self.rows_per_step
        return self.refill == "on"


def build_rollout_sampler(model_config: ModelConfig, dot_general: DotGeneral,
                          settings: RolloutSamplerSettings, **engine_kwargs: Any
                          ) -> Sampler | RefillSampler:
    """The run's rollout sampler: `RefillSampler` when `settings.refills`, else `Sampler`, with
    the settings' concurrent rows, KV policy and decode attention; `engine_kwargs` are the
    `Engine`'s buckets, pad_id, mesh and platform."""
    kind = RefillSampler if settings.refills else Sampler
    return kind(model_config, dot_general, max_concurrent_rows=settings.max_concurrent_rows,
                kv_policy=settings.kv_policy, decode_attention=settings.decode_attention,
                **engine_kwargs)


def build_eval_sampler(model_config: ModelConfig, settings: RolloutSamplerSettings,
                       **engine_kwargs: Any) -> Sampler:
    """The run's evaluation sampler: full precision and dense (Sparse-RL's compression applies
    to the rollout actor only), static, as many concurrent rows and the same decode attention
    as the rollouts."""
    return Sampler(model_config, jax.lax.dot_general,
                   max_concurrent_rows=settings.max_concurrent_rows,
                   decode_attention=settings.decode_attention, **engine_kwargs)
