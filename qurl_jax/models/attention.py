"""The attention core shared by the learner, prefill, evaluation and the decode loop.

One function, `dot_product_attention`, computes grouped-query attention from post-RoPE queries,
keys and values. Which keys a query may see is decided by *logical positions*, never by where a key
sits in memory:

    allowed[b, t, s] = k_valid[b, s] & (k_pos[b, s] <= q_pos[b, t])

This one rule covers a left-padded learner sequence (pads are invalid keys; real tokens have
increasing positions), a prefill, a one-token decode step against a KV cache (every valid cached
key is in the past), and a compressed KV cache whose slots hold an arbitrary subset of the past.

Layouts: queries [B, T, H, D] (the projection's natural layout), keys and values [B, Hkv, S, D]
(the KV cache's layout: per (row, kv head), slots next to head_dim). Scores and softmax are
float32; the products run in the compute dtype of the inputs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Finite "minus infinity": a query with no allowed key (a left-pad query, an empty batch-padding
# row) gets a uniform softmax over masked scores instead of NaN; its output is never used.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def group_queries(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """[B, T, H, D] -> [B, Hkv, G*T, D]: the G = H / Hkv query heads of one kv head and the T query
    positions become the rows of one matrix per (row, kv head)."""
    b, t, h, d = q.shape
    g = h // num_kv_heads
    return q.reshape(b, t, num_kv_heads, g, d).transpose(0, 2, 3, 1, 4).reshape(
        b, num_kv_heads, g * t, d)


def ungroup_queries(out: jax.Array, t: int) -> jax.Array:
    """[B, Hkv, G*T, D] -> [B, T, H, D], the inverse of `group_queries`."""
    b, hkv, gt, d = out.shape
    g = gt // t
    return out.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d)


def allowed_mask(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
    """bool[B, T, S]: key s is visible to query t (valid and not in the query's future)."""
    return k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                          k_pos: jax.Array, k_valid: jax.Array) -> jax.Array:
    """Dense grouped-query attention; materialises the f32 [B, Hkv, G*T, S] scores.

    q: f[B, T, H, D]; k, v: f[B, Hkv, S, D]; q_pos: i32[B, T]; k_pos: i32[B, S];
    k_valid: bool[B, S]. Returns f[B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = group_queries(q, hkv)
    batch_dims = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(qg, k.astype(q.dtype), (((3,), (3,)), batch_dims))
    scores = scores.astype(jnp.float32).reshape(b, hkv, g, t, -1) / math.sqrt(d)
    allowed = allowed_mask(q_pos, k_pos, k_valid)  # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, hkv, g * t, -1)
    out = jax.lax.dot_general(probs, v.astype(q.dtype), (((3,), (2,)), batch_dims))
    return ungroup_queries(out, t)
