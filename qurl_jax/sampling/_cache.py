"""KV-cache layouts: how a sampler's rows hold their past, behind one narrow interface.

A layout owns everything the programs do to a cache: its empty form, the prompt forward that
fills it (prefill), the forward of one decode step (the KV write, plus whatever the layout keeps
beside the keys and values), the compression hook, the scatter of prompt caches into row slots
(insert), gathers of rows, and the cache's sharding. The engine (`_engine.py`) calls only these
methods, so a new cache layout or attention kernel is one new class here:

- `DenseKV`: a `models.transformer.KVCache` of prompt + generation slots per row.
- `CompressedKV`: Sparse-RL's compressed cache (`kv_policy`): a `CompressedCache`, the KV cache of
  budget + interval slots per row and the observation window of recent queries that scores it.
- `PagedKV`: a `models.transformer.PagedKVCache`, one pool of fixed-size pages per layer shared
  by the rows; a row holds the pages its page-table row names. The page table is the host's
  (`_page_pool.PagedScheduler`): `with_table` hands it to a program. Prompts are prefilled into a
  dense cache and `admit` copies their real tokens into the rows' pages. Only the refilling
  sampler runs it (pages are what let it keep more rows in flight).

The cache values are pytrees (`KVCache`, `CompressedCache`) whose leaves all lead with the row
axis, so `jax.tree.map` concatenates, takes or scatters rows of either layout.

Every layout holds its keys and values at the sampler's `KVPrecision` (`models.kv_quant`): in
the compute dtype, or as 8-bit codes with a float32 scale per token and kv head, quantized once
by the model where it writes them and dequantized where they are read.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.kv_quant import KVPrecision
from qurl_jax.models.transformer import KVCache, PagedKVCache, Transformer, positions_from_mask
from qurl_jax.sampling._host import Params, RowSharding
from qurl_jax.sampling._kv_policy import (
    KVPolicyConfig,
    Selection,
    compress_cache,
    compress_quantized_cache,
    needs_compression,
    push_window,
    where_rows,
    window_from_prompt,
)


@flax.struct.dataclass
class CompressedCache:
    """A compressed policy's decode state: the KV cache and the observation window that scores it.

    cache: KVCache                       `KVPolicyConfig.physical_slots` slots per row.
    win_q: tuple of f[R, H, W, D]        post-RoPE queries of each row's last W positions, oldest
                                         first; layer 0's only (SHARED selection) or every
                                         layer's (PER_LAYER).
    win_valid: bool[R, W]                window entries that hold a real query.
    """

    cache: KVCache
    win_q: tuple[jax.Array, ...]
    win_valid: jax.Array


Cache = KVCache | CompressedCache | PagedKVCache


@dataclasses.dataclass(frozen=True)
class Paging:
    """A paged KV pool: `num_pages` pages of `page_size` tokens per pool (every layer's k and v
    pools number their pages alike), split evenly over the batch shards."""

    num_pages: int
    page_size: int = 16

    def validate(self, shards: int = 1) -> Paging:
        if self.page_size < 1 or self.num_pages < shards or self.num_pages % shards:
            raise ValueError(f"kv_pages={self.num_pages} must be a positive multiple of the "
                             f"batch shards ({shards}) and kv_page_size={self.page_size} >= 1")
        return self


class CacheLayout(Protocol):
    """What the engine asks of a cache layout (R rows, S slots per row)."""

    compresses: bool

    def slots(self, p_len: int, g_len: int) -> int:
        """S: physical slots per row for a prompt bucket and a generation bucket."""

    def prefill_slots(self, p_len: int) -> int:
        """Slots per row a prompt bucket holds after `prefill`."""

    def empty(self, rows: int, length: int) -> Cache:
        """An empty cache of `rows` rows and `length` slots (traced; for jitted programs)."""

    def empty_prompts(self, rows: int, length: int) -> Cache:
        """An empty cache of `rows` prefilled prompts of `length` slots (what `prefill` gives)."""

    def with_table(self, cache: Cache, table: jax.Array | None) -> Cache:
        """The cache with the host's page table i32[R, n] (a layout without pages: unchanged)."""

    def take(self, cache: Cache, index: jax.Array) -> Cache:
        """Rows `index` (i32[R']) of the cache, in that order (a paged cache: their page-table
        rows and lengths; the pool stays)."""

    def abstract(self, rows: int, length: int) -> Cache:
        """The empty cache as ShapeDtypeStructs with the shardings `constrain` gives it."""

    def prefill(self, model: Transformer, params: Params, tokens: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, Cache]:
        """The prompts' forward (tokens i32[P, p_len], mask bool[P, p_len]): last-position
        logits f32[P, V] and their cache of `prefill_slots(p_len)` slots."""

    def repeat(self, cache: Cache, n: int, length: int) -> Cache:
        """Each row n times (rows r*n .. r*n+n-1) in a cache of `length` slots."""

    def forward(self, model: Transformer, params: Params, tok: jax.Array, cache: Cache,
                live: jax.Array, observe: bool) -> tuple[jax.Array, Cache]:
        """One decode step: tok i32[R] through the model (logits f32[R, V]); the live rows'
        tokens are written, the others' slots stay as they were. `observe` asks a layout that
        scores its cache to record this step's queries."""

    def due(self, cache: Cache, step: jax.Array) -> jax.Array:
        """bool[R]: rows to compress after decode step `step` (i32[] or i32[R])."""

    def compress(self, cache: Cache, due: jax.Array) -> Cache:
        """The rows with due bool[R] compressed (the others unchanged)."""

    def admit(self, cache: Cache, slots: jax.Array, prompt: Cache) -> Cache:
        """Rows `prompt` (K prompt caches of `prefill_slots` slots) written into row slots
        slots i32[K] (out-of-range entries dropped)."""

    def constrain(self, cache: Cache, batch: str | None = "batch") -> Cache:
        """The cache with its rows over the batch shards (batch=None: whole on every one)."""


