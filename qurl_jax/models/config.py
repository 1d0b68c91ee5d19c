"""Model configuration: one frozen dataclass drives every supported decoder family.

Llama 1/2/3 (with llama3 RoPE scaling), Mistral-style grouped-query attention, Qwen2/Qwen2.5
(bias on the q/k/v projections) and Qwen3 (per-head RMSNorm on q and k) differ only in a handful of
switches, so they share one implementation in `transformer.py`. `ModelConfig.validate` checks the
fields before anything is built, so a bad checkpoint config fails with the name of the field, not
with a shape error deep inside a jitted function.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax.numpy as jnp

from qurl_jax.models.attention import Implementation
from qurl_jax.models.kv_quant import KVScale

# `ModelConfig.numerics`: 'exact' runs `models.exact`'s fixed-order ops.
NUMERICS = ("default", "exact")

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class Remat(enum.StrEnum):
    """What the learner's backward pass keeps of each decoder layer's forward (`Transformer.remat`).

    NONE keeps every intermediate the backward uses; DOTS keeps the outputs of the weight matmuls
    (per token: the q/k/v/o, gate/up and down projections, H*D + 2*Hkv*D + 2*E + 2*M values) and
    recomputes the rest (norms, RoPE, attention, activations); FULL keeps only the layer's input
    (E values per token) and recomputes the whole layer.

    PROJECTIONS keeps the same values as DOTS, found by name instead of by primitive: the output of
    every `Linear` (`PROJECTION`), whatever product made it. DOTS' rule sees only `dot_general`
    primitives, so it misses products behind a custom VJP or a custom call (a LoRA learner's W8A8
    base products, `lora.learner_products='w8a8'`: the forward ran again in the backward) and keeps
    the adapter's own [T, out] product instead, which buys nothing.
    """

    NONE = "none"
    DOTS = "dots"  # jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    PROJECTIONS = "projections"  # jax.checkpoint_policies.save_only_these_names(PROJECTION)
    FULL = "full"  # jax.checkpoint_policies.nothing_saveable


# The name (`jax.ad_checkpoint.checkpoint_name`) of every projection's output, `Remat.PROJECTIONS`.
PROJECTION = "projection"


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling: 'llama3' uses the four llama3 fields, 'linear' only `factor`."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyper-parameters (Hugging Face field meanings).

    `dtype` is the compute dtype (float32 on CPU, bfloat16 on TPU/GPU); master parameters are always
    `param_dtype` (float32) so that tiny RL updates are not lost to bf16 rounding in the learner.
    `attention` picks the attention implementation ('auto' | 'dense' | 'blockwise' | 'cudnn' |
    'pallas_tpu').
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 2048
    dtype: str = "float32"
    param_dtype: str = "float32"
    # Attention implementation (`attention.Implementation`): a property of how this process runs
    # the model, not of the checkpoint, so `hf.py` neither writes nor reads it.
    attention: str = "auto"
    # What one scale of an 8-bit decode cache covers (`kv_quant.KVScale`: 'token' | 'sequence'),
    # a property of the sampler's cache like `attention`; hf.py ignores it too.
    kv_scale: str = "token"
    # 'exact': the ops whose reduction order XLA picks per shape run in one fixed order, so the
    # learner's forward and the rollout's prefill and cached decode give bitwise-equal values
    # (`models.exact`, `train.on_policy_numerics`); a property of how this process runs the model.
    numerics: str = "default"

    @property
    def compute_dtype(self) -> Any:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> Any:
        return jnp.dtype(self.param_dtype)

    def replace(self, **kwargs: Any) -> ModelConfig:
        return dataclasses.replace(self, **kwargs)

    def validate(self) -> ModelConfig:
        """Raises ValueError naming the first inconsistent field; returns self for chaining."""
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type={self.model_type!r} is not supported; expected one of "
                f"{SUPPORTED_MODEL_TYPES}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for RoPE")
        rs = self.rope_scaling
        if rs is not None and rs.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"ModelConfig.rope_scaling.rope_type={rs.rope_type!r} is not "
                f"supported; expected one of {SUPPORTED_ROPE_TYPES}"
            )
        if self.kv_scale not in tuple(KVScale):
            raise ValueError(f"ModelConfig.kv_scale={self.kv_scale!r} must be one of "
                             f"{tuple(str(g) for g in KVScale)}")
        if self.numerics not in NUMERICS:
            raise ValueError(f"ModelConfig.numerics={self.numerics!r} must be one of {NUMERICS} "
                             "(train.on_policy_numerics)")
        if self.attention not in tuple(Implementation):
            raise ValueError(f"ModelConfig.attention={self.attention!r} is not supported; "
                             f"expected one of {tuple(str(i) for i in Implementation)}")
        for name in ("dtype", "param_dtype"):
            try:
                jnp.dtype(getattr(self, name))
            except TypeError as e:
                raise ValueError(
                    f"ModelConfig.{name}={getattr(self, name)!r} is not a dtype") from e
        return self

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings included, LM head counted once when tied)."""
        e, m, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        attn = e * q + 2 * e * kv + q * e + (q + 2 * kv if self.attention_bias else 0)
        attn += 2 * self.head_dim if self.qk_norm else 0
        layer = attn + 3 * e * m + 2 * e
        head = 0 if self.tie_word_embeddings else e * v
        return v * e + self.num_layers * layer + e + head
