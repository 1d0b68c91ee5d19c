"""The attention core shared by the learner, prefill, evaluation and the decode loop.

Three implementations of one contract, and `attention`, the dispatcher that picks one:

- `dot_product_attention`: dense; materialises the f32 [T, S] scores. Fastest for short sequences
  and for a one-token decode step (whose scores are only [1, S]).
- `blockwise_attention`: online softmax over key blocks (flash-attention style) in plain JAX, so it
  runs on every backend. Memory is O(T) in the forward and in the backward: a `jax.custom_vjp`
  saves only the output and the per-row logsumexp and recomputes each score block in the backward.
- `cudnn_attention`: `jax.nn.dot_product_attention(implementation='cudnn')`, GPU only, bf16/fp16.
- `pallas_tpu_attention`: JAX's Pallas TPU splash-attention kernel (causal by index, padding as
  segment ids); TPU only, and only for self-attention over one in-order sequence (see there).

Which keys a query may see is decided by *logical positions*, never by where a key sits in memory:

    allowed[b, t, s] = k_valid[b, s] & (k_pos[b, s] <= q_pos[b, t])

This one rule covers a left-padded learner sequence (pads are invalid keys; real tokens have
increasing positions), a prefill, a one-token decode step against a KV cache (every valid cached
key is in the past), and a compressed KV cache whose slots hold an arbitrary subset of the past.

Packed rows (several sequences one after another in one row, `qurl_jax.learner.packing`) add segment
ids i32[B, T] to self-attention (S == T): a query sees only keys of its own segment,

    allowed[b, t, s] &= segment_ids[b, s] == segment_ids[b, t]

and positions restart at 0 in every segment (RoPE sees each sequence as if it were alone). Every
implementation takes them: dense and cuDNN in their mask, blockwise in its score blocks (and skips
blocks whose segments do not meet), splash as its own segment ids. Packed rows whose responses
share their prompt (`PackedSegments`: the prompt once, then each response as a segment whose
positions continue it) add a second segment each query sees,

    allowed[b, t, s] &= (seg[b, s] == seg[b, t]) | (seg[b, s] == prefix[b, t])   (seg: the ids)

which the dense implementation takes (the others raise).

Layouts: queries [B, T, H, D] (the projection's natural layout), keys and values [B, Hkv, S, D]
(the KV cache's layout: per (row, kv head), slots next to head_dim). Scores and softmax are
float32; the products run in the compute dtype of the inputs.

A query row with no allowed key (a left-pad query, an empty batch-padding row) has no meaningful
output; it is never used. Dense gives a uniform average over the masked keys there, blockwise
gives zeros; neither gives NaN, in the forward or the backward.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.parallel import targets

# Finite "minus infinity": a query with no allowed key (a left-pad query, an empty batch-padding
# row) gets a uniform softmax over masked scores instead of NaN; its output is never used.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# `auto` uses blockwise attention above this many keys (and more than one query). Dense scores of
# one layer are 4 * B * H * T * S bytes (kept for the backward unless the layer is rematerialised):
# 0.2 GB per sequence with 12 heads at 2048 tokens, 24 GB at 22K tokens. Measured on XLA:CPU (one
# sequence, 12 query / 2 kv heads of 64, f32, causal; forward + backward time blockwise / dense):
# 1.2-1.4x at 256-512 keys, ~0.9x at 1024, 0.6x at 2048, 0.4x at 4096.
AUTO_BLOCKWISE_MIN_KEYS = 1024
# Score block of the blockwise kernel: [B, Hkv, G, BLOCK_Q, BLOCK_K] float32 per step.
BLOCK_Q = 512
BLOCK_K = 512


class Implementation(enum.StrEnum):
    """`ModelConfig.attention`: which attention implementation the model runs."""

    AUTO = "auto"  # blockwise above AUTO_BLOCKWISE_MIN_KEYS keys (and T > 1), dense below
    DENSE = "dense"
    BLOCKWISE = "blockwise"
    CUDNN = "cudnn"  # jax.nn.dot_product_attention on cuDNN; GPU only, never chosen by auto
    # JAX's Pallas TPU splash attention; TPU only, one device (or inside a shard_map): XLA
    # cannot partition a Mosaic kernel over a mesh, so `auto` does not choose it.
    PALLAS_TPU = "pallas_tpu"


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


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedSegments:
    """Segments of packed rows whose responses share their prompt, in place of `segment_ids`.

    ids: i32[B, T] each token's segment (the prompt's, or its response's own); prefix: i32[B, T]
    the one other segment it also attends to: the prompt's for a response's tokens, its own for
    the prompt's (`qurl_jax.learner.packing.pack_budget` with `group`)."""

    ids: jax.Array
    prefix: jax.Array