def cache_layout(config: ModelConfig, kv_policy: KVPolicyConfig, sharding: RowSharding,
                 paging: Paging | None = None,
                 precision: KVPrecision = KVPrecision.BF16) -> CacheLayout:
    """The layout a sampler with this KV policy (and paging, and KV precision) uses."""
    if paging is not None:
        if kv_policy.compresses:
            raise ValueError(f"rollout.kv_pages: a paged cache does not take the compressed KV "
                             f"policy {kv_policy.policy!r} (its rows have holes)")
        return PagedKV(config, kv_policy, sharding, paging.validate(sharding.batch_shards),
                       precision)
    if kv_policy.compresses:
        return CompressedKV(config, kv_policy, sharding, precision)
    return DenseKV(config, kv_policy, sharding, precision)


def take_rows(cache: Cache, index: jax.Array) -> Cache:
    """Rows `index` of a cache of any layout."""
    return jax.tree.map(lambda x: jnp.take(x, index, axis=0), cache)


def concat_rows(a: Cache, b: Cache) -> Cache:
    """The rows of a, then those of b (in a's dtypes)."""
    return jax.tree.map(lambda x, y: jnp.concatenate([x, y.astype(x.dtype)]), a, b)


def _admit_kv(cache: KVCache, slots: jax.Array, prompt: KVCache) -> KVCache:
    """Writes the K prompt caches into row slots `slots`: all of each slot's positions and
    counters, and the keys / values of the prompt's n slots only: the slots after them are empty
    by their positions, and an empty slot's stale keys and values are never read (KVCache).
    Writing all S slots made the partitioner gather K rows x S slots."""
    n = prompt.length

    def admit(buf: jax.Array, new: jax.Array) -> jax.Array:
        return buf.at[slots].set(new.astype(buf.dtype), mode="drop")

    def admit_prompt(buf: jax.Array, new: jax.Array) -> jax.Array:  # [R, Hkv, S(, D)]
        return buf.at[slots, :, :n].set(new.astype(buf.dtype), mode="drop")

    return KVCache(
        k=tuple(map(admit_prompt, cache.k, prompt.k)),
        v=tuple(map(admit_prompt, cache.v, prompt.v)),
        k_scale=tuple(map(admit_prompt, cache.k_scale, prompt.k_scale)),
        v_scale=tuple(map(admit_prompt, cache.v_scale, prompt.v_scale)),
        pos=admit(cache.pos, jnp.pad(prompt.pos, ((0, 0), (0, cache.length - n)),
                                     constant_values=-1)),
        n_used=admit(cache.n_used, prompt.n_used),
        next_pos=admit(cache.next_pos, prompt.next_pos),
    )


