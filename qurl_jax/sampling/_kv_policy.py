"""Sparse-RL's KV-cache compression policies (StreamingLLM, SnapKV, R-KV) as pure functions.

Sparse-RL samples rollouts with a compressed KV history: the prompt is never compressed at
prefill; during decoding, every `interval` steps, each row whose logical length exceeds `budget`
keeps `budget` of its cached tokens and evicts the rest (`needs_compression` counts slots in use
instead, which agrees on caches without left pads; see there). Everything here works on a
static-shape, per-row cache and is jit-compatible (no data-dependent shapes; `lax.top_k` with a
static k):

    keys, values  f[R, Hkv, S, D]  per layer, post-RoPE keys (never re-rotated)
    pos           i32[R, S]        logical position of each slot, -1 = empty or left pad
    n_used        i32[R]           slots in use; valid slots lie in [0, n_used), ascending pos
    win_q         f[R, H, W, D]    per layer, the last W post-RoPE queries, oldest first
    win_valid     bool[R, W]       False for window entries that hold no real query

H = G * Hkv query heads; query head h belongs to KV head h // G (the model's grouping). A slot is
*valid* when it lies in [0, n_used) and has pos >= 0. The *window* is the last `window` valid slots
(always kept); the *candidates* are the other valid slots. Because valid slots sit in position
order, slot order is position order, and selecting slots is selecting positions.

The scores follow the code Sparse-RL trains with (its SGLang fork's `r1kv_utils.KVCluster`,
configured with max-reduced GQA logits and max-pooling), for one row and one KV head:

- SnapKV: z = Q_win . K / sqrt(D), max over the G query heads of the group (before the softmax);
  softmax in float32 over the candidates only (window keys take no probability mass); mean over
  the valid window queries -> a[j]; max-pool over j (kernel `pool_kernel`, stride 1, same padding)
  -> A[j]. Score A.
- R-KV: additionally a key redundancy R over all valid keys (candidates and window): unit keys,
  cosine matrix C with zero diagonal; in each row i the newest j with C[i, j] > threshold has
  C[i, j] set to 0 (so the newest of a group of near-duplicates counts as less redundant); the
  reference falls back to the oldest key when a row has no such j, and so do we (it only matters
  when that cosine is not 0); R'[j] = sum_i C[i, j] / L over the L valid keys; R = softmax of R'
  over the L valid keys. Score alpha * A - (1 - alpha) * R.
- Both sum the score over KV heads (one kept set for all heads, which keeps GQA's memory saving),
  keep the top budget - window candidates and the window, in slot order.
- StreamingLLM: the first `sinks` valid slots and the last budget - sinks.

Pooling runs over slot order with non-candidate slots at 0. The attention probabilities are >= 0,
so a zero neighbour never wins a max that includes the centre candidate: on the cache layout above
(left pads, then contiguous candidates, then the window, then empty slots) this is exactly the
reference's max-pool over the candidate list with -inf padding at both ends.

Scoring materialises f32[R, Hkv, S, S] cosines (R-KV; 800 MiB for 256 rows, 2 KV heads and
S = 640) and f32[R, Hkv, G, W, S] logits per scored layer; the decode loop pays it once per
interval under `lax.cond`.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import numbers
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax

from qurl_jax.models.kv_quant import dequantize_kv
from qurl_jax.runtime.enums import coerce_enum_fields

# The reference normalises keys by (norm + 1e-8), so an all-zero key has cosine 0 with everything.
_NORM_EPS = 1e-8


class KVPolicy(enum.StrEnum):
    """Which tokens a compressed cache keeps (see the module docstring for the scores)."""

    DENSE = "dense"
    STREAMING = "streaming"
    SNAPKV = "snapkv"
    RKV = "rkv"


class Selection(enum.StrEnum):
    """SHARED: layer 0's kept slots are applied to every layer (what Sparse-RL does in effect: its
    retained set is keyed by request). PER_LAYER: each layer scores with its own window queries."""

    SHARED = "shared"
    PER_LAYER = "per_layer"


_ENUM_FIELDS = {"policy": KVPolicy, "selection": Selection}


def _int(x: object) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _finite(x: object) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass(frozen=True)
class KVPolicyConfig:
    """Settings of the KV compression; frozen and hashable, so it can be a static jit argument.

    Strings are accepted for the enum fields; the config validates itself on construction, raising
    ValueError that names the field, so bad settings fail before anything compiles. Defaults are
    Sparse-RL's training settings.

    Attributes:
      policy: DENSE (no compression), STREAMING, SNAPKV or RKV.
      budget: B, the number of tokens kept after a compression.
      interval: I, compress every I decode steps (rows with more than B slots in use only).
      window: W, the observation window: the last W queries score the cache, and the last W
        tokens are always kept.
      pool_kernel: max-pool kernel over token scores (odd; 1 = no pooling).
      rkv_alpha: R-KV's mix: alpha * attention - (1 - alpha) * redundancy, alpha in [0, 1].
      sinks: StreamingLLM's attention sinks: the first `sinks` tokens are always kept.
      redundancy_threshold: R-KV's cosine threshold in [0, 1) above which two keys are
        near-duplicates.
      selection: SHARED (layer 0's choice for all layers, as Sparse-RL) or PER_LAYER.
    """

    policy: KVPolicy = KVPolicy.DENSE
    budget: int = 512
    interval: int = 128
    window: int = 8
    pool_kernel: int = 7
    rkv_alpha: float = 0.1
    sinks: int = 4
    redundancy_threshold: float = 0.5
    selection: Selection = Selection.SHARED

    def __post_init__(self) -> None:
        coerce_enum_fields(self, _ENUM_FIELDS)
        self.validate()

    def validate(self) -> KVPolicyConfig:
        """Checks every field; raises ValueError naming the first bad one. Returns self."""

        def fail(field: str, message: str) -> None:
            raise ValueError(f"KVPolicyConfig.{field}: {message}, got {getattr(self, field)!r}")

        for name, kind in _ENUM_FIELDS.items():
            if not isinstance(getattr(self, name), kind):
                fail(name, f"must be a {kind.__name__}")
        for name in ("budget", "interval", "window", "pool_kernel"):
            if not _int(getattr(self, name)) or getattr(self, name) < 1:
                fail(name, "must be an integer >= 1")
        if self.pool_kernel % 2 == 0:
            fail("pool_kernel", "must be odd (same padding centres the kernel on each token)")
        if not _int(self.sinks) or self.sinks < 0:
            fail("sinks", "must be an integer >= 0")
        if not _finite(self.rkv_alpha) or not 0.0 <= self.rkv_alpha <= 1.0:
            fail("rkv_alpha", "must be in [0, 1]")
        if not _finite(self.redundancy_threshold) or not 0.0 <= self.redundancy_threshold < 1.0:
            fail("redundancy_threshold", "must be in [0, 1)")
        if self.policy is KVPolicy.STREAMING and self.budget < self.sinks + self.window:
            fail("budget", f"must be >= sinks + window = {self.sinks + self.window} for "
                           "streaming")
        if self.policy in (KVPolicy.SNAPKV, KVPolicy.RKV) and self.budget <= self.window:
            fail("budget", f"must be > window = {self.window} (at least one scored token is kept)")
        return self

    @property
    def compresses(self) -> bool:
        """Whether the cache is ever compressed (every policy but DENSE)."""
        return self.policy is not KVPolicy.DENSE

    def physical_slots(self, prompt_bucket: int, gen_bucket: int) -> int:
        """Cache slots per row that a rollout of prompt_bucket + gen_bucket tokens needs.

        Dense: prompt_bucket + gen_bucket. Compressed: a row never holds more than `budget` slots
        when decoding starts (the sampler compresses a prompt longer than the budget right after
        prefill; see `Sampler`), compression runs on decode steps that are multiples of
        `interval`, after the step's token is written, on every row with more than `budget` slots
        in use (see `needs_compression`), and leaves at most `budget`, which then grow by one per
        step. So at most budget + interval slots are ever in use (never more than the dense
        count, which bounds short rollouts).
        """
        for name, value in (("prompt_bucket", prompt_bucket), ("gen_bucket", gen_bucket)):
            if not _int(value) or value < 1:
                raise ValueError(f"physical_slots: {name} must be an integer >= 1, got {value!r}")
        dense = prompt_bucket + gen_bucket
        if not self.compresses:
            return dense
        return min(dense, self.budget + self.interval)


def needs_compression(cfg: KVPolicyConfig, step: jax.Array | int,
                      n_used: jax.Array) -> jax.Array:
    """bool[R]: rows to compress at decode step `step`.

    step: the batch's decode step counter, counting from 1 at the first decode step (as Sparse-RL's
    scheduler does), so the first compression comes after `interval` generated tokens; or i32[R],
    each row's own counter (the refilling sampler's rows start at different times).
    n_used: i32[R] slots in use, counting the token written at this step.

    True iff step % interval == 0 and n_used > budget. Always False for DENSE. The decode loop
    calls `compress_cache` under `lax.cond(jnp.any(needs), ...)`.

    Sparse-RL triggers on the logical length (prompt + generated tokens) instead. The two agree on
    a cache without left pads, where n_used is the logical length until the first compression
    and the number of tokens kept afterwards. With left pads, a row whose tokens still fit the
    budget but whose slots do not is selected too, and compression then only drops its pads
    (every token stays, so attention sees what Sparse-RL's would). That bounds the slots in use by
    `physical_slots`; a trigger on the logical length alone would let a short prompt in a long
    bucket grow to about prompt_bucket + budget + interval slots before its first compression.
    """
    if not cfg.compresses:
        return jnp.zeros(jnp.shape(n_used), bool)
    return (jnp.asarray(step) % cfg.interval == 0) & (n_used > cfg.budget)


def window_from_prompt(q: jax.Array, mask: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """The window-query buffer after prefill: the last `window` prompt queries of each row.

    q: f[R, T, H, D] post-RoPE prompt queries of one layer, left-padded (real tokens end at
    column T - 1); mask: bool[R, T] real-token mask. Returns (win_q f[R, H, W, D] oldest first,
    win_valid bool[R, W]); pads and the missing entries of prompts shorter than W are invalid.
    """
    t = q.shape[1]
    if t < window:
        q = jnp.pad(q, ((0, 0), (window - t, 0), (0, 0), (0, 0)))
        mask = jnp.pad(mask, ((0, 0), (window - t, 0)))
    return q[:, -window:].transpose(0, 2, 1, 3), mask[:, -window:]


def push_window(win_q: jax.Array, win_valid: jax.Array,
                q: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Appends one decode step's queries to the rolling window, dropping the oldest.

    win_q: f[R, H, W, D]; win_valid: bool[R, W]; q: f[R, H, D] this step's post-RoPE queries.
    Returns the updated (win_q, win_valid); the new entry is valid.
    """
    win_q = jnp.concatenate([win_q[:, :, 1:], q[:, :, None].astype(win_q.dtype)], axis=2)
    win_valid = jnp.concatenate([win_valid[:, 1:], jnp.ones_like(win_valid[:, :1])], axis=1)
    return win_q, win_valid


def _slot_ranks(pos: jax.Array, n_used: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """valid bool[R, S], rank i32[R, S] (index among the row's valid slots), count i32[R]."""
    valid = (jnp.arange(pos.shape[-1]) < n_used[:, None]) & (pos >= 0)
    rank = jnp.cumsum(valid, axis=-1, dtype=jnp.int32) - 1
    return valid, rank, rank[:, -1] + 1


def _masked_softmax(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `mask` (0 elsewhere; all-0 if nothing is in it)."""
    x_max = jnp.max(jnp.where(mask, x, -jnp.inf), axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(x - jnp.where(jnp.isfinite(x_max), x_max, 0.0)), 0.0)
    total = jnp.sum(e, axis=-1, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def _pooled_attention(cfg: KVPolicyConfig, keys: jax.Array, win_q: jax.Array,
                      win_valid: jax.Array, cand: jax.Array) -> jax.Array:
    """f32[R, Hkv, S]: SnapKV's A, the window's pooled attention on each candidate slot.

    keys f[R, Hkv, S, D]; win_q f[R, H, W, D]; win_valid bool[R, W]; cand bool[R, S].
    Non-candidate slots come out as the max of their candidate neighbours (ignore them).
    """
    r, hkv, s, d = keys.shape
    _, h, w, _ = win_q.shape
    q = win_q.reshape(r, hkv, h // hkv, w, d)
    z = jnp.einsum("rkgwd,rksd->rkgws", q, keys,
                   preferred_element_type=jnp.float32) / math.sqrt(d)
    # GQA: one score per KV head, the loudest of its query heads, taken on the logits.
    z = jnp.max(z, axis=2)
    p = _masked_softmax(z, cand[:, None, None, :])
    n_queries = jnp.maximum(jnp.sum(win_valid, axis=-1), 1)[:, None, None]
    a = jnp.sum(jnp.where(win_valid[:, None, :, None], p, 0.0), axis=2) / n_queries
    return lax.reduce_window(a, -jnp.inf, lax.max, (1, 1, cfg.pool_kernel), (1, 1, 1), "SAME")


def _redundancy(cfg: KVPolicyConfig, keys: jax.Array, valid: jax.Array,
                count: jax.Array) -> jax.Array:
    """f32[R, Hkv, S]: R-KV's redundancy R of each valid key (0 on invalid slots).

    keys f[R, Hkv, S, D]; valid bool[R, S]; count i32[R] valid slots per row.
    """
    s = keys.shape[2]
    k = keys.astype(jnp.float32)
    unit = k / (jnp.linalg.norm(k, axis=-1, keepdims=True) + _NORM_EPS)
    cos = jnp.einsum("rksd,rktd->rkst", unit, unit)
    slot = jnp.arange(s)
    pair = valid[:, None, :, None] & valid[:, None, None, :] & (slot[:, None] != slot[None, :])
    cos = jnp.where(pair, cos, 0.0)
    # The newest near-duplicate of each key is spared: its entry in that key's row is cleared.
    # Without one, the reference's arg-max over zeros clears the oldest key's entry instead.
    newest = jnp.max(jnp.where(cos > cfg.redundancy_threshold, slot, -1), axis=-1)
    oldest = jnp.argmax(valid, axis=-1)[:, None, None]
    cleared = jnp.where(newest >= 0, newest, oldest)
    cos = jnp.where(slot == cleared[..., None], 0.0, cos)
    mean_cos = jnp.sum(cos, axis=-2) / jnp.maximum(count, 1)[:, None, None]
    return _masked_softmax(mean_cos, valid[:, None, :])


def selection_scores(cfg: KVPolicyConfig, keys: jax.Array, pos: jax.Array, n_used: jax.Array,
                     win_q: jax.Array, win_valid: jax.Array) -> jax.Array:
    """f32[R, S]: the SnapKV or R-KV score of each candidate slot, summed over KV heads.

    keys f[R, Hkv, S, D] post-RoPE; pos i32[R, S]; n_used i32[R]; win_q f[R, H, W, D] post-RoPE,
    H a multiple of Hkv; win_valid bool[R, W]. Window, pad and empty slots get -inf. Higher is
    kept first.
    """
    if cfg.policy not in (KVPolicy.SNAPKV, KVPolicy.RKV):
        raise ValueError(f"selection_scores: policy {cfg.policy.value!r} has no token scores")
    valid, rank, count = _slot_ranks(pos, n_used)
    cand = valid & (rank < count[:, None] - cfg.window)
    score = _pooled_attention(cfg, keys, win_q, win_valid, cand)
    if cfg.policy is KVPolicy.RKV:
        score = (cfg.rkv_alpha * score
                 - (1.0 - cfg.rkv_alpha) * _redundancy(cfg, keys, valid, count))
    return jnp.where(cand, jnp.sum(score, axis=1), -jnp.inf)


def keep_slots(cfg: KVPolicyConfig, keys: jax.Array, pos: jax.Array, n_used: jax.Array,
               win_q: jax.Array, win_valid: jax.Array) -> jax.Array:
    """i32[R, budget]: the slots each row keeps, ascending (= position order).

    Shapes as in `selection_scores` (STREAMING reads only pos and n_used). The last `window` valid
    slots are always kept; pad and empty slots never are. A row with more than `budget` valid
    slots keeps exactly `budget` of them (the case Sparse-RL compresses). A row with fewer keeps
    all of them, followed by filler slots that hold no token (pos -1), which `compact` clears.
    """
    valid, rank, count = _slot_ranks(pos, n_used)
    if cfg.policy is KVPolicy.STREAMING:
        recent = rank >= count[:, None] - (cfg.budget - cfg.sinks)
        priority = (valid & ((rank < cfg.sinks) | recent)).astype(jnp.float32)
    elif cfg.policy in (KVPolicy.SNAPKV, KVPolicy.RKV):
        window = valid & (rank >= count[:, None] - cfg.window)
        scores = selection_scores(cfg, keys, pos, n_used, win_q, win_valid)
        priority = jnp.where(window, jnp.inf, scores)
    else:
        raise ValueError("keep_slots: the dense policy keeps every slot")
    slot = lax.top_k(priority, cfg.budget)[1]
    # Kept tokens in slot order first, then any fillers.
    s = pos.shape[-1]
    order = jnp.where(jnp.take_along_axis(valid, slot, axis=1), slot, slot + s)
    return (jnp.sort(order, axis=-1) % s).astype(jnp.int32)


def compact(keys: jax.Array, values: jax.Array, pos: jax.Array,
            keep: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Gathers the kept slots of one layer to the front of the cache and clears the rest.

    keys, values f[R, Hkv, S, D]; pos i32[R, S] (-1 on every slot that holds no token, as the
    layout requires); keep i32[R, budget] from `keep_slots`: the kept tokens' slots ascending,
    then fillers (slots with pos -1). Returns (keys', values', pos', n_used'): the kept tokens in
    slots [0, n_used'), every other slot zeros with pos -1; n_used' = budget unless a row kept
    fewer tokens.
    """
    s = keys.shape[2]
    budget = keep.shape[1]
    new_pos = jnp.take_along_axis(pos, keep, axis=1)
    kept = new_pos >= 0

    def gather(x: jax.Array) -> jax.Array:
        x = jnp.where(kept[:, None, :, None],
                      jnp.take_along_axis(x, keep[:, None, :, None], axis=2), 0)
        return jnp.pad(x, ((0, 0), (0, 0), (0, s - budget), (0, 0)))

    new_pos = jnp.pad(new_pos, ((0, 0), (0, s - budget)), constant_values=-1)
    return gather(keys), gather(values), new_pos, jnp.sum(kept, axis=1, dtype=jnp.int32)


def where_rows(rows: jax.Array, new: jax.Array, old: jax.Array) -> jax.Array:
    """Row r of `new` where rows[r] (bool[R]), else row r of `old` (arrays with rows on axis 0)."""
    return jnp.where(rows.reshape(rows.shape + (1,) * (old.ndim - 1)), new, old)


def compress_cache(
    cfg: KVPolicyConfig,
    keys: Sequence[jax.Array],
    values: Sequence[jax.Array],
    pos: jax.Array,
    n_used: jax.Array,
    win_q: Sequence[jax.Array],
    win_valid: jax.Array,
    needs: jax.Array,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], jax.Array, jax.Array]:
    """Compresses the rows marked in `needs` in every layer; other rows come out unchanged.

    keys, values: per layer f[R, Hkv, S, D]; pos i32[R, S] and n_used i32[R], shared by the layers;
    win_q: per layer f[R, H, W, D] (SHARED reads only win_q[0], so a one-layer buffer suffices);
    win_valid bool[R, W]; needs bool[R] (from `needs_compression`).
    Returns (keys', values', pos', n_used'); see `keep_slots` and `compact` for the rows.

    SHARED: layer 0's keys and window queries choose the slots for every layer. PER_LAYER: each
    layer chooses its own; the layers then hold different positions in the same slots [0, budget),
    and pos' records layer 0's. That is all the cache needs from pos (which slots are valid, and
    where the next token goes); positions for RoPE come from the row's logical counter.

    With S <= budget no row can exceed the budget and the cache is returned as is.
    """
    if not cfg.compresses:
        raise ValueError("compress_cache: the dense policy never compresses")
    keys, values = tuple(keys), tuple(values)
    if keys[0].shape[2] <= cfg.budget:
        return keys, values, pos, n_used
    kept = _kept_slots(cfg, lambda i: keys[i], len(keys), pos, n_used, win_q, win_valid)
    compacted = [compact(k, v, pos, keep) for k, v, keep in zip(keys, values, kept)]
    row = functools.partial(where_rows, needs)
    new_keys = tuple(row(c[0], k) for c, k in zip(compacted, keys))
    new_values = tuple(row(c[1], v) for c, v in zip(compacted, values))
    _, _, new_pos, new_n_used = compacted[0]
    return new_keys, new_values, row(new_pos, pos), row(new_n_used, n_used)


def compress_quantized_cache(
    cfg: KVPolicyConfig,
    keys: Sequence[jax.Array],
    values: Sequence[jax.Array],
    k_scales: Sequence[jax.Array],
    v_scales: Sequence[jax.Array],
    pos: jax.Array,
    n_used: jax.Array,
    win_q: Sequence[jax.Array],
    win_valid: jax.Array,
    needs: jax.Array,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...],
           tuple[jax.Array, ...], jax.Array, jax.Array]:
    """`compress_cache` of an 8-bit cache (`models.kv_quant`): keys, values are per-layer codes
    [R, Hkv, S, D] with scales f32[R, Hkv, S]. The slots are scored on the dequantized keys (the
    keys the rollout attends to, in the window queries' dtype); the kept codes and scales move
    as they are, never re-quantized. Returns (keys', values', k_scales', v_scales', pos',
    n_used')."""
    if not cfg.compresses:
        raise ValueError("compress_quantized_cache: the dense policy never compresses")
    keys, values = tuple(keys), tuple(values)
    k_scales, v_scales = tuple(k_scales), tuple(v_scales)
    if keys[0].shape[2] <= cfg.budget:
        return keys, values, k_scales, v_scales, pos, n_used
    dtype = win_q[0].dtype
    kept = _kept_slots(cfg, lambda i: dequantize_kv(keys[i], k_scales[i], dtype), len(keys),
                       pos, n_used, win_q, win_valid)
    codes = [compact(k, v, pos, keep) for k, v, keep in zip(keys, values, kept)]
    scales = [compact(ks[..., None], vs[..., None], pos, keep)
              for ks, vs, keep in zip(k_scales, v_scales, kept)]
    row = functools.partial(where_rows, needs)
    _, _, new_pos, new_n_used = codes[0]
    return (tuple(row(c[0], k) for c, k in zip(codes, keys)),
            tuple(row(c[1], v) for c, v in zip(codes, values)),
            tuple(row(c[0][..., 0], k) for c, k in zip(scales, k_scales)),
            tuple(row(c[1][..., 0], v) for c, v in zip(scales, v_scales)),
            row(new_pos, pos), row(new_n_used, n_used))


def _kept_slots(cfg: KVPolicyConfig, layer_keys: Callable[[int], jax.Array], layers: int,
                pos: jax.Array, n_used: jax.Array, win_q: Sequence[jax.Array],
                win_valid: jax.Array) -> list[jax.Array]:
    """Each layer's `keep_slots` (SHARED: layer 0's for all); layer_keys(i) gives layer i's
    keys f[R, Hkv, S, D] (only the layers that score are asked)."""
    if cfg.selection is Selection.SHARED:
        return [keep_slots(cfg, layer_keys(0), pos, n_used, win_q[0], win_valid)] * layers
    if len(win_q) != layers:
        raise ValueError(f"compress_cache: per_layer selection needs window queries for "
                         f"each of the {layers} layers, got {len(win_q)}")
    return [keep_slots(cfg, layer_keys(i), pos, n_used, q, win_valid)
            for i, q in enumerate(win_q)]
