"""Decoder-only transformer models (Llama, Mistral, Qwen2, Qwen3) and their checkpoint formats.

Public API: `ModelConfig`, `Transformer` (with `Remat` and `AttentionImplementation` switches),
`KVCache`, `PagedKVCache` (in the compute dtype or 8-bit: `KVPrecision`, `models.kv_quant`),
`init_params`, `param_logical_axes`, the log-prob helpers
(`token_logprobs`, `token_logprobs_and_entropy`, `chunked_token_logprobs` over
`lm_head_logits`), and the checkpoint readers/writers in `qurl_jax.models.hf` and
`qurl_jax.models.llama2c`.
"""

from qurl_jax.models.attention import Implementation as AttentionImplementation
from qurl_jax.models.config import ModelConfig, Remat, RopeScaling
from qurl_jax.models.kv_quant import KVPrecision
from qurl_jax.models.params import (
    chunked_token_logprobs,
    init_params,
    param_logical_axes,
    token_logprobs,
    token_logprobs_and_entropy,
)
from qurl_jax.models.transformer import (
    KVCache,
    PagedKVCache,
    Transformer,
    cast_floats,
    lm_head_logits,
    positions_from_mask,
)

__all__ = [
    "AttentionImplementation",
    "KVCache",
    "KVPrecision",
    "ModelConfig",
    "PagedKVCache",
    "Remat",
    "RopeScaling",
    "Transformer",
    "cast_floats",
    "chunked_token_logprobs",
    "init_params",
    "lm_head_logits",
    "param_logical_axes",
    "positions_from_mask",
    "token_logprobs",
    "token_logprobs_and_entropy",
]