class DenseKV:
    """Every token of a row in its own slot: prompt bucket + generation bucket slots."""

    compresses = False

    def __init__(self, config: ModelConfig, kv_policy: KVPolicyConfig,
                 sharding: RowSharding, precision: KVPrecision = KVPrecision.BF16) -> None:
        self.config, self.kv_policy, self.sharding = config, kv_policy, sharding
        self.precision = precision

    def slots(self, p_len: int, g_len: int) -> int:
        return self.kv_policy.physical_slots(p_len, g_len)

    def prefill_slots(self, p_len: int) -> int:
        return p_len

    def empty(self, rows: int, length: int) -> KVCache:
        return KVCache.zeros(self.config, rows, length, precision=self.precision)

    def abstract(self, rows: int, length: int) -> KVCache:
        cache = jax.eval_shape(lambda: self.empty(rows, length))
        if self.sharding.mesh is None:
            return cache
        return self.sharding.with_shardings(cache, self.sharding.cache_shardings(cache))

    def empty_prompts(self, rows: int, length: int) -> KVCache:
        return self.empty(rows, length)

    def with_table(self, cache: KVCache, table: jax.Array | None) -> KVCache:
        return cache

    def take(self, cache: KVCache, index: jax.Array) -> KVCache:
        return take_rows(cache, index)

    def prefill_cache(self, tokens: jax.Array) -> KVCache:
        """The empty cache `prefill` writes the prompts tokens i32[P, p_len] into."""
        return self.sharding.cache(self.empty(*tokens.shape))

    def prefill(self, model: Transformer, params: Params, tokens: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, KVCache]:
        logits, cache = model.apply({"params": params}, tokens, positions_from_mask(mask), mask,
                                    cache=self.prefill_cache(tokens), last_only=True)
        return logits[:, 0], cache

    def repeat(self, cache: KVCache, n: int, length: int) -> KVCache:
        return self.sharding.cache(cache.repeat(n, length))

    def forward(self, model: Transformer, params: Params, tok: jax.Array, cache: KVCache,
                live: jax.Array, observe: bool) -> tuple[jax.Array, KVCache]:
        del observe
        logits, new = model.apply({"params": params}, tok[:, None], cache.next_pos[:, None],
                                  live[:, None], cache=cache)
        # A row that is not live stays where it was (its write went to an empty slot).
        return logits[:, 0], new.replace(n_used=jnp.where(live, new.n_used, cache.n_used))

    def due(self, cache: KVCache, step: jax.Array) -> jax.Array:
        return jnp.zeros(cache.n_used.shape, jnp.bool_)

    def compress(self, cache: KVCache, due: jax.Array) -> KVCache:
        return cache

    def admit(self, cache: KVCache, slots: jax.Array, prompt: KVCache) -> KVCache:
        return _admit_kv(cache, slots, prompt)

    def constrain(self, cache: KVCache, batch: str | None = "batch") -> KVCache:
        return self.sharding.cache(cache, batch)


