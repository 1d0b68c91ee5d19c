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


_CDF_BLOCK = 256


def _inverse_cdf(probs: jax.Array, uniform: jax.Array) -> jax.Array:
    """Index j with cdf[j-1] <= u * total < cdf[j], i.e. a draw from `probs` (unnormalised).

    probs f32[N, K] (zeros allowed, never chosen); uniform f32[N] in [0, 1). Two levels: a cumsum
    over blocks of 256 picks the block, a cumsum inside that block picks the entry. A flat cumsum
    over a 150k vocabulary is the slowest op of a CPU decode step; this reads the row once and
    scans only N * (K/256 + 256) numbers. Rounding can put u just past a block's last entry; the
    draw then falls back to the block's last positive entry (a zero entry is never returned).
    """
    n, k = probs.shape
    nb = -(-k // _CDF_BLOCK)
    blocks = jnp.pad(probs, ((0, 0), (0, nb * _CDF_BLOCK - k))).reshape(n, nb, _CDF_BLOCK)
    block_mass = jnp.sum(blocks, axis=-1)  # [N, nb]
    block_cdf = jnp.cumsum(block_mass, axis=-1)
    u = uniform * block_cdf[:, -1]
    last_block = jnp.max(jnp.where(block_mass > 0, jnp.arange(nb), 0), axis=-1)
    b = jnp.minimum(jnp.sum(block_cdf <= u[:, None], axis=-1, dtype=jnp.int32), last_block)
    before = jnp.where(b > 0, jnp.take_along_axis(block_cdf, jnp.maximum(b - 1, 0)[:, None],
                                                  axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]  # [N, 256]
    inner_cdf = jnp.cumsum(inner, axis=-1)
    last = jnp.max(jnp.where(inner > 0, jnp.arange(_CDF_BLOCK), 0), axis=-1)
    j = jnp.minimum(jnp.sum(inner_cdf <= (u - before)[:, None], axis=-1, dtype=jnp.int32), last)
    return b * _CDF_BLOCK + j


def _nucleus_threshold(probs: jax.Array, top_p: jax.Array | float) -> jax.Array:
    """f32[N]: the smallest t with mass(p > t) < top_p, so the nucleus is {p >= t}, without a sort.

    probs f32[N, V], normalised. A token is in the nucleus when the tokens strictly more likely
    than it hold less than top_p of the mass; that mass only shrinks as t grows, so t is found by
    bisection on the bit pattern of a non-negative float32 (monotone in its value): 31 masked sums
    over the row instead of sorting 150k entries, which XLA's CPU sort makes ~50x slower.
    """
    n = probs.shape[0]
    lo = jnp.zeros((n,), jnp.int32)  # bits of 0.0: mass(p > 0) = 1 >= top_p
    hi = jnp.full((n,), 0x3F800000, jnp.int32)  # bits of 1.0: mass(p > 1) = 0 < top_p

    def bisect(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        t = jax.lax.bitcast_convert_type(mid, jnp.float32)
        below = jnp.sum(jnp.where(probs > t[:, None], probs, 0.0), axis=-1) < top_p
        return jnp.where(below, lo, mid), jnp.where(below, mid, hi)

    _, hi = jax.lax.fori_loop(0, 31, bisect, (lo, hi))
    return jax.lax.bitcast_convert_type(hi, jnp.float32)


def _uniforms(key: jax.Array, n: int) -> jax.Array:
    """f32[N] uniforms in [0, 1): N draws from one key, or one draw per key from keys [N]."""
    key_rank = 0 if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else 1  # raw keys: u32[2]
    if key.ndim == key_rank:
        return jax.random.uniform(key, (n,), jnp.float32)
    if key.shape[0] != n:
        raise ValueError(f"sample_tokens: {key.shape[0]} keys for {n} rows")
    return jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(key)


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
      key: PRNG key for this step, or keys [N], one per row (a row's draw then depends on its
        own key only, not on the batch it is in); unused when greedy.
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

    u = _uniforms(key, n)
    if not mode.truncates:
        if mode.greedy:
            # First index of the maximum (jnp.argmax's tie rule); two plain reductions are ~3x
            # faster than XLA's CPU arg-max reduction.
            top = jnp.max(scaled, axis=-1, keepdims=True)
            tokens = jnp.min(jnp.where(scaled == top, jnp.arange(v, dtype=jnp.int32), v), axis=-1)
        else:
            tokens = _inverse_cdf(jnp.exp(scaled - log_norm[:, None]), u)
        logp = jnp.take_along_axis(scaled, tokens[:, None], axis=-1)[:, 0] - log_norm
        return tokens, logp, logp

    if 0 < mode.top_k < v:
        # Top-k (then the nucleus of the renormalised top-k distribution, the order transformers
        # applies them in) on the k candidates, sorted descending by lax.top_k.
        cand_logits, cand_ids = jax.lax.top_k(scaled, mode.top_k)  # [N, k]
        keep = jnp.ones(cand_logits.shape, jnp.bool_)
        if mode.top_p:
            cand_probs = jax.nn.softmax(cand_logits, axis=-1)
            mass_above = jnp.cumsum(cand_probs, axis=-1) - cand_probs
            keep = mass_above < top_p
    else:
        # Top-p alone over the whole vocabulary: threshold instead of sort.
        cand_logits, cand_ids = scaled, None
        probs = jnp.exp(scaled - log_norm[:, None])
        keep = probs >= _nucleus_threshold(probs, top_p)[:, None]
    trunc_logits = jnp.where(keep, cand_logits, -jnp.inf)
    trunc_norm = jax.nn.logsumexp(trunc_logits, axis=-1)
    j = _inverse_cdf(jnp.exp(trunc_logits - trunc_norm[:, None]), u)
    picked = jnp.take_along_axis(cand_logits, j[:, None], axis=-1)[:, 0]
    tokens = j if cand_ids is None else jnp.take_along_axis(cand_ids, j[:, None], axis=-1)[:, 0]
    return tokens.astype(jnp.int32), picked - trunc_norm, picked - log_norm
