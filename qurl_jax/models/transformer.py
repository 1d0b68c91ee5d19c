"""Flax (linen) decoder-only transformer for Llama, Mistral, Qwen2 and Qwen3 checkpoints.

Parameters are the plain linen `params` collection: a nested dict of float32 arrays whose module
names follow Hugging Face (`embed_tokens`, `layers_{i}/self_attn/q_proj/kernel`, ...), with every
kernel stored as [in_features, out_features]. Each parameter is declared with logical axis names
(`embed`, `heads`, `kv_heads`, `mlp`, `vocab`, ...) that `qurl_jax.parallel.sharding` maps to mesh
axes.

Every matrix product (q/k/v/o, gate/up/down and the LM head) goes through one injectable
`dot_general(lhs, rhs, dimension_numbers)` hook with the signature of `jax.lax.dot_general`. The
learner passes nothing (plain float matmuls); the rollout passes `qurl_jax.quant`'s hook together
with parameters whose kernels have been replaced by quantized tensors. The model code never changes.
On a GPU a decode step's layer may run its quantized products fused with their quantization and
epilogues instead (`fused_decode`, `quant.FusedDecode`; the same parameters and math).

Attention takes explicit per-token positions and a validity mask, so prompts can be left-padded, and
an optional `KVCache` for prefill/decode with per-row state: each row writes its new keys and values
at its own next free slot and records their logical positions, and queries attend to the cached
keys by those positions (never by slot index). A one-token step with a cache can run its attention
through an injected `decode_attention` function instead of XLA's ops (the sampler passes
`qurl_jax.cpu_kernels.decode_attention` on CPU).

A decode step can also run over a `PagedKVCache`: every layer's keys and values in one pool of
fixed-size pages shared by the rows, each row's tokens in the pages its page-table row names (a
refilling sampler gives a row pages as it grows, `qurl_jax.sampling`). Its attention is the
injected `paged_attention` (`models.decode_attention.paged_decode_attention`'s kernels), or
without one the dense path's attention over the rows' pages gathered.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from qurl_jax.models import attention as attn_lib
from qurl_jax.models import exact as exact_lib
from qurl_jax.models.config import PROJECTION, ModelConfig, Remat
from qurl_jax.models.kv_quant import (
    KVPrecision,
    dequantize_kv,
    kv_precision,
    quantize_kv,
    sequence_scales,
)
from qurl_jax.quant._qtensor import QuantizedTensor

DotGeneral = Callable[..., jax.Array]
# (activation, its logical axis names) -> the activation pinned to a sharding. The learner passes
# one built from `qurl_jax.parallel.sharding`'s rules so the partitioner keeps activations split
# over the batch (FSDP: gather weights, not activations); None leaves the partitioner free.
ShardActivation = Callable[[jax.Array, tuple[str, ...]], jax.Array]
# Logical axes of the residual stream f[B, T, E].
RESIDUAL_AXES = ("batch", "length", "embed")
# (q f[B, Hkv, G, D], keys f[B, Hkv, S, D], values, key_mask bool[B, S], length i32[]) ->
# f[B, Hkv, G, D]: attention of one query position per row to the slots of [0, length) that
# key_mask marks (every cached key is in the query's past, so no position test is needed). A
# hook whose `reads_codes` names an 8-bit cache's code dtype gets the codes and their scales
# f32[B, Hkv, S] as two more arguments (k_scale, v_scale); others get the values dequantized.
DecodeAttention = Callable[..., jax.Array]
# (q f[B, H, D], k_pages, v_pages f[Hkv, P, page_size, D], page_table i32[B, n], lengths i32[B])
# -> f[B, H, D]: attention of one query per row to its first lengths[r] logical slots
# (`models.decode_attention.paged_decode_attention`'s contract); 8-bit pages come with keyword
# arguments k_scales, v_scales f32[Hkv, P, page_size].
PagedAttention = Callable[..., jax.Array]
# (pool, page i32[B], offset i32[B], new f[B, Hkv, 1, D]) -> pool: `put_tokens`'s contract. A
# paged attention hook may carry one as its `write` attribute (the pools written per shard).
PagedScatter = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
# (scale pool f32[Hkv, P, page_size], page table i32[B, n]) -> f32[B, Hkv]: each row's scale
# (`models.decode_attention.row_scale`); a paged hook's `row_scale` runs it per batch shard.
RowScale = Callable[[jax.Array, jax.Array], jax.Array]
# A decode step's products fused into one launch each on the GPU (`quant.FusedDecode`, built by
# the sampler's engine): `applies(layer params)`, `attention_in(x, gain, eps, q/k/v Linear params)
# -> (q, k, v)`, `attention_out(attention output, o_proj params, residual x)` and `mlp(x, gain,
# eps, mlp params)`; a `DecoderLayer` whose parameters it does not take runs its own.
FusedDecode = Any
# One layer of a dense KVCache as the attention takes it (`KVCache.layer`): keys, values
# [B, Hkv, S, D] and their scales f32[B, Hkv, S] (None in the compute dtype).
DenseLayer = tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]


@flax.struct.dataclass
class KVCache:
    """Key/value cache with per-row bookkeeping: L layers, R rows, S physical slots per row.

    k, v: L-tuples of f[R, Hkv, S, D]  post-RoPE keys / values in the compute dtype, or their 8-bit
                                       codes (int8 / float8_e4m3fn, `models.kv_quant`).
    k_scale, v_scale: L-tuples of      the codes' scales, one per token and kv head; empty
      f32[R, Hkv, S]                   tuples for a cache in the compute dtype.
    pos: i32[R, S]                     logical (RoPE) position of the token in each slot; -1 marks
                                       an empty slot (never written, or a prompt's left pad).
    n_used: i32[R]                     slots in use; row r's next token goes to slot n_used[r].
    next_pos: i32[R]                   logical position of row r's next token.

    Invariants: slots [n_used[r], S) of row r are empty; inside [0, n_used[r]) the non-empty slots
    hold strictly increasing positions, all < next_pos[r]. Attention reads only `pos`: a cached
    key is visible to a query when its slot is non-empty and its position is <= the query's. An
    empty slot's keys and values are any finite numbers (zeros, or a finished row's values when
    a slot is refilled): every reader masks them out with `where`, so they contribute exactly 0.
    Nothing assumes slot s holds position s, nor that rows are aligned, so the same structure
    serves a cache whose slots hold an arbitrary ordered subset of the past (KV compression:
    gather the kept slots to the front, set n_used, keep next_pos) and one whose rows are at
    different points of their sequences (a finished row refilled with a new prompt).

    Why this k/v layout (measured on XLA:CPU, 12 layers, batch 8, 513 slots): both attention
    products read a layer's cache as a batched [S, D] matrix per (row, kv head), so slots sit next
    to head_dim; and each layer has its own buffer, because reading one layer out of a stacked
    [L, ...] buffer makes XLA copy that layer's whole cache on every decode step. Together these
    cut attention from ~25 ms to ~3 ms per decode step. Each buffer is updated in place when the
    cache is donated.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    pos: jax.Array
    n_used: jax.Array
    next_pos: jax.Array
    k_scale: tuple[jax.Array, ...] = ()
    v_scale: tuple[jax.Array, ...] = ()

    SLOT_AXIS = 2  # axis of each k / v buffer that indexes cache slots

    @classmethod
    def zeros(cls, config: ModelConfig, batch: int, length: int, dtype: Any = None,
              precision: KVPrecision | str = KVPrecision.BF16) -> KVCache:
        """An empty cache of `batch` rows and `length` slots per row; `precision` 'int8' or
        'fp8' holds 8-bit codes and their scales (`dtype` is then ignored)."""
        precision = kv_precision(precision)
        dtype = config.compute_dtype if dtype is None else dtype
        dtype = precision.storage_dtype(dtype)
        shape = (batch, config.num_kv_heads, length, config.head_dim)
        layers = range(config.num_layers)
        scales = tuple(jnp.zeros(shape[:3], jnp.float32) for _ in layers) if (
            precision.quantizes) else ()
        return cls(
            k=tuple(jnp.zeros(shape, dtype) for _ in layers),
            v=tuple(jnp.zeros(shape, dtype) for _ in layers),
            pos=jnp.full((batch, length), -1, jnp.int32),
            n_used=jnp.zeros((batch,), jnp.int32),
            next_pos=jnp.zeros((batch,), jnp.int32),
            k_scale=scales,
            v_scale=scales,
        )

    @property
    def quantized(self) -> bool:
        """Whether k / v hold 8-bit codes (with `k_scale` / `v_scale`)."""
        return bool(self.k_scale)

    def layer(self, i: int) -> tuple[jax.Array, jax.Array, jax.Array | None, jax.Array | None]:
        """Layer i's (k, v, k_scale, v_scale), the scales None in the compute dtype."""
        if self.quantized:
            return self.k[i], self.v[i], self.k_scale[i], self.v_scale[i]
        return self.k[i], self.v[i], None, None

    @property
    def length(self) -> int:
        """S, the physical slots per row."""
        return self.pos.shape[1]

    def repeat(self, n: int, length: int) -> KVCache:
        """Each row repeated n times (row r becomes rows r*n .. r*n+n-1, as GRPO samples share
        their prompt's prefill) in a cache of `length` >= S slots; the added slots are empty."""
        if length < self.length:
            raise ValueError(f"KVCache.repeat: length={length} is shorter than the cache's "
                             f"{self.length} slots")
        extra = length - self.length

        def grow(x: jax.Array) -> jax.Array:  # k / v [R, Hkv, S, D] or scales [R, Hkv, S]
            pad = [(0, 0)] * x.ndim
            pad[self.SLOT_AXIS] = (0, extra)
            return jnp.pad(jnp.repeat(x, n, axis=0), pad)

        return KVCache(
            k=tuple(map(grow, self.k)),
            v=tuple(map(grow, self.v)),
            pos=jnp.pad(jnp.repeat(self.pos, n, axis=0), ((0, 0), (0, extra)),
                        constant_values=-1),
            n_used=jnp.repeat(self.n_used, n),
            next_pos=jnp.repeat(self.next_pos, n),
            k_scale=tuple(map(grow, self.k_scale)),
            v_scale=tuple(map(grow, self.v_scale)),
        )