class CompressedKV:
    """Sparse-RL's compressed cache (`KVPolicyConfig`): at most budget + interval slots per row.

    After prefill, a row with more than `budget` slots (a prompt bucket longer than the budget)
    is compressed once with its last `window` prompt queries, so decoding starts with at most
    `budget` slots. A decode step feeds the previous token through the model (attending to the
    cache as it is); steps that `observe` push their post-RoPE queries into the window, and
    `compress` compresses the rows `due` marks (`needs_compression`: at multiples of
    `interval`), under `lax.cond` so the scoring and gathers run only on the steps where some
    row is due. Positions stay logical.
    """

    compresses = True

    def __init__(self, config: ModelConfig, kv_policy: KVPolicyConfig,
                 sharding: RowSharding, precision: KVPrecision = KVPrecision.BF16) -> None:
        self.config, self.kv_policy, self.sharding = config, kv_policy, sharding
        self.dense = DenseKV(config, kv_policy, sharding, precision)  # the KV cache inside

    def slots(self, p_len: int, g_len: int) -> int:
        return self.kv_policy.physical_slots(p_len, g_len)

    def prefill_slots(self, p_len: int) -> int:
        return min(p_len, self.kv_policy.budget)

    def _scored_layers(self) -> range:
        """Layers whose queries score the cache: layer 0 (SHARED) or all (PER_LAYER)."""
        if self.kv_policy.selection is Selection.SHARED:
            return range(1)
        return range(self.config.num_layers)

    def empty(self, rows: int, length: int) -> CompressedCache:
        cfg, w = self.config, self.kv_policy.window
        q = jnp.zeros((rows, cfg.num_heads, w, cfg.head_dim), cfg.compute_dtype)
        return CompressedCache(cache=self.dense.empty(rows, length),
                               win_q=(q,) * len(self._scored_layers()),
                               win_valid=jnp.zeros((rows, w), jnp.bool_))

    def empty_prompts(self, rows: int, length: int) -> CompressedCache:
        return self.empty(rows, length)

    def with_table(self, cache: CompressedCache, table: jax.Array | None) -> CompressedCache:
        return cache

    def take(self, cache: CompressedCache, index: jax.Array) -> CompressedCache:
        return take_rows(cache, index)

    def abstract(self, rows: int, length: int) -> CompressedCache:
        s = self.sharding
        cfg, w = self.config, self.kv_policy.window
        return CompressedCache(
            cache=self.dense.abstract(rows, length),
            win_q=tuple(s.abstract_batch((rows, cfg.num_heads, w, cfg.head_dim),
                                         cfg.compute_dtype) for _ in self._scored_layers()),
            win_valid=s.abstract_batch((rows, w), jnp.bool_))

    def prefill(self, model: Transformer, params: Params, tokens: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, CompressedCache]:
        """Also fills the window with the last prompt queries; a prompt bucket longer than the
        budget is compressed to it (which also drops its left pads)."""
        kv = self.kv_policy
        (logits, cache), inter = model.apply(
            {"params": params}, tokens, positions_from_mask(mask), mask,
            cache=self.dense.prefill_cache(tokens), last_only=True, mutable=["intermediates"])
        queries = _layer_queries(inter, self._scored_layers())
        windows = [window_from_prompt(q, mask, kv.window) for q in queries]
        win_q, win_valid = tuple(w[0] for w in windows), windows[0][1]
        if tokens.shape[1] > kv.budget:
            cache = _compress(kv, cache, win_q, win_valid, cache.n_used > kv.budget)
            keep = lambda xs: tuple(x[:, :, :kv.budget] for x in xs)  # noqa: E731
            cache = cache.replace(k=keep(cache.k), v=keep(cache.v), k_scale=keep(cache.k_scale),
                                  v_scale=keep(cache.v_scale), pos=cache.pos[:, :kv.budget])
        return logits[:, 0], CompressedCache(cache, win_q, win_valid)

    def repeat(self, cache: CompressedCache, n: int, length: int) -> CompressedCache:
        rows = self.sharding.rows
        return CompressedCache(
            cache=self.dense.repeat(cache.cache, n, length),
            win_q=tuple(rows(jnp.repeat(q, n, axis=0)) for q in cache.win_q),
            win_valid=rows(jnp.repeat(cache.win_valid, n, axis=0)))

    def forward(self, model: Transformer, params: Params, tok: jax.Array,
                cache: CompressedCache, live: jax.Array, observe: bool
                ) -> tuple[jax.Array, CompressedCache]:
        """With `observe`, the live rows also push this step's queries into their windows."""
        if not observe:
            logits, kv = self.dense.forward(model, params, tok, cache.cache, live, False)
            return logits, cache.replace(cache=kv)
        kv = cache.cache
        (logits, new), inter = model.apply(
            {"params": params}, tok[:, None], kv.next_pos[:, None], live[:, None], cache=kv,
            mutable=["intermediates"])
        new = new.replace(n_used=jnp.where(live, new.n_used, kv.n_used))
        queries = _layer_queries(inter, self._scored_layers())
        pushed = [push_window(w, cache.win_valid, q[:, 0])
                  for w, q in zip(cache.win_q, queries, strict=True)]
        win_q = tuple(where_rows(live, p[0], old) for p, old in zip(pushed, cache.win_q,
                                                                    strict=True))
        win_valid = where_rows(live, pushed[0][1], cache.win_valid)
        return logits[:, 0], CompressedCache(new, win_q, win_valid)

    def due(self, cache: CompressedCache, step: jax.Array) -> jax.Array:
        return needs_compression(self.kv_policy, step, cache.cache.n_used)

    def compress(self, cache: CompressedCache, due: jax.Array) -> CompressedCache:
        kv = self.kv_policy

        def run(c: KVCache) -> KVCache:
            return self.sharding.cache(_compress(kv, c, cache.win_q, cache.win_valid, due))

        return cache.replace(cache=jax.lax.cond(jnp.any(due), run, lambda c: c, cache.cache))

    def admit(self, cache: CompressedCache, slots: jax.Array, prompt: CompressedCache
              ) -> CompressedCache:
        def put(buf: jax.Array, new: jax.Array) -> jax.Array:
            return buf.at[slots].set(new.astype(buf.dtype), mode="drop")

        return CompressedCache(cache=_admit_kv(cache.cache, slots, prompt.cache),
                               win_q=tuple(map(put, cache.win_q, prompt.win_q)),
                               win_valid=put(cache.win_valid, prompt.win_valid))

    def constrain(self, cache: CompressedCache, batch: str | None = "batch") -> CompressedCache:
        s = self.sharding
        if batch is None:
            q = lambda x: s.constrain(x, (None, "heads", None, "head_dim"))  # noqa: E731
            valid = lambda x: s.constrain(x, (None, None))  # noqa: E731
        else:
            q = valid = s.rows
        return CompressedCache(cache=s.cache(cache.cache, batch),
                               win_q=tuple(map(q, cache.win_q)), win_valid=valid(cache.win_valid))