def allowed_mask(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array,
                 segment_ids: jax.Array | PackedSegments | None = None) -> jax.Array:
    """bool[B, T, S]: key s is visible to query t (valid, not in the query's future and, with
    segment ids i32[B, T] (self-attention, S == T), in the query's segment, or with
    `PackedSegments` also in its prefix segment)."""
    allowed = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])
    if isinstance(segment_ids, PackedSegments):
        ids, prefix = segment_ids.ids, segment_ids.prefix
        allowed &= (ids[:, None, :] == ids[:, :, None]) | (ids[:, None, :] == prefix[:, :, None])
    elif segment_ids is not None:
        allowed &= segment_ids[:, None, :] == segment_ids[:, :, None]
    return allowed


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                          k_pos: jax.Array, k_valid: jax.Array,
                          segment_ids: jax.Array | None = None) -> jax.Array:
    """Dense grouped-query attention; materialises the f32 [B, Hkv, G*T, S] scores.

    q: f[B, T, H, D]; k, v: f[B, Hkv, S, D]; q_pos: i32[B, T]; k_pos: i32[B, S];
    k_valid: bool[B, S]; segment_ids: optional i32[B, T] of packed self-attention (S == T).
    Returns f[B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    qg = group_queries(q, hkv)
    batch_dims = ((0, 1), (0, 1))
    scores = jax.lax.dot_general(qg, k.astype(q.dtype), (((3,), (3,)), batch_dims))
    scores = scores.astype(jnp.float32).reshape(b, hkv, g, t, -1) / math.sqrt(d)
    allowed = allowed_mask(q_pos, k_pos, k_valid, segment_ids)  # [B, T, S]
    scores = jnp.where(allowed[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(b, hkv, g * t, -1)
    out = jax.lax.dot_general(probs, v.astype(q.dtype), (((3,), (2,)), batch_dims))
    return ungroup_queries(out, t)


# ------------------------------------------------------------------------------------ blockwise
# Internal layout: queries [B, Hkv, G, T, D] (query blocks are blocks of positions, so one
# position mask serves all G heads of a kv head), keys and values [B, Hkv, S, D]. T and S are
# padded to multiples of the block sizes; padded keys are invalid, padded queries see no key.

_INT_MIN = jnp.iinfo(jnp.int32).min
_INT_MAX = jnp.iinfo(jnp.int32).max


def _block(x: jax.Array, i: jax.Array, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, i * size, size, axis)


def _set_block(x: jax.Array, block: jax.Array, i: jax.Array, size: int, axis: int) -> jax.Array:
    return jax.lax.dynamic_update_slice_in_dim(x, block.astype(x.dtype), i * size, axis)


def _loop(n: int, body: Callable[[jax.Array, Any], Any], init: Any) -> Any:
    """`fori_loop(0, n, body, init)` as a `while_loop`. The kernels' loops are never differentiated
    (the custom_vjp owns the gradient), and a while loop cannot be partially evaluated: under an
    outer `lax.scan` over layers, JAX would otherwise hoist the loop-invariant parts of a scan-based
    loop (the per-block masks) out of the layer scan as residuals stacked over all (query block,
    key block) pairs, i.e. O(T^2) memory again."""
    return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, body(c[0], c[1])),
                              (jnp.int32(0), init))[1]


def _needed_blocks(q_pos: jax.Array, k_pos: jax.Array, k_valid: jax.Array, bq: int,
                   bk: int, q_seg: jax.Array | None = None,
                   k_seg: jax.Array | None = None) -> jax.Array:
    """bool[nq, nk]: some row of the batch has an allowed (query, key) pair in block (i, j).

    Skipping the other blocks halves the work of causal attention and skips empty cache slots.
    With segment ids (packed self-attention: each segment contiguous and in order, so causal by
    index) a block pair is needed only if it is on or below the diagonal and some row's query and
    key segment ranges meet: the blocks between two sequences of a packed row are skipped."""
    b, t = q_pos.shape
    s = k_pos.shape[1]
    q_max = q_pos.reshape(b, t // bq, bq).max(-1)  # [B, nq]
    k_min = jnp.where(k_valid, k_pos, _INT_MAX).reshape(b, s // bk, bk).min(-1)  # [B, nk]
    if q_seg is None:
        return jnp.any(k_min[:, None, :] <= q_max[:, :, None], axis=0)
    qs = q_seg.reshape(b, t // bq, bq)
    ks_lo = jnp.where(k_valid, k_seg, _INT_MAX).reshape(b, s // bk, bk).min(-1)
    ks_hi = jnp.where(k_valid, k_seg, _INT_MIN).reshape(b, s // bk, bk).max(-1)
    meet = (ks_lo[:, None, :] <= qs.max(-1)[:, :, None]) & (
        ks_hi[:, None, :] >= qs.min(-1)[:, :, None])
    causal = (jnp.arange(s // bk) * bk)[None, :] <= (jnp.arange(t // bq) * bq + bq - 1)[:, None]
    return jnp.any(meet, axis=0) & causal


def _scores(q_i, k_j, q_pos_i, k_pos_j, k_valid_j, scale, q_seg_i=None, k_seg_j=None):
    """f32[B, Hkv, G, bq, bk] scaled scores of one block, -inf where not allowed."""
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    allowed = k_valid_j[:, None, :] & (k_pos_j[:, None, :] <= q_pos_i[:, :, None])  # [B, bq, bk]
    if q_seg_i is not None:
        allowed &= k_seg_j[:, None, :] == q_seg_i[:, :, None]
    return jnp.where(allowed[:, None, None], s, -jnp.inf)


def _seg_block(seg, i, size):
    return None if seg is None else _block(seg, i, size, 1)


def _flash_forward(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, bq, bk):
    """(out f[B, Hkv, G, T, D], lse f32[B, Hkv, G, T]); lse = +inf on rows with no allowed key."""
    b, hkv, g, t, d = q.shape
    nq, nk = t // bq, k.shape[2] // bk
    scale = 1.0 / math.sqrt(d)
    needed = _needed_blocks(q_pos, k_pos, k_valid, bq, bk, q_seg, k_seg)

    def query_block(i, outputs):
        q_i, q_pos_i = _block(q, i, bq, 3), _block(q_pos, i, bq, 1)
        q_seg_i = _seg_block(q_seg, i, bq)

        def key_block(j, carry):
            def compute(carry):
                m, denom, acc = carry
                s = _scores(q_i, _block(k, j, bk, 2), q_pos_i, _block(k_pos, j, bk, 1),
                            _block(k_valid, j, bk, 1), scale, q_seg_i, _seg_block(k_seg, j, bk))
                m_new = jnp.maximum(m, s.max(-1))
                # Rows that have seen no allowed key yet keep m = -inf; exponentiate against 0.
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                correction = jnp.exp(m - m_safe)
                pv = jnp.einsum("bhgqk,bhkd->bhgqd", p.astype(v.dtype), _block(v, j, bk, 2),
                                preferred_element_type=jnp.float32)
                return (m_new, denom * correction + p.sum(-1),
                        acc * correction[..., None] + pv)

            return jax.lax.cond(needed[i, j], compute, lambda c: c, carry)

        init = (jnp.full((b, hkv, g, bq), -jnp.inf, jnp.float32),
                jnp.zeros((b, hkv, g, bq), jnp.float32),
                jnp.zeros((b, hkv, g, bq, d), jnp.float32))
        m, denom, acc = _loop(nk, key_block, init)
        seen = denom > 0
        denom = jnp.where(seen, denom, 1.0)
        out, lse = outputs
        return (_set_block(out, acc / denom[..., None], i, bq, 3),
                _set_block(lse, jnp.where(seen, m + jnp.log(denom), jnp.inf), i, bq, 3))

    return _loop(nq, query_block, (jnp.zeros(q.shape, q.dtype),
                                   jnp.zeros(q.shape[:-1], jnp.float32)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _flash(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, bq, bk):
    return _flash_forward(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, bq, bk)[0]


def _flash_fwd(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, bq, bk):
    out, lse = _flash_forward(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, bq, bk)
    return out, (q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, out, lse)


def _flash_bwd(bq, bk, residuals, d_out):
    """FlashAttention-2's backward: key blocks outside (dk, dv of one block accumulate over the
    query blocks), query blocks inside (dq, kept whole in f32, accumulates over key blocks)."""
    q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg, out, lse = residuals
    d = q.shape[-1]
    nq, nk = q.shape[3] // bq, k.shape[2] // bk
    scale = 1.0 / math.sqrt(d)
    needed = _needed_blocks(q_pos, k_pos, k_valid, bq, bk, q_seg, k_seg)
    # delta = rowsum(dO * O) = sum_k P dP, the softmax backward's per-row term.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    d_out = d_out.astype(q.dtype)

    def key_block(j, grads):
        k_j, v_j = _block(k, j, bk, 2), _block(v, j, bk, 2)
        k_pos_j, k_valid_j = _block(k_pos, j, bk, 1), _block(k_valid, j, bk, 1)
        k_seg_j = _seg_block(k_seg, j, bk)

        def query_block(i, carry):
            def compute(carry):
                dq, dk_j, dv_j = carry
                q_i, do_i = _block(q, i, bq, 3), _block(d_out, i, bq, 3)
                s = _scores(q_i, k_j, _block(q_pos, i, bq, 1), k_pos_j, k_valid_j, scale,
                            _seg_block(q_seg, i, bq), k_seg_j)
                p = jnp.exp(s - _block(lse, i, bq, 3)[..., None])  # 0 where masked or row empty
                dv_j = dv_j + jnp.einsum("bhgqk,bhgqd->bhkd", p.astype(q.dtype), do_i,
                                         preferred_element_type=jnp.float32)
                dp = jnp.einsum("bhgqd,bhkd->bhgqk", do_i, v_j,
                                preferred_element_type=jnp.float32)
                ds = (p * (dp - _block(delta, i, bq, 3)[..., None]) * scale).astype(q.dtype)
                dq_i = _block(dq, i, bq, 3) + jnp.einsum(
                    "bhgqk,bhkd->bhgqd", ds, k_j, preferred_element_type=jnp.float32)
                dk_j = dk_j + jnp.einsum("bhgqk,bhgqd->bhkd", ds, q_i,
                                         preferred_element_type=jnp.float32)
                return _set_block(dq, dq_i, i, bq, 3), dk_j, dv_j

            return jax.lax.cond(needed[i, j], compute, lambda c: c, carry)

        dq, dk, dv = grads
        zeros = jnp.zeros(k_j.shape, jnp.float32)
        dq, dk_j, dv_j = _loop(nq, query_block, (dq, zeros, zeros))
        return dq, _set_block(dk, dk_j, j, bk, 2), _set_block(dv, dv_j, j, bk, 2)

    dq, dk, dv = _loop(nk, key_block, (jnp.zeros(q.shape, jnp.float32),
                                       jnp.zeros(k.shape, jnp.float32),
                                       jnp.zeros(v.shape, jnp.float32)))
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None,
            None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


def _pad_to(x: jax.Array, size: int, axis: int, value) -> jax.Array:
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad, constant_values=value)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                        k_pos: jax.Array, k_valid: jax.Array,
                        segment_ids: jax.Array | None = None, *, block_q: int = BLOCK_Q,
                        block_k: int = BLOCK_K) -> jax.Array:
    """Flash-style grouped-query attention; O(T) memory in the forward and the backward.

    Same arguments and result as `dot_product_attention` (q: f[B, T, H, D]; k, v: f[B, Hkv, S, D];
    q_pos: i32[B, T]; k_pos: i32[B, S]; k_valid: bool[B, S]; segment_ids: optional i32[B, T] of
    packed self-attention; returns f[B, T, H, D]). Per step it
    holds one f32 [B, Hkv, G, block_q, block_k] score block; blocks in which no row of the batch
    has an allowed (query, key) pair are skipped. T and S need not be multiples of the blocks.
    """
    b, t, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_k, s)
    tp, sp = -(-t // bq) * bq, -(-s // bk) * bk
    qg = q.reshape(b, t, hkv, h // hkv, d).transpose(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    q_seg = k_seg = None
    if segment_ids is not None:  # the padding's keys are invalid anyway
        q_seg, k_seg = _pad_to(segment_ids, tp, 1, -1), _pad_to(segment_ids, sp, 1, -1)
    out = _flash(_pad_to(qg, tp, 3, 0), _pad_to(k.astype(q.dtype), sp, 2, 0),
                 _pad_to(v.astype(q.dtype), sp, 2, 0), _pad_to(q_pos, tp, 1, _INT_MIN),
                 _pad_to(k_pos, sp, 1, _INT_MAX), _pad_to(k_valid, sp, 1, False), q_seg, k_seg,
                 bq, bk)
    return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


# ---------------------------------------------------------------------------------------- cuDNN
def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                    k_pos: jax.Array, k_valid: jax.Array,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """`jax.nn.dot_product_attention` on cuDNN (flash attention; GPU, bf16/fp16 inputs only).

    Same contract as `dot_product_attention`. The position rule is passed as a boolean mask
    bool[B, 1, T, S] (1 byte per (query, key) pair, shared by all heads): cuDNN's sequence-length
    arguments describe right padding only, and our sequences are left-padded. Packed rows' segment
    ids go into the same mask.
    """
    if not targets.compiler_installed("gpu"):
        raise ValueError("ModelConfig.attention='cudnn' needs a GPU: JAX's CUDA plugin is not "
                         "installed (use 'auto', 'dense' or 'blockwise')")
    mask = allowed_mask(q_pos, k_pos, k_valid, segment_ids)[:, None]

    def on_gpu(q, k, v, mask):
        return jax.nn.dot_product_attention(
            q, k.astype(q.dtype).transpose(0, 2, 1, 3), v.astype(q.dtype).transpose(0, 2, 1, 3),
            mask=mask, implementation="cudnn")

    # The platform is the one the program is lowered for (a compile-only H100 from a CPU host
    # included), not this process's default backend; lowering for any other fails there.
    return jax.lax.platform_dependent(q, k, v, mask, cuda=on_gpu)


# ----------------------------------------------------------------------------------- Pallas TPU
# Splash attention rather than the kernel's older `flash_attention`: libtpu's memory_analysis of a
# bf16 forward + backward for a TPU v5e (temp bytes, compiler prediction) puts splash at or below
# blockwise (106.6 vs 115.5 MB for B=2, T=4096, 16 query / 4 kv heads of 128; 70.2 vs 153.2 MB with
# 16 kv heads), while flash_attention, which needs kv heads repeated and keeps 128-lane softmax
# statistics, needs 268.8 MB and 167.9 MB there.
# Sequence block of the Pallas TPU kernel (forward and both backward kernels); the kernel's own
# default, and a multiple of 128 as the TPU lanes need. T is padded to a multiple of it.
PALLAS_TPU_BLOCK = 128


def _pallas_tpu_kernel(q: jax.Array, k: jax.Array, v: jax.Array, k_valid: jax.Array,
                       segment_ids: jax.Array | None, block: int, interpret: bool) -> jax.Array:
    """Splash attention (jax.experimental.pallas.ops.tpu.splash_attention) on our layouts (see
    `pallas_tpu_attention`); lowers for a TPU, or runs anywhere with interpret=True."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    b, t, h, d = q.shape
    hkv = k.shape[1]
    g = h // hkv
    tp = -(-t // block) * block
    # One multi-query kernel per (row, kv head): its G query heads share the kv head, so kv is
    # never repeated. Causal by index; only blocks on or below the diagonal are computed.
    mask = sm.MultiHeadMask([sm.CausalMask((tp, tp)) for _ in range(g)])
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                          block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                          block_q_dq=block, block_kv_dq=block)
    kernel = sk.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)
    # Segment 1 = real token, 0 = pad (and the tail padding to a block multiple): a real query
    # sees only real keys; a pad query sees the pads up to itself, so no row is empty. Packed
    # rows: segment s + 1 for the real tokens of segment s.
    seg = k_valid.astype(jnp.int32)
    if segment_ids is not None:
        seg = jnp.where(k_valid, segment_ids + 1, 0)
    seg = _pad_to(seg, tp, 1, 0)
    qg = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4) * (1.0 / math.sqrt(d))
    qg = _pad_to(qg.astype(q.dtype), tp, 3, 0)  # [B, Hkv, G, Tp, D]
    k, v = _pad_to(k.astype(q.dtype), tp, 2, 0), _pad_to(v.astype(q.dtype), tp, 2, 0)

    def one(q_i, k_i, v_i, seg_i):  # [G, Tp, D], [Tp, D], [Tp, D], [Tp]
        return kernel(q_i, k_i, v_i, segment_ids=sk.SegmentIds(q=seg_i, kv=seg_i))

    per_head = jax.vmap(one, in_axes=(0, 0, 0, None))
    out = jax.vmap(per_head)(qg, k, v, seg)  # [B, Hkv, G, Tp, D]
    return out[:, :, :, :t].transpose(0, 3, 1, 2, 4).reshape(b, t, h, d)