@flax.struct.dataclass
class PagedKVCache:
    """A decode cache of L layers' keys and values in pools of pages shared by R rows.

    k, v: L-tuples of f[Hkv, P, page_size, D]   post-RoPE keys / values, P pages per pool (the
                                               layout JAX's paged attention kernels read), or
                                               their 8-bit codes (`models.kv_quant`).
    k_scale, v_scale: L-tuples of              the codes' scales, one per token and kv head
      f32[Hkv, P, page_size]                   (the GPU kernel's `k_scales_pages`); empty
                                               tuples in the compute dtype.
    page_table: i32[R, n]                      row r's logical slot s is page page_table[r, s //
                                               page_size], offset s % page_size.
    n_used: i32[R]                             tokens row r holds: logical slots [0, n_used[r]),
                                               slot s holding position s (no pads, no holes), so
                                               row r's next token has position n_used[r].

    The cache takes one token per row per call (decode); a row whose token is masked writes
    nothing and keeps its length. Page-table entries past a row's pages may name any page
    (attention reads only [0, n_used)); the owner of the page table (the sampler's host
    scheduler) guarantees that a row's next slot lies in a page it holds and that no two rows
    hold one page.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    n_used: jax.Array
    k_scale: tuple[jax.Array, ...] = ()
    v_scale: tuple[jax.Array, ...] = ()

    @classmethod
    def zeros(cls, config: ModelConfig, rows: int, num_pages: int, page_size: int,
              pages_per_row: int, dtype: Any = None,
              precision: KVPrecision | str = KVPrecision.BF16) -> PagedKVCache:
        """An empty cache: `num_pages` zero pages per pool, every row empty; `precision` 'int8'
        or 'fp8' holds 8-bit codes and their scales."""
        precision = kv_precision(precision)
        dtype = precision.storage_dtype(config.compute_dtype if dtype is None else dtype)
        shape = (config.num_kv_heads, num_pages, page_size, config.head_dim)
        layers = range(config.num_layers)
        scales = tuple(jnp.zeros(shape[:3], jnp.float32) for _ in layers) if (
            precision.quantizes) else ()
        return cls(k=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   v=tuple(jnp.zeros(shape, dtype) for _ in layers),
                   page_table=jnp.zeros((rows, pages_per_row), jnp.int32),
                   n_used=jnp.zeros((rows,), jnp.int32), k_scale=scales, v_scale=scales)

    @property
    def quantized(self) -> bool:
        return bool(self.k_scale)

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def length(self) -> int:
        """Logical slots per row: page-table width x page size."""
        return self.page_table.shape[1] * self.page_size


@flax.struct.dataclass
class PagedLayer:
    """One layer's part of a `PagedKVCache` during a decode step: its pools (and their scale
    pools when 8-bit), the page table, the slot each row writes (its n_used) and which rows
    write (live)."""

    k: jax.Array
    v: jax.Array
    page_table: jax.Array
    write_slots: jax.Array
    live: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    def write(self, k: jax.Array, v: jax.Array, scatter: PagedScatter | None = None,
              row_scale: RowScale | None = None) -> PagedLayer:
        """The pools with each live row's key and value k, v f[B, Hkv, 1, D] at its next slot
        (one scatter per pool; rows that are not live target page P and are dropped). `scatter`
        replaces the scatter (`put_tokens`'s contract), e.g. one that runs per batch shard.
        8-bit pools get k, v quantized here, once, and their scales written alike: each token's
        own, or with per-sequence scales (`row_scale` given: `decode_attention.row_scale`'s
        contract, e.g. run per batch shard) the row's, set when its prompt was written."""
        page_size, num_pages = self.k.shape[2], self.k.shape[1]
        page = jnp.take_along_axis(self.page_table, (self.write_slots // page_size)[:, None],
                                   axis=1)[:, 0]
        page = jnp.where(self.live, page, num_pages)
        offset = self.write_slots % page_size
        put = scatter or put_tokens
        if self.k_scale is None:
            return self.replace(k=put(self.k, page, offset, k), v=put(self.v, page, offset, v))
        k_row = v_row = None
        if row_scale is not None:
            k_row, v_row = (row_scale(pool, self.page_table)[..., None]
                            for pool in (self.k_scale, self.v_scale))
        (kq, ks), (vq, vs) = (quantize_kv(k, self.k.dtype, k_row),
                              quantize_kv(v, self.v.dtype, v_row))
        return self.replace(k=put(self.k, page, offset, kq), v=put(self.v, page, offset, vq),
                            k_scale=put(self.k_scale, page, offset, ks),
                            v_scale=put(self.v_scale, page, offset, vs))

    def lengths(self) -> jax.Array:
        """i32[B]: the slots each row attends to after the write (0 for a row not live)."""
        return jnp.where(self.live, self.write_slots + 1, 0)

    def gather(self, dtype: Any) -> tuple[jax.Array, jax.Array]:
        """Every row's pages as a dense cache: keys, values f[B, Hkv, n * page_size, D] (8-bit
        pages dequantized to `dtype`)."""
        from qurl_jax.models.decode_attention import gather_pages

        keys, values = gather_pages(self.k, self.page_table), gather_pages(self.v, self.page_table)
        if self.k_scale is None:
            return keys, values
        return (dequantize_kv(keys, gather_pages(self.k_scale, self.page_table), dtype),
                dequantize_kv(values, gather_pages(self.v_scale, self.page_table), dtype))


def put_tokens(pool: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array
               ) -> jax.Array:
    """pool f[Hkv, P, page_size, D] with new[r] f[Hkv, 1, D] at (page[r], offset[r]) (or a scale
    pool f32[Hkv, P, page_size] with new f32[B, Hkv, 1]); a row whose page is P or more is
    dropped. One scatter per kv head, each writing D contiguous
    values of the row-major layout JAX's paged kernels read: a scatter of [Hkv, D] windows made
    XLA lay the pool out for it, and the TPU kernel then read a relaid-out copy of every layer's
    pools each step."""
    for h in range(pool.shape[0]):
        pool = pool.at[h, page, offset].set(new[:, h, 0].astype(pool.dtype), mode="drop")
    return pool


def write_rows(buffer: jax.Array, new: jax.Array, slots: jax.Array, axis: int) -> jax.Array:
    """Writes new[r] into buffer[r] starting at slots[r] along `axis` (an axis of the per-row
    array, i.e. of buffer[r]); one scatter. buffer: [R, ...]; new: [R, ...] with T along `axis`;
    slots: i32[R]. The caller keeps slots[r] + T within the buffer (XLA would clamp the start)."""

    def one(row: jax.Array, update: jax.Array, slot: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(row, update.astype(row.dtype), slot, axis)

    return jax.vmap(one)(buffer, new, slots)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Casts the floating-point arrays of a pytree (or one array) to `dtype`. Quantized tensors are
    pytrees whose scales must stay float32, so they (any non-dict node) pass through untouched."""

    def cast(x: Any) -> Any:
        if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating):
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree, is_leaf=lambda x: not isinstance(x, dict))


def positions_from_mask(mask: Any) -> Any:
    """i32[B, T] RoPE positions of a token mask bool[B, T]: 0 at the first real token, +1 per real
    token, pads clamped to 0 (they are never attended to). numpy in, numpy out; jax in, jax out."""
    xp = np if isinstance(mask, np.ndarray) else jnp
    return xp.maximum(xp.cumsum(mask, axis=-1, dtype=xp.int32) - 1, 0)


def rope_inv_freq(config: ModelConfig) -> jax.Array:
    """f32[D/2] RoPE inverse frequencies, with 'linear' or 'llama3' scaling applied."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = config.rope_scaling
    if rs is None or rs.rope_type == "default":
        return inv_freq
    if rs.rope_type == "linear":
        return inv_freq / rs.factor
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band between them
    # interpolated smoothly (Hugging Face `_compute_llama3_parameters`).
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotates halves (Hugging Face convention). x: [B, T, H, D]; positions: i32[B, T]."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, D/2]
    cos = jnp.cos(freqs)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(freqs)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype: Any) -> jax.Array:
    """RMSNorm over x's last axis computed in float32, gain `scale` applied in `dtype` (as Hugging
    Face does)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return scale.astype(dtype) * normed.astype(dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with its gain as a parameter; `exact`: in the fixed order (`models.exact`)."""

    eps: float
    dtype: Any
    param_dtype: Any
    axis_name: str = "norm"
    exact: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param(
            "scale", nn.with_logical_partitioning(nn.initializers.ones, (self.axis_name,)),
            (x.shape[-1],), self.param_dtype,
        )
        norm = functools.partial(rms_norm, eps=self.eps, dtype=self.dtype)
        if self.exact:
            return exact_lib.rms_norm(x, scale, self.eps, norm).astype(self.dtype)
        return norm(x, scale)


class Linear(nn.Module):
    """y = x @ kernel (+ bias) through the injected dot_general; kernel is [in, out]."""

    features: int
    axes: tuple[str, str]
    dot_general: DotGeneral
    dtype: Any
    param_dtype: Any
    use_bias: bool = False

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(nn.initializers.normal(0.02), self.axes),
            (x.shape[-1], self.features), self.param_dtype,
        )
        y = self.dot_general(
            x.astype(self.dtype), cast_floats(kernel, self.dtype), (((x.ndim - 1,), (0,)), ((), ()))
        )
        if self.use_bias:
            bias = self.param(
                "bias", nn.with_logical_partitioning(nn.initializers.zeros, (self.axes[1],)),
                (self.features,), self.param_dtype,
            )
            y = y + bias.astype(self.dtype)
        return checkpoint_name(y.astype(self.dtype), PROJECTION)


class Attention(nn.Module):
    config: ModelConfig
    dot_general: DotGeneral
    decode_attention: DecodeAttention | None = None
    paged_attention: PagedAttention | None = None

    @nn.compact
    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        mask: jax.Array,
        cache: DenseLayer | PagedLayer | None,
        cache_pos: jax.Array | None,
        write_slots: jax.Array | None,
        segment_ids: jax.Array | None = None,
        qkv: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    ) -> tuple[jax.Array, DenseLayer | PagedLayer | None]:
        """`cache` is this layer's (k, v, k_scale, v_scale) (`KVCache.layer`), or its
        `PagedLayer` (one token per row); returns it with this call's tokens. An 8-bit cache
        gets this call's keys and values quantized as they are written, and every reader, this
        call's attention included, sees them dequantized (`models.kv_quant`).

        With a dense cache, cache_pos: i32[B, S] is `KVCache.pos` already updated with this
        call's tokens, and write_slots: i32[B] the first slot each row writes (`KVCache.n_used`
        before the call). `qkv`: the projections already made (`FusedDecode.attention_in`, x
        unused); the output is then the attention's before o_proj, f[B, T, H * D]."""
        cfg = self.config
        b, t = positions.shape
        h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dt, pdt = cfg.compute_dtype, cfg.params_dtype
        exact = cfg.numerics == "exact"
        dot = products(cfg, self.dot_general)
        lin = lambda n, f, axes, bias: Linear(  # noqa: E731
            f, axes, dot, dt, pdt, use_bias=bias, name=n
        )
        bias = cfg.attention_bias
        if qkv is None:
            qkv = (lin("q_proj", h * d, ("embed", "heads"), bias)(x),
                   lin("k_proj", hkv * d, ("embed", "kv_heads"), bias)(x),
                   lin("v_proj", hkv * d, ("embed", "kv_heads"), bias)(x))
            project = lin("o_proj", cfg.hidden_size, ("heads", "embed"), False)
        else:
            project = lambda out: out  # noqa: E731
        q, k, v = (y.reshape(b, t, n, d) for y, n in zip(qkv, (h, hkv, hkv), strict=True))
        if cfg.qk_norm:
            q = RMSNorm(cfg.rms_norm_eps, dt, pdt, "head_dim", exact, name="q_norm")(q)
            k = RMSNorm(cfg.rms_norm_eps, dt, pdt, "head_dim", exact, name="k_norm")(k)
        inv_freq = rope_inv_freq(cfg)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        # The post-RoPE queries, kept only when the caller makes 'intermediates' mutable (the
        # compressed-KV sampler's observation window); otherwise this records nothing.
        self.sow("intermediates", "queries", q)

        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, Hkv, T, D]
        if isinstance(cache, PagedLayer):
            if t != 1:
                raise ValueError(f"Attention: a paged cache takes one token per row; got {t}")
            row_scale = None
            if cfg.kv_scale == "sequence":
                from qurl_jax.models.decode_attention import row_scale

                row_scale = getattr(self.paged_attention, "row_scale", row_scale)
            new_cache = cache.write(k, v, getattr(self.paged_attention, "write", None), row_scale)
            lengths = new_cache.lengths()
            if self.paged_attention is not None and not exact:
                scales = {} if new_cache.k_scale is None else dict(
                    k_scales=new_cache.k_scale, v_scales=new_cache.v_scale)
                out = self.paged_attention(q[:, 0], new_cache.k, new_cache.v,
                                           new_cache.page_table, lengths, **scales)
            else:  # the dense path's own math over the rows' pages gathered
                keys, values = new_cache.gather(dt)
                slot = jnp.arange(keys.shape[2], dtype=jnp.int32)
                out = self._attend(q, keys, values, positions,
                                   jnp.broadcast_to(slot, (b, slot.size)),
                                   slot[None, :] < lengths[:, None])
            return project(out.reshape(b, t, h * d)), new_cache
        if cache is None:
            keys, values = k, v
            q_pos, k_pos, k_valid = positions, positions, mask
            new_cache = None
        else:
            slot_axis = KVCache.SLOT_AXIS - 1  # of one row's [Hkv, S, D] or [Hkv, S] buffer
            put = lambda buf, new: write_rows(buf, new, write_slots, slot_axis)  # noqa: E731
            k_buf, v_buf, k_scale, v_scale = cache
            if k_scale is None:
                keys, values = put(k_buf, k), put(v_buf, v)
                new_cache = (keys, values, None, None)
            else:
                k_row = v_row = None
                if cfg.kv_scale == "sequence":
                    k_row, v_row = (_sequence_scale(stored, new, mask, cache_pos, write_slots,
                                                    buf.dtype)
                                    for stored, new, buf in ((k_scale, k, k_buf),
                                                             (v_scale, v, v_buf)))
                (kq, ks), (vq, vs) = (quantize_kv(k, k_buf.dtype, k_row),
                                      quantize_kv(v, v_buf.dtype, v_row))
                new_cache = (put(k_buf, kq), put(v_buf, vq), put(k_scale, ks), put(v_scale, vs))
                keys = dequantize_kv(new_cache[0], new_cache[2], dt)
                values = dequantize_kv(new_cache[1], new_cache[3], dt)
            q_pos, k_pos, k_valid = positions, cache_pos, cache_pos >= 0

        if cache is not None and t == 1 and self.decode_attention is not None and not exact:
            # Slots past a row's n_used are empty, so reading [0, max n_used) is exact. A hook
            # that reads 8-bit codes itself (`reads_codes`) gets them with their scales.
            grouped, length = attn_lib.group_queries(q, hkv), jnp.max(write_slots) + 1
            if new_cache[2] is not None and new_cache[0].dtype in getattr(
                    self.decode_attention, "reads_codes", ()):
                out = self.decode_attention(grouped, new_cache[0], new_cache[1], k_valid, length,
                                            new_cache[2], new_cache[3])
            else:
                out = self.decode_attention(grouped, keys, values, k_valid, length)
            out = attn_lib.ungroup_queries(out, t)
        else:
            out = self._attend(q, keys, values, q_pos, k_pos, k_valid, cache is None,
                               segment_ids)
        return project(out.reshape(b, t, h * d)), new_cache

    def _attend(self, q: jax.Array, keys: jax.Array, values: jax.Array, q_pos: jax.Array,
                k_pos: jax.Array, k_valid: jax.Array, causal_by_index: bool = False,
                segment_ids: jax.Array | None = None) -> jax.Array:
        """`attention.attention` by the configured implementation, or under exact numerics
        `models.exact.attention` (that implementation's gradient)."""
        cfg = self.config
        if cfg.numerics == "exact":
            return exact_lib.attention(q, keys, values, q_pos, k_pos, k_valid, cfg.attention,
                                       segment_ids)
        return attn_lib.attention(q, keys, values, q_pos, k_pos, k_valid, cfg.attention,
                                  causal_by_index=causal_by_index, segment_ids=segment_ids)


