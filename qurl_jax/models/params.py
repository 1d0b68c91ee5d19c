"""Parameter pytree helpers: initialisation, logical axis names, and per-token log-probabilities.

`init_params` returns the unboxed linen `params` dict (float32 master weights);
`param_logical_axes` returns a pytree of the same structure whose leaves are
`jax.sharding.PartitionSpec`s of *logical* axis names, which `qurl_jax.parallel.sharding` maps to
the mesh. `token_logprobs_and_entropy` is the project's one log-softmax-and-gather;
`chunked_token_logprobs` applies it to final hidden states chunk by chunk (the learner's memory-
bounded response log-probs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from qurl_jax.models import exact as exact_lib
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


def token_logprobs_and_entropy(logits: jax.Array, targets: jax.Array, temperature: float = 1.0,
                               with_entropy: bool = False) -> tuple[jax.Array, jax.Array | None]:
    """(log-prob of `targets`, entropy or None) under softmax(logits / temperature), float32.

    logits f[..., V], targets i32[...]; both results f32[...]. The project's one log-softmax and
    gather: `jax.nn.log_softmax`'s arithmetic (shift by the stopped-gradient max), written out so
    that only the target's shifted logit is gathered and no second f32[..., V] array (the full
    log-probabilities) is needed beside the logits. (A one-hot compare-and-sum instead of the
    gather made XLA:CPU materialise an i32 and a bool [..., V] array: 1.8x the temp memory.)
    """
    z = logits.astype(jnp.float32) / temperature
    shifted = z - jax.lax.stop_gradient(z.max(axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1))
    logp = jnp.take_along_axis(shifted, targets[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
        return logp, None
    probs = jnp.exp(shifted - lse[..., None])
    return logp, lse - jnp.sum(probs * shifted, axis=-1)


def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: float = 1.0) -> jax.Array:
    """log softmax(logits / temperature)[targets] in float32. logits f[..., V], targets i32[...]."""
    return token_logprobs_and_entropy(logits, targets, temperature)[0]


def chunked_token_logprobs(head: Callable[[jax.Array], jax.Array], hidden: jax.Array,
                           targets: jax.Array, temperature: float = 1.0, *, chunk: int,
                           with_entropy: bool = False, exact: bool = False
                           ) -> tuple[jax.Array, jax.Array | None]:
    """`token_logprobs_and_entropy(head(hidden), targets)` without ever holding all the logits.

    hidden f[B, G, E] (final hidden states of the positions that predict `targets`),
    targets i32[B, G]; head maps f[B, C, E] -> f32[B, C, V] (`lm_head_logits`). The G positions are
    cut into chunks of `chunk` (the last one padded) and a `lax.scan` runs the head, log-softmax and
    gather on one chunk at a time under `jax.checkpoint`: the forward keeps one f32[B, chunk, V]
    block and the backward recomputes it per chunk instead of storing it, so the logits cost
    O(B * chunk * V) memory for any G. Returns f32[B, G] log-probs and entropies (or None).
    `exact`: the log-probs in the fixed order the sampler reports them in under exact numerics
    (`models.exact.token_logprobs`; entropies as always).
    """
    b, g = targets.shape
    c = min(chunk, g)
    n = -(-g // c)
    pad = n * c - g
    hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
    targets = jnp.pad(targets, ((0, 0), (0, pad)))
    hs = hidden.reshape(b, n, c, hidden.shape[-1]).swapaxes(0, 1)  # [n, B, C, E]
    ts = targets.reshape(b, n, c).swapaxes(0, 1)  # [n, B, C]

    # prevent_cse=False: inside a scan, CSE cannot merge the recomputation with the forward.
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one_chunk(h: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        logits = head(h)
        logp, entropy = token_logprobs_and_entropy(logits, t, temperature, with_entropy)
        if exact:
            logp = exact_lib.token_logprobs(logits, t, temperature, token_logprobs)
        return logp, entropy

    if n == 1:  # no loop: XLA:CPU fuses a single chunk with its neighbours
        logp, entropy = jax.tree.map(lambda x: x[None], one_chunk(hs[0], ts[0]))
    else:
        _, (logp, entropy) = jax.lax.scan(lambda carry, xs: (carry, one_chunk(*xs)), None, (hs, ts))
    unchunk = lambda x: x.swapaxes(0, 1).reshape(b, n * c)[:, :g]  # noqa: E731
    return unchunk(logp), None if entropy is None else unchunk(entropy)