def pallas_tpu_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
                         k_pos: jax.Array, k_valid: jax.Array,
                         segment_ids: jax.Array | None = None, *, interpret: bool = False,
                         block: int = PALLAS_TPU_BLOCK) -> jax.Array:
    """JAX's Pallas TPU splash attention (O(T) memory forward and backward); TPU only.

    Same arguments and result as `dot_product_attention`, but valid only for *self-attention over
    one in-order sequence*: S == T, the keys are the queries' own tokens (k_valid is also the
    query mask), and along each row the valid tokens' positions strictly increase with the index.
    Then `k_pos[s] <= q_pos[t]` equals `s <= t` for valid tokens, and the kernel's causal-by-index
    mask with padding as segment ids is exactly the position rule. The learner's sequences meet it
    (`positions_from_mask`: positions are the count of real tokens before, for any pad pattern);
    a KV cache does not. Packed rows (segment ids i32[B, T] >= 0, each segment contiguous and in
    order) meet it per segment: the kernel's segment ids are those + 1 (0 for pads). q_pos and
    k_pos are not read.

    With bf16 inputs, lower it under jax_default_matmul_precision 'default' (not 'highest'):
    Mosaic rejects fp32-pass matmuls on bf16 operands ("Bad lhs type").

    interpret=True runs the kernel in Pallas interpret mode, without the platform dispatch, on any
    backend (tests). Otherwise it lowers only for a TPU: the platform the program is lowered for,
    not this process's default backend.
    """
    del q_pos, k_pos
    if q.shape[1] != k.shape[2]:
        raise ValueError(f"attention='pallas_tpu' needs self-attention (T == S); got T = "
                         f"{q.shape[1]} queries and S = {k.shape[2]} keys")
    kernel = functools.partial(_pallas_tpu_kernel, block=block, interpret=interpret)
    if interpret:
        return kernel(q, k, v, k_valid, segment_ids)
    return jax.lax.platform_dependent(q, k, v, k_valid, segment_ids, tpu=kernel)