class PagedKV:
    """Every token of a row in the pages of one pool the host's page table gives it.

    A row's cache is its logical slots [0, n_used): its real prompt tokens (no pads: `admit`
    copies them out of the left-padded prefill), then one slot per token fed. Logical slots per
    row: prompt bucket + generation bucket, as a dense row's, so a row is never cut shorter;
    what is shared is the pool's pages. Under a mesh each batch shard's rows hold pages of its
    own block of the pool (the host's page ids: shard d's are [d P/D, (d+1) P/D)), pools and
    page table sharded alike (pages and rows over the batch shards, kv heads over 'tensor').
    Prompts are prefilled into a dense `KVCache` (`DenseKV.prefill`), which also holds the
    refilling sampler's held prefills.
    """

    compresses = False

    def __init__(self, config: ModelConfig, kv_policy: KVPolicyConfig, sharding: RowSharding,
                 paging: Paging, precision: KVPrecision = KVPrecision.BF16) -> None:
        self.config, self.kv_policy, self.sharding = config, kv_policy, sharding
        self.paging, self.precision = paging, precision
        self.dense = DenseKV(config, kv_policy, sharding, precision)  # prompts, held prefills

    @property
    def page_size(self) -> int:
        return self.paging.page_size

    def slots(self, p_len: int, g_len: int) -> int:
        return self.kv_policy.physical_slots(p_len, g_len)

    def pages_per_row(self, length: int) -> int:
        return -(-length // self.page_size)

    def prefill_slots(self, p_len: int) -> int:
        return p_len

    def empty(self, rows: int, length: int) -> PagedKVCache:
        return PagedKVCache.zeros(self.config, rows, self.paging.num_pages, self.page_size,
                                  self.pages_per_row(length), precision=self.precision)

    def empty_prompts(self, rows: int, length: int) -> KVCache:
        return self.dense.empty(rows, length)

    def abstract(self, rows: int, length: int) -> PagedKVCache:
        cache = jax.eval_shape(lambda: self.empty(rows, length))
        if self.sharding.mesh is None:
            return cache
        return self.sharding.with_shardings(cache, self._shardings(cache))

    def with_table(self, cache: PagedKVCache, table: jax.Array | None) -> PagedKVCache:
        return cache.replace(page_table=table)

    def take(self, cache: PagedKVCache, index: jax.Array) -> PagedKVCache:
        return cache.replace(page_table=jnp.take(cache.page_table, index, axis=0),
                             n_used=jnp.take(cache.n_used, index, axis=0))

    def prefill(self, model: Transformer, params: Params, tokens: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, KVCache]:
        return self.dense.prefill(model, params, tokens, mask)

    def repeat(self, cache: Cache, n: int, length: int) -> Cache:
        raise ValueError("a paged cache is filled row by row (`admit`), not repeated: only the "
                         "refilling sampler runs it")

    def forward(self, model: Transformer, params: Params, tok: jax.Array, cache: PagedKVCache,
                live: jax.Array, observe: bool) -> tuple[jax.Array, PagedKVCache]:
        del observe
        logits, new = model.apply({"params": params}, tok[:, None], cache.n_used[:, None],
                                  live[:, None], cache=cache)
        return logits[:, 0], new

    def due(self, cache: PagedKVCache, step: jax.Array) -> jax.Array:
        return jnp.zeros(cache.n_used.shape, jnp.bool_)

    def compress(self, cache: PagedKVCache, due: jax.Array) -> PagedKVCache:
        return cache

    def admit(self, cache: PagedKVCache, slots: jax.Array, prompt: KVCache) -> PagedKVCache:
        """Copies each prompt's real tokens (the last next_pos[k] of its p slots: prompts are
        left-padded) into logical slots [0, next_pos[k]) of row slots[k], through the page
        table already in `cache`; one scatter per pool. Entries with slot R are dropped."""
        p, ps, num_pages = prompt.length, cache.page_size, cache.num_pages
        rows = cache.page_table.shape[0]
        lengths = prompt.next_pos  # real tokens, at positions 0 .. length - 1
        j = jnp.arange(p, dtype=jnp.int32)
        src = jnp.minimum(p - lengths[:, None] + j[None], p - 1)  # [K, p] prefill slot of j
        ok = (j[None] < lengths[:, None]) & (slots < rows)[:, None]
        table = jnp.take(cache.page_table, jnp.minimum(slots, rows - 1), axis=0)  # [K, n]
        page = jnp.where(ok, jnp.take(table, j // ps, axis=1), num_pages)  # dropped when not ok
        offset = jnp.broadcast_to(j % ps, page.shape)

        def put(pool: jax.Array, buf: jax.Array) -> jax.Array:
            # k / v [K, Hkv, p, D] into [Hkv, P, page_size, D]; scales [K, Hkv, p] alike
            index = src.reshape(src.shape[:1] + (1,) + src.shape[1:] + (1,) * (buf.ndim - 3))
            tokens = jnp.moveaxis(jnp.take_along_axis(buf, index, axis=2), 1, 0)
            return pool.at[:, page, offset].set(tokens.astype(pool.dtype), mode="drop")

        return cache.replace(k=tuple(map(put, cache.k, prompt.k)),
                             v=tuple(map(put, cache.v, prompt.v)),
                             k_scale=tuple(map(put, cache.k_scale, prompt.k_scale)),
                             v_scale=tuple(map(put, cache.v_scale, prompt.v_scale)),
                             n_used=cache.n_used.at[slots].set(lengths, mode="drop"))

    def _shardings(self, cache: PagedKVCache) -> PagedKVCache:
        named = self.sharding.named
        pool = ("kv_heads", "batch", None, "head_dim")
        return PagedKVCache(k=tuple(named(x, pool) for x in cache.k),
                            v=tuple(named(x, pool) for x in cache.v),
                            page_table=named(cache.page_table, ("batch", None)),
                            n_used=named(cache.n_used, ("batch",)),
                            k_scale=tuple(named(x, pool[:3]) for x in cache.k_scale),
                            v_scale=tuple(named(x, pool[:3]) for x in cache.v_scale))

    def constrain(self, cache: Cache, batch: str | None = "batch") -> Cache:
        """A paged cache: pages and rows over the batch shards; a dense one (prompts, held
        prefills): `DenseKV.constrain`."""
        if isinstance(cache, KVCache):
            return self.dense.constrain(cache, batch)
        if self.sharding.mesh is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self._shardings(cache))


def _compress(kv_policy: KVPolicyConfig, cache: KVCache, win_q: tuple[jax.Array, ...],
              win_valid: jax.Array, due: jax.Array) -> KVCache:
    """The cache with the rows `due` compressed (`compress_cache`; an 8-bit cache's slots scored
    on its dequantized keys and its codes and scales moved as they are)."""
    if not cache.quantized:
        keys, values, pos, n_used = compress_cache(kv_policy, cache.k, cache.v, cache.pos,
                                                   cache.n_used, win_q, win_valid, due)
        return cache.replace(k=keys, v=values, pos=pos, n_used=n_used)
    keys, values, k_scale, v_scale, pos, n_used = compress_quantized_cache(
        kv_policy, cache.k, cache.v, cache.k_scale, cache.v_scale, cache.pos, cache.n_used,
        win_q, win_valid, due)
    return cache.replace(k=keys, v=values, k_scale=k_scale, v_scale=v_scale, pos=pos,
                         n_used=n_used)


def _layer_queries(intermediates: dict[str, Any], layers: range) -> list[jax.Array]:
    """The post-RoPE queries f[R, T, H, D] that the model sowed in each of `layers`."""
    tree = intermediates["intermediates"]
    return [tree[f"layers_{i}"]["self_attn"]["queries"][0] for i in layers]
