"""Parameter pytree helpers: initialisation, logical axis names, and per-token log-probabilities.

`init_params` returns the unboxed linen `params` dict (float32 master weights);
`param_logical_axes` returns a pytree of the same structure whose leaves are
`jax.sharding.PartitionSpec`s of *logical* axis names, which `qurl_jax.sharding` maps to the mesh.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.transformer import Transformer

Params = dict[str, Any]


def _dummy_inputs() -> tuple[jax.Array, jax.Array]:
    tokens = jnp.zeros((1, 1), jnp.int32)
    return tokens, tokens


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
    """Random float32 parameters (normal(0.02) kernels, unit norms, zero biases)."""
    config.validate()
    boxed = Transformer(config).init(rng, *_dummy_inputs())["params"]
    return nn.meta.unbox(boxed)


def param_logical_axes(config: ModelConfig) -> Params:
    """PartitionSpecs of logical axis names, one per parameter, without allocating parameters."""
    abstract = jax.eval_shape(
        lambda: Transformer(config).init(jax.random.key(0), *_dummy_inputs())["params"]
    )
    return nn.get_partition_spec(abstract)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[targets] in float32. logits f[..., V], targets i32[...]."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