# ----------------------------------------------------------------------------------- dispatcher
def resolve_implementation(implementation: Implementation | str, num_queries: int,
                           num_keys: int) -> Implementation:
    """The concrete implementation `attention` runs for T = num_queries and S = num_keys on a
    platform."""
    impl = Implementation(implementation)
    if impl is not Implementation.AUTO:
        return impl
    if num_queries > 1 and num_keys > AUTO_BLOCKWISE_MIN_KEYS:
        return Implementation.BLOCKWISE
    return Implementation.DENSE


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              k_valid: jax.Array, implementation: Implementation | str = "auto", *,
              causal_by_index: bool = False, segment_ids: jax.Array | None = None) -> jax.Array:
    """Grouped-query attention by the chosen implementation (see `Implementation`).

    q: f[B, T, H, D]; k, v: f[B, Hkv, S, D]; q_pos: i32[B, T]; k_pos: i32[B, S];
    k_valid: bool[B, S]. Returns f[B, T, H, D] in q's dtype.

    causal_by_index: the caller guarantees the condition of `pallas_tpu_attention` (in-order
    self-attention); without it `pallas_tpu` runs as `auto`. `auto` never picks the TPU
    kernel: on a sharded learner XLA refuses to partition it ("Mosaic kernels cannot be
    automatically partitioned"), so it waits for a shard_map wrapper over the batch axes.

    segment_ids: optional i32[B, T] of packed rows (self-attention, S == T; see the module doc),
    or `PackedSegments` of rows with shared prompts (dense only).
    """
    impl = resolve_implementation(implementation, q.shape[1], k.shape[2])
    if impl is Implementation.PALLAS_TPU and not causal_by_index:
        # With a KV cache (prefill, decode) the kernel's causal-by-index rule does not hold.
        impl = resolve_implementation(Implementation.AUTO, q.shape[1], k.shape[2])
    fn = {Implementation.DENSE: dot_product_attention,
          Implementation.BLOCKWISE: blockwise_attention,
          Implementation.CUDNN: cudnn_attention,
          Implementation.PALLAS_TPU: pallas_tpu_attention}[impl]
    if segment_ids is None:
        return fn(q, k, v, q_pos, k_pos, k_valid)
    if isinstance(segment_ids, PackedSegments) and fn is not dot_product_attention:
        raise ValueError(f"attention: shared prompts (train.share_prompts) take dense attention "
                         f"only; the {impl.value} implementation was chosen for {k.shape[2]} "
                         f"keys (dense up to {AUTO_BLOCKWISE_MIN_KEYS}: a shorter "
                         f"train.pack_length)")
    if q.shape[1] != k.shape[2]:
        raise ValueError(f"attention: segment ids need self-attention (T == S); got T = "
                         f"{q.shape[1]} queries and S = {k.shape[2]} keys")
    return fn(q, k, v, q_pos, k_pos, k_valid, segment_ids)