def _sequence_scale(stored: jax.Array, new: jax.Array, valid: jax.Array, cache_pos: jax.Array,
                    write_slots: jax.Array, dtype: Any) -> jax.Array:
    """f32[B, Hkv, 1]: the per-sequence scale (`kv_quant.KVScale.SEQUENCE`) this call writes a
    dense cache's row with: the one stored at the row's first token where it holds tokens from
    an earlier call (stored f32[B, Hkv, S]; cache_pos already counts this call's, which start at
    write_slots), else that of its new tokens new f[B, Hkv, T, D] where valid bool[B, T]."""
    slot = jnp.arange(cache_pos.shape[1], dtype=jnp.int32)
    before = (cache_pos >= 0) & (slot[None, :] < write_slots[:, None])
    kept = jnp.take_along_axis(stored, jnp.argmax(before, axis=1)[:, None, None], axis=2)
    return jnp.where(before.any(axis=1)[:, None, None], kept,
                     sequence_scales(new, valid, dtype))


class MLP(nn.Module):
    config: ModelConfig
    dot_general: DotGeneral

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        dt, pdt, m = cfg.compute_dtype, cfg.params_dtype, cfg.intermediate_size
        dot = products(cfg, self.dot_general)
        gate = Linear(m, ("embed", "mlp"), dot, dt, pdt, name="gate_proj")(x)
        up = Linear(m, ("embed", "mlp"), dot, dt, pdt, name="up_proj")(x)
        return Linear(cfg.hidden_size, ("mlp", "embed"), dot, dt, pdt,
                      name="down_proj")(jax.nn.silu(gate) * up)


