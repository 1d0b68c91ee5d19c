"""The one place that decides which sampler a run's rollouts use (`build_rollout_sampler`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.kv_quant import KVPrecision, KVScale, kv_precision, kv_scale
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
    `qurl_jax.config.settings.rollout_sampler_settings`).

    refill: continuous batching (`RefillSampler`): 'on', 'off' (the static chunked `Sampler`) or
      'auto' = on when rows wait for a slot (max_concurrent_rows < rows_per_step), the only case
      where refilling can help, or when `kv_pages` > 0 (the pool exists only there).
    max_concurrent_rows: rows decoded at once (0 = all of a step's rows); with `kv_pages`, rows
      in flight (page-table rows), the pool bounding their tokens.
    rows_per_step: a step's rollout rows (prompts per step x samples per prompt).
    kv_policy: Sparse-RL's KV compression of the rollout actor.
    decode_attention: how decode steps read the KV cache ('auto' | 'xla' | 'pallas';
      `Engine`'s argument of that name): 'auto' reads only live slots where a kernel exists.
    kv_pages, kv_page_size, kv_watermark_pages: `RefillSampler`'s paged KV pool (0 pages = fixed
      dense slots; None watermark = 1/16 of a batch shard's pages). Pages need the refilling
      sampler (refill 'off' is an error) and a KV policy that does not compress.
    kv_precision: the rollout cache's keys and values (`models.kv_quant.KVPrecision`): 'bf16'
      (the compute dtype), 'int8' or 'fp8'; the evaluation sampler stays in the compute dtype.
    kv_scale: what one scale of an 8-bit cache covers (`models.kv_quant.KVScale`): 'token' or
      'sequence' (one per sequence and kv head, which JAX's TPU paged kernel reads without a
      float scale array as large as the pool).
    """

    refill: str = "auto"
    max_concurrent_rows: int = 0
    rows_per_step: int = 0
    kv_policy: KVPolicyConfig = dataclasses.field(default_factory=KVPolicyConfig)
    decode_attention: str = "auto"
    kv_pages: int = 0
    kv_page_size: int = 16
    kv_watermark_pages: int | None = None
    kv_precision: KVPrecision = KVPrecision.BF16
    kv_scale: KVScale = KVScale.TOKEN

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_precision", kv_precision(self.kv_precision))
        object.__setattr__(self, "kv_scale", kv_scale(self.kv_scale))
        if self.refill not in REFILL_MODES:
            raise ValueError(f"rollout.refill={self.refill!r} must be one of {REFILL_MODES}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"model.decode_attention={self.decode_attention!r} must be one of "
                             f"{DECODE_ATTENTION}")
        if self.kv_pages < 0 or self.kv_page_size < 1 or (self.kv_watermark_pages or 0) < 0:
            raise ValueError(f"rollout.kv_pages={self.kv_pages}, kv_page_size="
                             f"{self.kv_page_size}, kv_watermark_pages={self.kv_watermark_pages}"
                             " must be >= 0, >= 1 and >= 0 (or None)")
        if self.kv_pages and self.refill == "off":
            raise ValueError(f"rollout.kv_pages={self.kv_pages}: a paged KV pool needs the "
                             "refilling sampler, not rollout.refill='off'")
        if self.kv_pages and self.kv_policy.compresses:
            raise ValueError(f"rollout.kv_pages={self.kv_pages}: a paged KV pool does not take "
                             f"the compressing rollout.kv_policy={self.kv_policy.policy!r}")

    @property
    def refills(self) -> bool:
        """Whether the rollouts use the refilling sampler: 'on', or 'auto' with rows waiting
        for a slot or a paged pool."""
        if self.refill == "auto":
            return self.kv_pages > 0 or 0 < self.max_concurrent_rows < self.rows_per_step
        return self.refill == "on"

    @property
    def paging(self) -> dict[str, Any]:
        """`RefillSampler`'s paged-pool arguments."""
        return dict(kv_pages=self.kv_pages, kv_page_size=self.kv_page_size,
                    kv_watermark_pages=self.kv_watermark_pages)


def build_rollout_sampler(model_config: ModelConfig, dot_general: DotGeneral,
                          settings: RolloutSamplerSettings, **engine_kwargs: Any
                          ) -> Sampler | RefillSampler:
    """The run's rollout sampler: `RefillSampler` (with the settings' paged pool) when
    `settings.refills`, else `Sampler`, with the settings' concurrent rows, KV policy and decode
    attention; `engine_kwargs` are the `Engine`'s buckets, pad_id, mesh and platform."""
    if settings.refills:
        engine_kwargs = {**engine_kwargs, **settings.paging}
    kind = RefillSampler if settings.refills else Sampler
    model_config = model_config.replace(kv_scale=settings.kv_scale.value)
    return kind(model_config, dot_general, max_concurrent_rows=settings.max_concurrent_rows,
                kv_policy=settings.kv_policy, decode_attention=settings.decode_attention,
                kv_precision=settings.kv_precision, **engine_kwargs)


def build_eval_sampler(model_config: ModelConfig, settings: RolloutSamplerSettings,
                       compressed: bool = False, dot_general: DotGeneral = jax.lax.dot_general,
                       **engine_kwargs: Any) -> Sampler | RefillSampler:
    """The run's evaluation sampler: full precision (an 8-bit cache applies to the rollout actor
    only), as many concurrent rows and the same decode attention as the rollouts; its KV cache
    dense (Sparse-RL's compression applies to the rollout actor), or with `compressed` the
    rollout's `kv_policy` (`eval.kv_cache='rollout'`: the model under sparse inference);
    `dot_general` the model's product hook (a LoRA run's reads its frozen base and adapters).
    With `max_concurrent_rows` set, an evaluation's rows (every problem's samples) wait for
    slots, so they are refilled (`RefillSampler`: the static sampler's tokens, without a chunk
    decoding until its longest row ends), without shrinking the slots at the end: a run
    evaluates twice, and each smaller slot count adds a decode and a gather program per sampling
    mode (a SmolLM2-135M decode program compiled in 6 s at load 12) for the few dozen steps per
    pass its last rows run. Otherwise every row is decoded at once by the static `Sampler`."""
    refills = bool(settings.max_concurrent_rows)
    if refills:
        engine_kwargs = {**engine_kwargs, "shrink": False}
    kind = RefillSampler if refills else Sampler
    return kind(model_config, dot_general, max_concurrent_rows=settings.max_concurrent_rows,
                decode_attention=settings.decode_attention,
                kv_policy=settings.kv_policy if compressed else None, **engine_kwargs)


def samples_per_call(sampler: Any, n: int) -> int:
    """Samples per prompt one `sampler.sample` call can draw: n, or for a static `Sampler`
    whose chunk cannot hold n rows of a prompt on every batch shard (`max_concurrent_rows` <
    n x shards), the largest divisor of n it can (1 at worst: the sampler then says why)."""
    rows = getattr(sampler, "max_concurrent_rows", 0)
    if not rows or isinstance(sampler, RefillSampler):  # all rows at once, or refilled slots
        return n
    shards = sampler.engine.sharding.batch_shards
    return next((m for m in range(n, 0, -1) if n % m == 0 and m * shards <= rows), 1)
