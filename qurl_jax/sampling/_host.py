"""Host-side pieces both samplers share: buckets, left padding, input checks, placing host arrays
on the mesh (`RowSharding`) and assembling a `SampleOutput` from a call's output rows."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qurl_jax.models.transformer import KVCache
from qurl_jax.parallel.sharding import batch_sharding, logical_to_mesh_spec
from qurl_jax.sampling._output import SampleOutput

Params = dict[str, Any]
# A sampler's `progress(rows finished, tokens generated)`, called as rows finish.
ProgressFn = Callable[[int, int], None]

ROW_AXES = ("batch",)  # logical axes (`qurl_jax.parallel.sharding`) of a per-row vector [R]


def cache_axes(batch: str | None = "batch") -> KVCache:
    """The logical axes of a KVCache's buffers, as a KVCache of axis tuples (k / v: the axes of
    every layer's [R, Hkv, S, D] buffer; k_scale / v_scale: of an 8-bit cache's [R, Hkv, S]
    scales; pos [R, S]; n_used, next_pos [R]). batch=None: rows whole on every batch shard."""
    kv = (batch, "kv_heads", "cache_length", "head_dim")
    return KVCache(k=kv, v=kv, pos=(batch, "cache_length"), n_used=(batch,), next_pos=(batch,),
                   k_scale=kv[:3], v_scale=kv[:3])


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    out, b = [], max(1, minimum)
    while b < maximum:
        out.append(b)
        b *= 2
    out.append(maximum)
    return tuple(out)


def check_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    buckets = tuple(sorted(int(b) for b in buckets))
    if not buckets or buckets[0] < 1:
        raise ValueError(f"Sampler.{name}={buckets!r} must be a non-empty list of positive ints")
    return buckets


def bucket(value: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= value:
            return b
    raise AssertionError("value was checked against the largest bucket")


def left_pad(prompts: Sequence[Sequence[int]], width: int, rows: int, pad_id: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """(tokens i32[rows, width], mask bool[rows, width]): prompts right-aligned; rows past
    len(prompts) (batch padding for the mesh) are all padding, which marks them finished."""
    tokens = np.full((rows, width), pad_id, np.int32)
    mask = np.zeros((rows, width), np.bool_)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        mask[i, width - len(p):] = True
    return tokens, mask


def check_prompts(prompts: Sequence[Sequence[int]], n: int, vocab_size: int,
                  max_prompt_len: int) -> None:
    """Raises ValueError naming the bad prompt or `n`."""
    if len(prompts) == 0:
        raise ValueError("prompts is empty: nothing to sample")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"n={n!r}: the number of samples per prompt must be an int >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty; every prompt needs at least one token")
        if len(p) > max_prompt_len:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens, more than the KV cache's prompt capacity "
                f"{max_prompt_len} (Sampler max_prompt_len / prompt_buckets)"
            )
        if min(p) < 0 or max(p) >= vocab_size:
            raise ValueError(f"prompts[{i}] has token ids outside the vocabulary [0, "
                             f"{vocab_size})")


def check_concurrent_rows(max_concurrent_rows: int) -> int:
    """Raises ValueError unless it is an int >= 0 (0 = all rows at once)."""
    if isinstance(max_concurrent_rows, bool) or not isinstance(
            max_concurrent_rows, int | np.integer) or max_concurrent_rows < 0:
        raise ValueError(f"Sampler.max_concurrent_rows={max_concurrent_rows!r} must be an int "
                         f">= 0 (0 = all rows at once)")
    return int(max_concurrent_rows)


def assemble(out: dict[str, jax.Array], prompt_tokens: jax.Array, prompt_mask: jax.Array,
             rows: int, n: int, max_new_tokens: int, num_steps: jax.Array) -> SampleOutput:
    """The `SampleOutput` of a call's first `rows` output rows (`out`: `SampleOutput.PER_ROW`,
    batch padding and generation-bucket columns included) and its prompts (one row per prompt,
    repeated n times here). Cropping is skipped where there is nothing to crop, which keeps the
    outputs' batch sharding."""

    def crop(x: jax.Array, columns: int | None = None) -> jax.Array:
        if x.shape[0] != rows:
            x = x[:rows]
        if columns is not None and x.shape[1] != columns:
            x = x[:, :columns]
        return x

    if n > 1:
        prompt_tokens = jnp.repeat(prompt_tokens, n, axis=0)
        prompt_mask = jnp.repeat(prompt_mask, n, axis=0)
    return SampleOutput(
        **{name: crop(out[name], max_new_tokens) for name in SampleOutput.PER_TOKEN},
        lengths=crop(out["lengths"]), finish_reason=crop(out["finish_reason"]),
        prompt_tokens=crop(prompt_tokens), prompt_mask=crop(prompt_mask), num_steps=num_steps)