class DecoderLayer(nn.Module):
    config: ModelConfig
    dot_general: DotGeneral
    decode_attention: DecodeAttention | None = None
    paged_attention: PagedAttention | None = None
    fused_decode: FusedDecode | None = None

    @nn.compact
    def __call__(self, x, positions, mask, cache, cache_pos, write_slots, segment_ids=None):
        cfg = self.config
        dt, pdt = cfg.compute_dtype, cfg.params_dtype
        exact = cfg.numerics == "exact"
        attention = Attention(cfg, self.dot_general, self.decode_attention,
                              self.paged_attention, name="self_attn")
        fused = self.fused_decode
        if (fused is not None and cache is not None and x.shape[1] == 1 and not exact
                and not self.is_initializing() and fused.applies(self.variables["params"])):
            # A GPU decode step: the same layer, its products one launch each (`FusedDecode`).
            p = self.variables["params"]
            qkv = fused.attention_in(x, p["input_layernorm"]["scale"], cfg.rms_norm_eps,
                                     [p["self_attn"][n] for n in ("q_proj", "k_proj", "v_proj")])
            out, new_cache = attention(None, positions, mask, cache, cache_pos, write_slots,
                                       qkv=qkv)
            x = fused.attention_out(out, p["self_attn"]["o_proj"], x)
            return fused.mlp(x, p["post_attention_layernorm"]["scale"], cfg.rms_norm_eps,
                             p["mlp"]), new_cache
        h = RMSNorm(cfg.rms_norm_eps, dt, pdt, exact=exact, name="input_layernorm")(x)
        attn, new_cache = attention(h, positions, mask, cache, cache_pos, write_slots,
                                    segment_ids)
        x = x + attn
        h = RMSNorm(cfg.rms_norm_eps, dt, pdt, exact=exact, name="post_attention_layernorm")(x)
        x = x + MLP(cfg, self.dot_general, name="mlp")(h)
        return x, new_cache


