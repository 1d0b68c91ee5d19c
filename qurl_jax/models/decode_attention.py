"""Ragged decode attention: one query position per row against a KV cache read only where live.

A decode step's attention is memory-bound, and XLA's dense path (`attention.dot_product_attention`)
reads every slot of every row on every step, used or not. The functions here read only each row's
live slots, by JAX's own Pallas kernels where the platform has one, behind one interface:

- `decode_attention`: a dense per-row cache k, v f[B, Hkv, S, D] (the model's `KVCache` layout);
  row r sees slots [starts[r], lengths[r]). GPU: `jax.experimental.pallas.ops.gpu.decode_attention`
  (split-k flash decoding over the slots before `lengths[r]`), called on the cache in place.
  CPU: the project's kernel `qurl_jax.cpu_kernels.decode_attention` (float32, AVX512). TPU: XLA
  (JAX has no dense ragged decode kernel for TPU; use the paged cache there).
- `paged_decode_attention`: a paged cache, one pool per layer k_pages, v_pages
  f[Hkv, P, page_size, D] (the layout JAX's paged kernels read) and a page table i32[B, n]; row r's
  logical slot s lives in page `page_table[r, s // page_size]` at offset `s % page_size`, and row r
  sees logical slots [0, lengths[r]). GPU: `pallas.ops.gpu.paged_attention`; TPU:
  `pallas.ops.tpu.paged_attention`; CPU: the pages gathered, then the CPU kernel (f32, AVX512)
  or XLA's dense rule.

The contract is the model's (`models.attention`): queries q f[B, H, D] with H = Hkv * G, query head
h reads kv head h // G (the grouping of `attention.group_queries`); scores are q.k / sqrt(D), no
soft cap; softmax in float32; masked slots contribute exactly 0. The caller guarantees the live
window: for the model's cache, row r's valid slots are those with `KVCache.pos >= 0`; a row whose
prompt was left-padded into slots [0, pad) passes starts[r] = pad, and lengths[r] = n_used[r] after
this step's write. A cache with holes inside the window (a compressed cache) is not expressible
here; use the model's masked path for it. Entries of a page table past a row's live pages must
still name a page of the pool (any, e.g. 0): the kernels fetch whole blocks of pages.

A row with no live slot (lengths[r] <= starts[r]) gets zeros from every implementation.

Implementations (`impl`): 'xla' (the reference: dense masked softmax over all slots), 'pallas'
(JAX's kernel for `platform`; an error where there is none), 'cpu' (the CPU kernel; dense only),
'auto' (pallas on GPU, for a dense cache when its slots are a multiple of 16, and on TPU for the
paged cache; the CPU kernel on CPU when usable; else xla). `platform` defaults to the default
backend; name it to lower for another one (a deviceless compile for H100 runs with the CPU as
default backend and platform='gpu'). `interpret=True` runs the platform's Pallas kernel in
Pallas' interpreter on the host (for tests): platform 'tpu' the TPU kernel, platform 'cpu' or
'gpu' the GPU kernel.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.models.attention import MASK_VALUE

IMPLS = ("auto", "xla", "pallas", "cpu")
# Tile candidates for the GPU kernels, largest first (the kernels' own defaults lead).
_GPU_BLOCK_K = (128, 64, 32, 16)
_GPU_K_SPLITS = (16, 8, 4, 2, 1)
_PAGES_PER_BLOCK = (8, 4, 2, 1)


def kernel_platform(platform: str | None) -> str:
    """A JAX platform as the kernels are chosen by ('cuda' and 'rocm' are 'gpu'; None: JAX's
    default backend)."""
    p = jax.default_backend() if platform is None else platform
    return "gpu" if p in ("cuda", "rocm") else p


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"decode attention: impl={impl!r}; expected one of {IMPLS}")


def _zero_empty_rows(out: jax.Array, live: jax.Array) -> jax.Array:
    """out f[B, H, D] with rows where live[b] is False set to 0."""
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))


def _xla_dense(q, k, v, starts, lengths):
    """The reference: q f[B, H, D]; k, v f[B, Hkv, S, D]; slot s of row r live iff
    starts[r] <= s < lengths[r]. Scores accumulate in f32; the probabilities are cast to v's dtype
    for the weighted sum (f32 accumulation), as in the model's dense path."""
    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, h // hkv, d)
    scores = jnp.einsum("bhgd,bhsd->bhgs", qg, k.astype(q.dtype),
                        preferred_element_type=jnp.float32) / math.sqrt(d)
    slot = jnp.arange(s, dtype=jnp.int32)
    live = (slot[None, :] >= starts[:, None]) & (slot[None, :] < lengths[:, None])  # [B, S]
    scores = jnp.where(live[:, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgs,bhsd->bhgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, h, d).astype(q.dtype)


def gpu_dense_tiles(slots: int) -> tuple[int, int]:
    """(k_splits, block_k) for `pallas.ops.gpu.decode_attention` on `slots` slots per row: the
    kernel needs slots % k_splits == 0, slots // k_splits >= 16 and a block_k >= 16 dividing it."""
    for splits in _GPU_K_SPLITS:
        if slots % splits or slots // splits < 16:
            continue
        for block_k in _GPU_BLOCK_K:
            if (slots // splits) % block_k == 0:
                return splits, block_k
    raise ValueError(f"decode_attention: a cache of {slots} slots per row has no tiling for the "
                     f"GPU kernel (needs a multiple of 16 slots)")


def _gpu_dense(q, k, v, starts, lengths, *, interpret: bool):
    """JAX's ragged GPU kernel (`pallas.ops.gpu.decode_attention`'s `attn_forward_kernel`) over
    the rows and kv heads, called on the cache in place (`gqa` would transpose the cache to [B,
    Hkv, S, D] first; ours is already in that layout), then its k_splits partial results
    combined by one kernel that also zeroes the rows with no live slot (`_combine_splits`;
    JAX's wrapper combines them with XLA launches). Returns f[B, H, D] in q's dtype."""
    from jax.experimental.pallas.ops.gpu import decode_attention as gpu_decode

    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    splits, block_k = gpu_dense_tiles(s)
    one = functools.partial(_gpu_dense_partials, kernel=gpu_decode.attn_forward_kernel,
                            sm_scale=1.0 / math.sqrt(d), block_h=16, block_k=block_k,
                            k_splits=splits, interpret=interpret)
    per_head = lambda x: jnp.broadcast_to(x[:, None], (b, hkv))  # noqa: E731
    o, denominators, maxima = jax.vmap(jax.vmap(one))(
        q.reshape(b, hkv, h // hkv, d), k.astype(q.dtype), v.astype(q.dtype),
        per_head(starts), per_head(lengths))
    return _combine_splits(o, denominators, maxima, lengths > starts, h, split_axis=2,
                           interpret=interpret)


def _gpu_dense_partials(q, k, v, start, length, *, kernel, sm_scale: float, block_h: int,
                        block_k: int, k_splits: int, interpret: bool, num_warps: int = 4,
                        num_stages: int = 2):
    """One (row, kv head)'s launch of JAX's ragged kernel, as `decode_attn_unbatched` makes it,
    without its combine: q f[G, D], k, v f[S, D], start and length i32[]. Returns each split's
    output f[k_splits, G, D] in q's dtype and its softmax denominators and maxima f32[k_splits,
    G]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    g, d = q.shape
    per_split = k.shape[0] // k_splits
    scalar = pl.BlockSpec((), lambda i, j: ())
    kv = pl.BlockSpec((None, per_split, d), lambda i, j: (j, 0, 0))
    return pl.pallas_call(
        functools.partial(kernel, sm_scale=sm_scale, block_k=min(block_k, per_split),
                          block_h=block_h, num_heads=g),
        grid=(pl.cdiv(g, block_h), k_splits),
        in_specs=[pl.BlockSpec((block_h, d), lambda i, j: (i, 0)), kv, kv, scalar, scalar],
        out_specs=[pl.BlockSpec((None, block_h, d), lambda i, j: (j, i, 0)),
                   pl.BlockSpec((None, block_h), lambda i, j: (j, i)),
                   pl.BlockSpec((None, block_h), lambda i, j: (j, i))],
        out_shape=[jax.ShapeDtypeStruct((k_splits, g, d), q.dtype),
                   jax.ShapeDtypeStruct((k_splits, g), jnp.float32),
                   jax.ShapeDtypeStruct((k_splits, g), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="mha_forward",
    )(q, k.reshape(k_splits, per_split, d), v.reshape(k_splits, per_split, d), start, length)


def _cpu_dense(q, k, v, starts, lengths):
    from qurl_jax.cpu_kernels import decode_attention as cpu_decode

    b, h, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    slot = jnp.arange(s, dtype=jnp.int32)
    live = (slot[None, :] >= starts[:, None]) & (slot[None, :] < lengths[:, None])
    out = cpu_decode.decode_attention(q.reshape(b, hkv, h // hkv, d), k, v, live,
                                      jnp.minimum(jnp.max(lengths), s))
    return out.reshape(b, h, d)


def _cpu_usable(q: jax.Array, platform: str) -> bool:
    from qurl_jax.cpu_kernels import decode_attention as cpu_decode

    return platform == "cpu" and cpu_decode.usable(q.dtype, q.shape[-1])


def _check_dense(q, k, v, starts, lengths) -> None:
    b, h, d = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d or (
            h % k.shape[1]):
        raise ValueError(f"decode_attention: needs q[B, H, D] and k, v[B, Hkv, S, D] with H a "
                         f"multiple of Hkv; got q {q.shape}, k {k.shape}, v {v.shape}")
    if lengths.shape != (b,) or starts.shape != (b,):
        raise ValueError(f"decode_attention: lengths and starts must be i32[{b}]; got "
                         f"{lengths.shape} and {starts.shape}")


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                     starts: jax.Array | None = None, *, impl: str = "auto",
                     platform: str | None = None, interpret: bool = False) -> jax.Array:
    """Attention of one query per row to the live window of a dense per-row cache.

    q: f[B, H, D]; k, v: f[B, Hkv, S, D] (H a multiple of Hkv); lengths: i32[B], row r sees slots
    [starts[r], lengths[r]) (starts defaults to 0; a length past S reads to S). Returns f[B, H, D]
    in q's dtype; zeros for a row with no live slot. See the module docstring for `impl`,
    `platform` and `interpret`.
    """
    _check_impl(impl)
    lengths = jnp.asarray(lengths, jnp.int32)
    starts = jnp.zeros_like(lengths) if starts is None else jnp.asarray(starts, jnp.int32)
    _check_dense(q, k, v, starts, lengths)
    plat = kernel_platform(platform)
    if impl == "auto":
        gpu_kernel = (plat == "gpu" or (interpret and plat == "cpu")) and k.shape[2] % 16 == 0
        impl = "pallas" if gpu_kernel else "cpu" if _cpu_usable(q, plat) else "xla"
    if impl == "xla":
        out = _xla_dense(q, k, v, starts, lengths)
    elif impl == "cpu":
        if not _cpu_usable(q, plat):
            raise ValueError(f"decode_attention: impl='cpu' needs the CPU kernel, platform cpu, "
                             f"f32 and head_dim % 16 == 0; got platform {plat!r}, {q.dtype}, "
                             f"head_dim {q.shape[-1]}")
        out = _cpu_dense(q, k, v, starts, lengths)
    elif plat == "gpu" or (interpret and plat == "cpu"):  # zeroes empty rows itself
        return _gpu_dense(q, k, v, starts, lengths, interpret=interpret)
    else:
        raise ValueError(f"decode_attention: impl='pallas' has no dense kernel on platform "
                         f"{plat!r} (GPU only; use paged_decode_attention on TPU, or impl='xla')")
    return _zero_empty_rows(out, lengths > starts)


def window_of(key_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(starts, lengths) i32[B] of the live window of key_mask bool[B, S]: the first live slot and
    one past the last; (0, 0) for a row with none. Exact only for masks without holes."""
    s = key_mask.shape[1]
    any_live = key_mask.any(axis=1)
    starts = jnp.argmax(key_mask, axis=1).astype(jnp.int32)
    lengths = (s - jnp.argmax(key_mask[:, ::-1], axis=1)).astype(jnp.int32)
    return jnp.where(any_live, starts, 0), jnp.where(any_live, lengths, 0)


def model_hook(impl: str = "auto", platform: str | None = None, interpret: bool = False):
    """`decode_attention` as the model's `DecodeAttention` hook (`Transformer(config,
    decode_attention=model_hook(...))`): (q f[B, Hkv, G, D], keys, values f[B, Hkv, S, D],
    key_mask bool[B, S], length) -> f[B, Hkv, G, D]. Each row's window is read off key_mask
    (`window_of`), so the cache's live slots must be contiguous per row (left-padded prompts and
    refilled rows are; a compressed cache with holes is not); `length` is not needed."""

    def hook(q, keys, values, key_mask, length):
        del length
        b, hkv, g, d = q.shape
        starts, lengths = window_of(key_mask)
        out = decode_attention(q.reshape(b, hkv * g, d), keys, values, lengths, starts,
                               impl=impl, platform=platform, interpret=interpret)
        return out.reshape(b, hkv, g, d)

    return hook


# ------------------------------------------------------------------------------------------ paged
def gather_pages(pages: jax.Array, page_table: jax.Array) -> jax.Array:
    """The dense view of a paged pool: pages f[Hkv, P, page_size, D], page_table i32[B, n] ->
    f[B, Hkv, n * page_size, D]; logical slot s of row r is page_table[r, s // page_size]'s
    offset s % page_size. A scale pool f32[Hkv, P, page_size] gives f32[B, Hkv, n * page_size]."""
    hkv, _, ps = pages.shape[:3]
    b, n = page_table.shape
    rows = jnp.moveaxis(pages[:, page_table], 1, 0)  # [B, Hkv, n, ps, ...]
    return rows.reshape(b, hkv, n * ps, *pages.shape[3:])


def pages_per_compute_block(pages_per_row: int, partitions: int = 1, largest: int = 8) -> int:
    """The largest block of pages (<= largest) dividing the pages of one partition of a row."""
    per_partition = pages_per_row // partitions
    return next(p for p in _PAGES_PER_BLOCK if p <= largest and per_partition % p == 0)


def gpu_paged_splits(pages_per_row: int) -> int:
    """k_splits for `pallas.ops.gpu.paged_attention`: the most partitions (<= 16) dividing
    pages_per_row."""
    return next(s for s in _GPU_K_SPLITS if pages_per_row % s == 0)


def _prescaled(q: jax.Array) -> jax.Array:
    """q / sqrt(D) in q's dtype: JAX's paged kernels take no softmax scale."""
    return (q.astype(jnp.float32) / math.sqrt(q.shape[-1])).astype(q.dtype)


def _gpu_paged(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales, *,
               interpret: bool):
    """JAX's GPU paged kernel (`pallas.ops.gpu.paged_attention`'s `paged_attention_kernel`) over
    the rows, then its k_splits partial results combined by one kernel (`_combine_splits`), which
    also zeroes the rows of length 0: JAX's wrapper combines them with four XLA launches a layer
    (a max, a rescale, a sum and a division; `bench.explain`). 8-bit pages go to the kernel as
    they are, with their scales (`k_scales_pages`): it casts a block of codes to q's dtype in
    registers and scales the logits (keys) and the probabilities (values) per token, so the pool
    is read at 1 byte per element. Returns f[B, H, D] in q's dtype."""
    from jax.experimental.pallas.ops.gpu import paged_attention as gpu_paged

    n = page_table.shape[1]
    splits = gpu_paged_splits(n)
    if k_scales is None:
        k_pages, v_pages = k_pages.astype(q.dtype), v_pages.astype(q.dtype)
    partials = functools.partial(
        _gpu_paged_partials, kernel=gpu_paged.paged_attention_kernel, block_h=16,
        pages_per_compute_block=pages_per_compute_block(n, splits), k_splits=splits,
        interpret=interpret)
    o, denominators, maxima = jax.vmap(partials, (0, None, None, 0, 0, None, None))(
        _prescaled(q), k_pages, v_pages, page_table, lengths[:, None], k_scales, v_scales)
    return _combine_splits(o, denominators, maxima, lengths > 0, q.shape[1],
                           interpret=interpret)


def _gpu_paged_partials(q, k_pages, v_pages, block_tables, length, k_scales, v_scales, *,
                        kernel, block_h: int, pages_per_compute_block: int, k_splits: int,
                        interpret: bool, num_warps: int = 8, num_stages: int = 2):
    """One row's launch of JAX's paged kernel, as `paged_attention_unbatched` makes it, without
    its combine: q f[H, D] (prescaled), the pools f[Hkv, P, page_size, D] (and 8-bit scales
    f32[Hkv, P, page_size]), block_tables i32[n], length i32[1]. Returns each split's output
    f[k_splits, Hkv, Gp, D] in q's dtype and its softmax denominators and maxima f32[k_splits,
    Hkv, Gp] (Gp: the G query heads of a kv head padded to block_h)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    h, d = q.shape
    hkv, total, page_size, _ = k_pages.shape
    per_split = block_tables.shape[0] // k_splits
    g = h // hkv
    q = q.reshape(hkv, g, d)
    if g % block_h:
        q = jnp.pad(q, ((0, 0), (0, -g % block_h), (0, 0)))
    gp = q.shape[1]
    pool = pl.BlockSpec((None, total, page_size, d), lambda i, j, s: (i, 0, 0, 0))
    scales = pl.BlockSpec((None, total, page_size), lambda i, j, s: (i, 0, 0))
    body = functools.partial(kernel, num_heads=g,
                             pages_per_compute_block=min(per_split, pages_per_compute_block),
                             mask_value=MASK_VALUE, attn_logits_soft_cap=None)
    return pl.pallas_call(
        body, grid=(hkv, gp // block_h, k_splits),
        in_specs=[pl.BlockSpec((None, block_h, d), lambda i, j, s: (i, j, 0)), pool,
                  None if k_scales is None else scales, pool,
                  None if v_scales is None else scales,
                  pl.BlockSpec((None, per_split), lambda i, j, s: (s, 0)),
                  pl.BlockSpec((1,), lambda i, j, s: (0,))],
        out_specs=[pl.BlockSpec((None, None, block_h, d), lambda i, j, s: (s, i, j, 0)),
                   pl.BlockSpec((None, None, block_h), lambda i, j, s: (s, i, j)),
                   pl.BlockSpec((None, None, block_h), lambda i, j, s: (s, i, j))],
        out_shape=[jax.ShapeDtypeStruct((k_splits, hkv, gp, d), q.dtype),
                   jax.ShapeDtypeStruct((k_splits, hkv, gp), jnp.float32),
                   jax.ShapeDtypeStruct((k_splits, hkv, gp), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_block_h_{block_h}_pages_per_compute_block_"
             f"{pages_per_compute_block}",
    )(q, k_pages, k_scales, v_pages, v_scales, block_tables.reshape(k_splits, per_split), length)


def _combine_splits(o, denominators, maxima, live, heads: int, *, interpret: bool,
                    split_axis: int = 1):
    """The flash-decoding combine of a kernel's split partial outputs, one launch: o f[B, S,
    Hkv, Gp, D] (`split_axis` 1: `_gpu_paged_partials`) or f[B, Hkv, S, Gp, D] (2:
    `_gpu_dense_partials`), their softmax denominators l and maxima m f32 (o's shape without D),
    live bool[B] -> f[B, H, D] in o's dtype, zeros for a row not live. Each output is sum_s o_s
    e^(m_s - M) / (sum_s l_s e^(m_s - M) + eps), M = max_s m_s, as JAX's wrappers compute it but
    in float32 throughout (they rescale and sum the partials in o's dtype). One program per (row,
    kv head), its G <= Gp heads written one by one (G need not be a power of two)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    b, hkv, d = o.shape[0], o.shape[3 - split_axis], o.shape[-1]
    g = heads // hkv
    eps = np.float32(jnp.finfo(jnp.float32).eps)

    def kernel(o_ref, l_ref, m_ref, live_ref, out_ref):
        row, kv = pl.program_id(0), pl.program_id(1)

        def at(j):  # (row, every split, kv head kv, query head j)
            return (row, slice(None), kv, j) if split_axis == 1 else (row, kv, slice(None), j)

        for j in range(g):
            m_j = m_ref[at(j)]  # [S]
            scale = jnp.exp(m_j - jnp.max(m_j))
            total = jnp.sum(l_ref[at(j)] * scale)
            acc = jnp.sum(o_ref[at(j)].astype(jnp.float32) * scale[:, None], axis=0)
            out = jnp.where(live_ref[row] != 0, acc / (total + eps), 0.0)
            out_ref[row, pl.ds((kv * g + j) * d, d)] = out.astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel, grid=(b, hkv), out_shape=jax.ShapeDtypeStruct((b, heads * d), o.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="split_combine")(o, denominators, maxima, live.astype(jnp.int32))
    return out.reshape(b, heads, d)


def _tpu_paged(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales, *,
               interpret: bool, megacore_mode: str | None, row_scales: bool):
    """8-bit pages with scales per token go to the kernel as
    `quantization_utils.QuantizedTensor`s, which it dequantizes per block in VMEM as codes x
    scales / 127.5 (its scales are max|x|-style, so ours, max|x| / code range, are multiplied by
    127.5). The kernel takes those scales at the pages' full shape [Hkv, P, page_size, D] (it
    broadcasts a trailing 1 itself), i.e. a materialised scale array as large as the pool: see
    docs/paged_kv.md. With `row_scales` (one scale per row and kv head, `KVScale.SEQUENCE`) the
    codes go to the kernel as plain 8-bit pages (it casts a block in VMEM) and the scales are
    applied outside it: the keys' on the query (q.(s k) = (s q).k), the values' on the output
    (sum p (s v) = s sum p v)."""
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention as tpu_paged
    from jax.experimental.pallas.ops.tpu.paged_attention.quantization_utils import (
        MAX_INT8,
        QuantizedTensor,
    )

    out_scale = None
    if k_scales is None:
        k_pages, v_pages = k_pages.astype(q.dtype), v_pages.astype(q.dtype)
    elif row_scales:
        k_row, v_row = (_per_query_head(row_scale(s, page_table), q.shape[1])
                        for s in (k_scales, v_scales))
        q = (q.astype(jnp.float32) * k_row[..., None]).astype(q.dtype)
        out_scale = v_row
    else:
        k_pages = QuantizedTensor(k_pages, (k_scales * MAX_INT8)[..., None])
        v_pages = QuantizedTensor(v_pages, (v_scales * MAX_INT8)[..., None])
    mode = pltpu.force_tpu_interpret_mode() if interpret else contextlib.nullcontext()
    with mode:
        out = tpu_paged(_prescaled(q), k_pages, v_pages, lengths,
                        page_table, mask_value=MASK_VALUE,
                        pages_per_compute_block=pages_per_compute_block(page_table.shape[1]),
                        megacore_mode=megacore_mode)
    if out_scale is None:
        return out
    return (out.astype(jnp.float32) * out_scale[..., None]).astype(out.dtype)


def row_scale(scales: jax.Array, page_table: jax.Array) -> jax.Array:
    """f32[B, Hkv]: each row's scale at its first slot (page page_table[r, 0], offset 0) of a
    scale pool f32[Hkv, P, page_size]; a row's every slot holds it with per-sequence scales."""
    return scales[:, page_table[:, 0], 0].T


def _per_query_head(per_kv_head: jax.Array, heads: int) -> jax.Array:
    """[B, Hkv] -> [B, H]: query head h takes kv head h // (H / Hkv)'s value."""
    return jnp.repeat(per_kv_head, heads // per_kv_head.shape[1], axis=1)


def _cpu_paged_int8(q, k_pages, v_pages, k_scales, v_scales, page_table, lengths):
    from qurl_jax.cpu_kernels import decode_attention as cpu_decode

    b, h, d = q.shape
    hkv = k_pages.shape[0]
    keys, values = gather_pages(k_pages, page_table), gather_pages(v_pages, page_table)
    s = keys.shape[2]
    live = jnp.arange(s, dtype=jnp.int32)[None, :] < lengths[:, None]
    out = cpu_decode.decode_attention(
        q.reshape(b, hkv, h // hkv, d), keys, values, live, jnp.minimum(jnp.max(lengths), s),
        gather_pages(k_scales, page_table), gather_pages(v_scales, page_table))
    return out.reshape(b, h, d)


def _dense_pages(pages: jax.Array, scales: jax.Array | None, page_table: jax.Array,
                 dtype) -> jax.Array:
    """The rows' pages gathered (`gather_pages`), 8-bit pages dequantized to `dtype`."""
    rows = gather_pages(pages, page_table)
    if scales is None:
        return rows
    from qurl_jax.models.kv_quant import dequantize_kv

    return dequantize_kv(rows, gather_pages(scales, page_table), dtype)


def paged_decode_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                           page_table: jax.Array, lengths: jax.Array, *,
                           k_scales: jax.Array | None = None, v_scales: jax.Array | None = None,
                           impl: str = "auto", platform: str | None = None,
                           interpret: bool = False, megacore_mode: str | None = None,
                           row_scales: bool = False) -> jax.Array:
    """Attention of one query per row to the first lengths[r] logical slots of a paged cache.

    q: f[B, H, D]; k_pages, v_pages: f[Hkv, P, page_size, D] (one layer's pool), or 8-bit codes
    (int8 / float8_e4m3fn) with k_scales, v_scales f32[Hkv, P, page_size] (`models.kv_quant`:
    value = code x scale); page_table: i32[B, n], every entry in [0, P) (entries past a row's
    live pages name any page); lengths: i32[B] in [0, n * page_size]. Returns f[B, H, D] in q's
    dtype; zeros for a row of length 0.
    `megacore_mode` is the TPU kernel's (None, 'kv_head' or 'batch'; set it only on a megacore
    chip such as v5p). `row_scales` says every slot of a row holds the same scales (per-sequence
    scales, `models.kv_quant.KVScale`): the TPU kernel then reads plain 8-bit pages, scaled
    outside it (`_tpu_paged`); the other paths read the per-slot scales as always. See the module
    docstring for `impl`, `platform` and `interpret`.
    """
    _check_impl(impl)
    b, h, d = q.shape
    lengths = jnp.asarray(lengths, jnp.int32)
    page_table = jnp.asarray(page_table, jnp.int32)
    if (k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != d
            or h % k_pages.shape[0]):
        raise ValueError(f"paged_decode_attention: needs q[B, H, D] and k_pages, v_pages"
                         f"[Hkv, P, page_size, D] with H a multiple of Hkv; got q {q.shape}, "
                         f"k_pages {k_pages.shape}, v_pages {v_pages.shape}")
    if page_table.ndim != 2 or page_table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged_decode_attention: page_table must be i32[{b}, n] and lengths "
                         f"i32[{b}]; got {page_table.shape} and {lengths.shape}")
    plat = kernel_platform(platform)
    if impl == "auto":
        impl = "pallas" if plat in ("gpu", "tpu") else "cpu" if _cpu_usable(q, plat) else "xla"
    if (k_scales is None) != (v_scales is None) or (
            k_scales is not None and k_scales.shape != k_pages.shape[:3]):
        raise ValueError(f"paged_decode_attention: 8-bit pages need k_scales and v_scales "
                         f"f32{list(k_pages.shape[:3])}; got "
                         f"{None if k_scales is None else k_scales.shape}")
    if impl == "cpu" and k_scales is not None and k_pages.dtype == jnp.int8:
        # The gathered int8 codes and scales through the CPU kernel's int8 variant.
        out = _cpu_paged_int8(q, k_pages, v_pages, k_scales, v_scales, page_table, lengths)
    elif impl in ("cpu", "xla"):  # the rows' pages gathered (dequantized): [0, max length)
        keys = _dense_pages(k_pages, k_scales, page_table, q.dtype)
        values = _dense_pages(v_pages, v_scales, page_table, q.dtype)
        if impl == "cpu":
            out = decode_attention(q, keys, values, lengths, impl="cpu", platform=plat)
        else:
            out = _xla_dense(q, keys, values, jnp.zeros_like(lengths), lengths)
    elif plat == "tpu":
        out = _tpu_paged(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales,
                         interpret=interpret, megacore_mode=megacore_mode,
                         row_scales=row_scales)
    elif plat == "gpu" or (interpret and plat == "cpu"):  # zeroes empty rows itself
        return _gpu_paged(q, k_pages, v_pages, page_table, lengths, k_scales, v_scales,
                          interpret=interpret)
    else:
        raise ValueError(f"paged_decode_attention: impl='pallas' has no kernel on platform "
                         f"{plat!r} (GPU and TPU; with interpret=True, CPU runs the GPU kernel)")
    return _zero_empty_rows(out, lengths > 0)
