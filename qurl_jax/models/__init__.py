"""Decoder-only transformer models (Llama, Mistral, Qwen2, Qwen3) and their checkpoint formats.

Public API: `ModelConfig`, `Transformer`, `KVCache`, `init_params`, `param_logical_axes`, and the
checkpoint readers/writers in `qurl_jax.models.hf` and `qurl_jax.models.llama2c`.
"""

from qurl_jax.models.config import ModelConfig, RopeScaling
from qurl_jax.models.params import init_params, param_logical_axes, token_logprobs
from qurl_jax.models.transformer import KVCache, Transformer, cast_floats, positions_from_mask

__all__ = [
    "KVCache",
    "ModelConfig",
    "RopeScaling",
    "Transformer",
    "cast_floats",
    "init_params",
    "param_logical_axes",
    "positions_from_mask",
    "token_logprobs",
]