_REMAT_POLICIES = {Remat.DOTS: jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
                   Remat.PROJECTIONS: jax.checkpoint_policies.save_only_these_names(PROJECTION),
                   Remat.FULL: jax.checkpoint_policies.nothing_saveable}


class Transformer(nn.Module):
    """Decoder-only LM. `__call__` returns (float32 logits, updated cache or None).

    Args to `__call__`:
      tokens: i32[B, T] token ids (pad positions may hold any id).
      positions: i32[B, T] RoPE positions (for a left-padded prompt: 0 at the first real token).
        Without a cache, the real tokens' positions must strictly increase along each row (one
        sequence in order, as `positions_from_mask` gives): attention may then run causal by index
        (`attention.pallas_tpu_attention` on a TPU).
      mask: bool[B, T] real tokens; None means all real. Padded keys are never attended to.
      segment_ids: optional i32[B, T] (no cache): packed rows, several sequences one after another
        in a row (`qurl_jax.learner.packing`); a token attends only to its own segment, and
        `positions` restart at 0 in every segment, so each sequence computes what it would alone.
      cache: optional KVCache; row r's T new keys/values go to slots [n_used[r], n_used[r] + T)
        (the caller leaves room), recorded at their `positions` (pads as empty slots); next_pos
        moves one past the last real position. The queries attend to every cached key at or
        before their own position. For a decode step pass positions = cache.next_pos[:, None].
        Or a `PagedKVCache` (T = 1, positions = cache.n_used[:, None]): each row whose token is
        real writes it at logical slot n_used[r] and attends to its slots [0, n_used[r] + 1)
        with `paged_attention`.
      last_only: return logits for the last position only ([B, 1, V]); what prefill needs.
      return_hidden: return the final normed hidden states f[B, T, E] (compute dtype) instead of
        logits; `lm_head_logits` turns any slice of them into logits (the learner's response-only,
        chunked log-probs).

    With `mutable=["intermediates"]` in `apply`, each layer also records its post-RoPE queries
    f[B, T, H, D] as `intermediates/layers_{i}/self_attn/queries` (the compressed-KV sampler's
    observation window); without it nothing is recorded or computed.

    `remat` rematerialises each decoder layer in the backward pass (`Remat`). `scan_layers` runs
    the layers of a call without a cache as one `lax.scan` over their stacked parameters (the
    learner's option for large models): XLA compiles one layer body instead of L copies, and the
    scan orders the backward layer by layer, so remat's recomputation cannot be scheduled early
    (1.5B learner update, full remat, XLA:CPU on a loaded machine: lower + compile 239 s -> 104 s,
    temp memory 55.5 -> 9.0 GiB per device). Neither changes the parameters (still
    `layers_{i}/...`: the Hugging Face mapping, quantization and the per-layer KV cache rely on
    them) nor the results.

    `fused_decode` (the GPU samplers' decode model, `quant.FusedDecode`) runs each decode step's
    layer with its products fused into one launch each, where the layer's parameters are what it
    takes; the parameters are the same.
    """

    config: ModelConfig
    dot_general: DotGeneral = jax.lax.dot_general
    decode_attention: DecodeAttention | None = None
    paged_attention: PagedAttention | None = None
    remat: Remat | str = Remat.NONE
    shard_activation: ShardActivation | None = None
    scan_layers: bool = False
    fused_decode: FusedDecode | None = None

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        mask: jax.Array | None = None,
        cache: KVCache | PagedKVCache | None = None,
        last_only: bool = False,
        return_hidden: bool = False,
        segment_ids: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache | PagedKVCache | None]:
        cfg = self.config
        dt, pdt = cfg.compute_dtype, cfg.params_dtype
        b, t = tokens.shape
        if mask is None:
            mask = jnp.ones((b, t), jnp.bool_)
        pin = self.shard_activation or (lambda a, _: a)
        embed = Embed(cfg, name="embed_tokens")
        x = pin(embed(tokens), RESIDUAL_AXES)

        cache_pos = write_slots = None
        paged = isinstance(cache, PagedKVCache)
        if cache is not None and not paged:
            write_slots = cache.n_used
            cache_pos = write_rows(cache.pos, jnp.where(mask, positions, -1), write_slots, 0)
        if segment_ids is not None and cache is not None:
            raise ValueError("Transformer: segment_ids (packed rows) take no KV cache")
        new_kv = []
        if self.scan_layers and cache is None and not self.is_initializing():
            x = self._scanned_layers(x, positions, mask, pin, segment_ids)
        else:
            remat = Remat(self.remat)
            layer = DecoderLayer if remat is Remat.NONE else nn.remat(
                DecoderLayer, policy=_REMAT_POLICIES[remat])
            for i in range(cfg.num_layers):
                if paged:
                    kv = PagedLayer(cache.k[i], cache.v[i], cache.page_table, cache.n_used,
                                    mask[:, 0], *((cache.k_scale[i], cache.v_scale[i])
                                                  if cache.quantized else ()))
                else:
                    kv = None if cache is None else cache.layer(i)
                x, kv = layer(cfg, self.dot_general, self.decode_attention, self.paged_attention,
                              self.fused_decode, name=f"layers_{i}")(
                    x, positions, mask, kv, cache_pos, write_slots, segment_ids)
                x = pin(x, RESIDUAL_AXES)
                new_kv.append(kv)
        x = RMSNorm(cfg.rms_norm_eps, dt, pdt, exact=cfg.numerics == "exact", name="norm")(x)
        if last_only:
            x = x[:, -1:]
        dot = products(cfg, self.dot_general)
        if return_hidden:
            out = x
        elif cfg.tie_word_embeddings:
            out = embed.attend(x, dot).astype(jnp.float32)
        else:
            out = Linear(cfg.vocab_size, ("embed", "vocab"), dot, dt, pdt,
                         name="lm_head")(x).astype(jnp.float32)
        new_cache = None
        if paged:
            scales = dict(k_scale=tuple(kv.k_scale for kv in new_kv),
                          v_scale=tuple(kv.v_scale for kv in new_kv)) if cache.quantized else {}
            new_cache = cache.replace(k=tuple(kv.k for kv in new_kv),
                                      v=tuple(kv.v for kv in new_kv),
                                      n_used=cache.n_used + mask[:, 0].astype(jnp.int32),
                                      **scales)
        elif cache is not None:
            last = jnp.max(jnp.where(mask, positions + 1, 0), axis=1)
            scales = dict(k_scale=tuple(kv[2] for kv in new_kv),
                          v_scale=tuple(kv[3] for kv in new_kv)) if cache.quantized else {}
            new_cache = KVCache(k=tuple(kv[0] for kv in new_kv), v=tuple(kv[1] for kv in new_kv),
                                pos=cache_pos, n_used=cache.n_used + t,
                                next_pos=jnp.maximum(cache.next_pos, last), **scales)
        return out, new_cache

    def _scanned_layers(self, x: jax.Array, positions: jax.Array, mask: jax.Array,
                        pin: ShardActivation, segment_ids: jax.Array | None = None
                        ) -> jax.Array:
        """The decoder layers as one `lax.scan` over their parameters stacked along a new leading
        axis (in the compute dtype: the layers cast them to it anyway, so values and gradients are
        those of the unrolled loop). x: f[B, T, E] -> f[B, T, E]."""
        cfg = self.config
        per_layer = [cast_floats(self.variables["params"][f"layers_{i}"], cfg.compute_dtype)
                     for i in range(cfg.num_layers)]
        stacked = jax.tree.map(lambda *p: jnp.stack(p), *per_layer)
        layer = DecoderLayer(cfg, self.dot_general, self.decode_attention, self.paged_attention,
                             parent=None)

        def body(x: jax.Array, params: Any) -> tuple[jax.Array, None]:
            x, _ = layer.apply({"params": params}, x, positions, mask, None, None, None,
                               segment_ids)
            return pin(x, RESIDUAL_AXES), None

        remat = Remat(self.remat)
        if remat is not Remat.NONE:
            # prevent_cse=False: the scan already keeps XLA from merging the recomputation.
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[remat], prevent_cse=False)
        return jax.lax.scan(body, x, stacked)[0]


