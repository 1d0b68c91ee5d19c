"""Next-token sampling from float32 logits: greedy, temperature, top-k and top-p (nucleus).

Everything here is a pure function of one decode step's logits, so it is tested without a model.
The sampler needs two log-probabilities per sampled token: under the distribution that actually
produced it (the truncated and renormalised one when top-k/top-p cut the vocabulary) and under the
full tempered softmax, which is what the learner recomputes; their difference is the bias that a
learner would otherwise absorb silently into its importance ratios.

Sampling draws one uniform number per row and inverts the cumulative distribution instead of
adding Gumbel noise to every logit: with a 150k-token vocabulary that is one random number per row
instead of 150k, which matters on CPU where the random bits would otherwise cost more than the LM
head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingMode:
    """The static (compile-time) part of the sampling settings.

    greedy: take the arg-max; no randomness, no truncation.
    top_k: keep the k most likely tokens (0 = no top-k).
    top_p: whether a top-p cut is applied (its threshold is a traced value, so changing it does not
      recompile).
    """

    greedy: bool = False
    top_k: int = 0
    top_p: bool = False

    @property
    def truncates(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p)


def _inverse_cdf(probs: jax.Array, uniform: jax.Array, last_valid: jax.Array) -> jax.Array:
    """Index j with cdf[j-1] <= u * total < cdf[j]. probs f32[N, K]; uniform f32[N] in [0, 1).

    Zero-probability entries are never chosen (their cdf step is empty); `last_valid` i32[N] clamps
    the rare case where rounding puts u * total on the total itself.
    """
    cdf = jnp.cumsum(probs, axis=-1)
    u = uniform * cdf[:, -1]
    idx = jnp.sum(cdf <= u[:, None], axis=-1, dtype=jnp.int32)
    return jnp.minimum(idx, last_valid)


def sample_tokens(
    logits: jax.Array,
    key: jax.Array,
    temperature: jax.Array | float,
    top_p: jax.Array | float,
    mode: SamplingMode,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Samples one token per row.

    Args:
      logits: f[N, V] next-token logits (cast to float32 here).
      key: PRNG key for this step (unused when greedy).
      temperature: scalar > 0; logits are divided by it before softmax (also for greedy, where it
        only affects the reported log-probabilities).
      top_p: scalar in (0, 1]; used only when `mode.top_p`.
      mode: static settings.

    Returns:
      tokens i32[N];
      logp f32[N]: log-prob of the token under the distribution that produced it (truncated and
        renormalised when top-k/top-p apply; for greedy, the full tempered softmax);
      logp_untruncated f32[N]: log-prob under the full tempered softmax.
    """
    scaled = logits.astype(jnp.float32) / jnp.asarray(temperature, jnp.float32)
    n, v = scaled.shape
    log_norm = jax.nn.logsumexp(scaled, axis=-1)  # [N]

    if not mode.truncates:
        if mode.greedy:
            tokens = jnp.argmax(scaled, axis=-1).astype(jnp.int32)
        else:
            probs = jnp.exp(scaled - log_norm[:, None])
            u = jax.random.uniform(key, (n,), jnp.float32)
            tokens = _inverse_cdf(probs, u, jnp.full((n,), v - 1, jnp.int32))
        picked = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0]
        logp = picked - log_norm
        return tokens, logp, logp

    # Candidates in descending order: top-k uses a partial selection; top-p alone needs a full sort.
    k = mode.top_k if 0 < mode.top_k < v else v
    cand_logits, cand_ids = jax.lax.top_k(scaled, k)  # [N, K], descending
    keep = jnp.ones((n, k), jnp.bool_)
    if mode.top_p:
        # Keep a token when the mass of the tokens ranked strictly above it (within the top-k
        # renormalised distribution, as Hugging Face applies top-k before top-p) is below top_p;
        # the most likely token is always kept.
        cand_probs = jax.nn.softmax(cand_logits, axis=-1)
        mass_above = jnp.cumsum(cand_probs, axis=-1) - cand_probs
        keep = (mass_above < top_p) | (jnp.arange(k) == 0)[None, :]
    trunc_logits = jnp.where(keep, cand_logits, -jnp.inf)
    trunc_logp = jax.nn.log_softmax(trunc_logits, axis=-1)
    u = jax.random.uniform(key, (n,), jnp.float32)
    num_kept = jnp.sum(keep, axis=-1, dtype=jnp.int32)
    j = _inverse_cdf(jnp.exp(trunc_logp), u, num_kept - 1)
    tokens = jnp.take_along_axis(cand_ids, j[:, None], axis=-1)[:, 0].astype(jnp.int32)
    logp = jnp.take_along_axis(trunc_logp, j[:, None], axis=-1)[:, 0]
    logp_untruncated = jnp.take_along_axis(cand_logits, j[:, None], axis=-1)[:, 0] - log_norm
    return tokens, logp, logp_untruncated