def assemble_local(host: dict[str, np.ndarray], prompt_tokens: np.ndarray,
                   prompt_mask: np.ndarray, n: int, max_new_tokens: int, num_steps: int
                   ) -> SampleOutput:
    """`assemble` for a process-local call: this process's rows, already host arrays of its
    real rows."""
    return SampleOutput(
        **{name: host[name][:, :max_new_tokens] for name in SampleOutput.PER_TOKEN},
        lengths=host["lengths"], finish_reason=host["finish_reason"],
        prompt_tokens=np.repeat(prompt_tokens, n, axis=0),
        prompt_mask=np.repeat(prompt_mask, n, axis=0), num_steps=np.int32(num_steps))


class RowSharding:
    """Where rows live on the mesh: rows over the batch shards ('data' x 'fsdp'), the rest by
    the logical-axis rules; every method is the identity (or a plain host-to-device copy)
    without a mesh."""

    def __init__(self, mesh: Mesh | None) -> None:
        self.mesh = mesh

    @property
    def batch_shards(self) -> int:
        if self.mesh is None:
            return 1
        return int(self.mesh.shape["data"] * self.mesh.shape["fsdp"])

    @property
    def single_device(self) -> bool:
        return self.mesh is None or self.mesh.size == 1

    def named(self, x: Any, axes: tuple[str | None, ...]) -> NamedSharding:
        return NamedSharding(self.mesh, logical_to_mesh_spec(PartitionSpec(*axes), x.shape,
                                                             self.mesh))

    def constrain(self, x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, self.named(x, axes))

    def rows(self, x: jax.Array) -> jax.Array:
        """x's leading dimension over the batch shards, the others replicated."""
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, batch_sharding(self.mesh, x.ndim))

    def replicated(self, x: jax.Array) -> jax.Array:
        if self.mesh is None:
            return x
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, PartitionSpec()))

    def cache_shardings(self, cache: KVCache, batch: str | None = "batch") -> KVCache:
        """The cache's shardings (as a KVCache of NamedShardings); a mesh is required."""
        axes = cache_axes(batch)
        return KVCache(
            k=tuple(self.named(x, axes.k) for x in cache.k),
            v=tuple(self.named(x, axes.v) for x in cache.v),
            pos=self.named(cache.pos, axes.pos), n_used=self.named(cache.n_used, axes.n_used),
            next_pos=self.named(cache.next_pos, axes.next_pos),
            k_scale=tuple(self.named(x, axes.k_scale) for x in cache.k_scale),
            v_scale=tuple(self.named(x, axes.v_scale) for x in cache.v_scale))

    def cache(self, cache: KVCache, batch: str | None = "batch") -> KVCache:
        """The cache constrained to its shardings: rows over the batch shards (or, with
        batch=None, whole on every batch shard), kv heads over 'tensor'."""
        if self.mesh is None:
            return cache
        return jax.lax.with_sharding_constraint(cache, self.cache_shardings(cache, batch))

    def with_shardings(self, abstract: Any, shardings: Any) -> Any:
        """ShapeDtypeStructs carrying `shardings` (unchanged without a mesh)."""
        if self.mesh is None:
            return abstract
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            abstract, shardings)

    def put_batch(self, x: np.ndarray) -> jax.Array:
        """A host array every process holds whole, its rows over the batch shards (also on a
        mesh spanning processes)."""
        if self.mesh is None:
            return jnp.asarray(x)
        return _from_global_host(x, batch_sharding(self.mesh, x.ndim))

    def put_replicated(self, x: np.ndarray) -> jax.Array:
        """A host array every process holds whole, replicated over the mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return _from_global_host(x, NamedSharding(self.mesh, PartitionSpec()))

    def put_local(self, x: np.ndarray, blocks: int) -> jax.Array:
        """This process's block of a global array of `blocks` equal blocks, rows over the batch
        shards (a mesh spanning processes)."""
        return jax.make_array_from_process_local_data(
            batch_sharding(self.mesh, x.ndim), x, (x.shape[0] * blocks, *x.shape[1:]))

    def abstract_batch(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        """What `put_batch` makes of a host array of this shape, abstractly."""
        sharding = None if self.mesh is None else batch_sharding(self.mesh, len(shape))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def abstract_replicated(self, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        """What `put_replicated` makes of a host array of this shape, abstractly."""
        sharding = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _from_global_host(x: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A global array from a host array every process holds whole (each process places the
    pieces its devices hold)."""
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def abstract_outputs(fn: Any, *args: Any) -> Any:
    """The outputs of jitted `fn` on `args` as `jax.ShapeDtypeStruct`s with the shardings its
    compiled program gives them."""
    shardings = fn.lower(*args).compile().output_shardings
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(fn, *args), shardings)