def products(config: ModelConfig, dot_general: DotGeneral) -> DotGeneral:
    """The model's product hook: `dot_general`, or under `config.numerics == 'exact'` the same
    products in the fixed order (`models.exact.products`)."""
    return exact_lib.products(dot_general) if config.numerics == "exact" else dot_general


def lm_head_logits(config: ModelConfig, params: Any, hidden: jax.Array,
                   dot_general: DotGeneral = jax.lax.dot_general) -> jax.Array:
    """f32[..., V] logits of final hidden states f[..., E] (from `return_hidden=True`).

    The same product as the model's own head (`Embed.attend` when tied, the `lm_head` Linear
    otherwise): compute dtype in and out, then float32; under exact numerics the fixed-order
    product (`products`).
    """
    dt = config.compute_dtype
    dot_general = products(config, dot_general)
    if config.tie_word_embeddings:
        weight, contract = params["embed_tokens"]["embedding"], 1  # [V, E]
    else:
        weight, contract = params["lm_head"]["kernel"], 0  # [E, V]
    logits = dot_general(hidden.astype(dt), cast_floats(weight, dt),
                         (((hidden.ndim - 1,), (contract,)), ((), ())))
    return logits.astype(dt).astype(jnp.float32)


class Embed(nn.Module):
    """Token embedding [V, E]; `attend` is the tied LM head (x @ embedding.T)."""

    config: ModelConfig

    def setup(self) -> None:
        cfg = self.config
        self.embedding = self.param(
            "embedding",
            nn.with_logical_partitioning(nn.initializers.normal(0.02), ("vocab", "embed")),
            (cfg.vocab_size, cfg.hidden_size), cfg.params_dtype,
        )

    def __call__(self, tokens: jax.Array) -> jax.Array:
        table, dt = self.embedding, self.config.compute_dtype
        if isinstance(table, QuantizedTensor):  # the rollout's int8 table, a scale per entry
            codes = jnp.take(table.qvalue, tokens, axis=0).astype(jnp.float32)
            return (codes * jnp.take(table.scale, tokens, axis=0)).astype(dt)
        return jnp.take(table, tokens, axis=0).astype(dt)

    def attend(self, x: jax.Array, dot_general: DotGeneral) -> jax.Array:
        dt = self.config.compute_dtype
        return dot_general(
            x.astype(dt), cast_floats(self.embedding, dt), (((x.ndim - 1,), (1,)), ((), ()))
        )
