"""The rollout's own layout over the learner's devices, and the once-per-step reshard into it.

The learner shards its parameters over `fsdp` (ZeRO-3). A decode step on that layout moves, every
layer of every token, either the weights or the rows' activations between the devices (the
partial sums of every int8 product and the logits of every slot, read in the compiled HLO of the
1.5B paper config: 259 collectives, 673.7 MiB per token per device). The rollout instead runs on
replicas of the quantized actor over the same devices (colocated):

    learner mesh  (data, fsdp, tensor)   float32 master, FSDP         -> learner, logp, optimizer
    rollout mesh  (data, fsdp=1, tensor) int8/fp8 replicas, rows over -> samplers
                   data = the replicas   data, heads over tensor

The rollout mesh keeps the learner mesh's axis names with `fsdp` of size 1, so `data` is the
replica axis and every sampler (static, refilling, paged, Sparse-RL's compressed caches) runs on
it unchanged: its rows, slots and page pool are split over `data x fsdp` = the replicas, the
cache's kv heads over `tensor` (`qurl_jax.sampling._host.RowSharding`). Its devices are the
learner mesh's, in the learner mesh's order (the order `jax.experimental.mesh_utils` chose for
it; a jitted program's arguments and outputs must share one device order), cut into `tensor`
consecutive devices per replica, which lie within one process.

Each step `quant.requantize` makes the codes where the float shards live, then `Reshard` - one
jitted identity whose output shardings are the rollout layout - moves the int8/fp8 codes, their
f32 scales and the (compute-dtype) leaves the recipe does not quantize to the replicas. The
float32 master is never gathered; the learner's parameters and optimizer state are not
arguments of it (nothing of theirs is donated or moved).

`rollout.tensor` picks the replicas' tensor degree: 'auto' is the smallest power of two (within
one process's devices) at which a replica's share plus the learner's resident state fits the
device (`resolve_tensor`); 1 where it fits, which is every paper config.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qurl_jax.parallel import sharding as shd
from qurl_jax.quant._qtensor import QuantizedTensor
from qurl_jax.runtime.errors import ConfigError, MeshError
from qurl_jax.runtime.sizes import tree_bytes_per_device

__all__ = ["DEFAULT_BUCKET_MIB", "Reshard", "actor_shardings", "check_concurrent_rows",
           "parse_tensor", "resolve_tensor", "rollout_mesh"]

AUTO = "auto"


def parse_tensor(value: Any) -> int | None:
    """`rollout.tensor` as an int, or None for 'auto'; ValueError naming the field otherwise."""
    text = str(value).strip().lower()
    if text == AUTO:
        return None
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(f"config.rollout.tensor={value!r} must be 'auto' or a positive integer")


def rollout_mesh(learner_mesh: Mesh, tensor: int) -> Mesh:
    """The rollout mesh ('data' = replicas, 'fsdp' = 1, 'tensor') over `learner_mesh`'s devices in
    their order, `tensor` consecutive devices per replica; `MeshError` (one line naming
    rollout.tensor) when `tensor` does not divide the devices or a replica would span processes."""
    devices = list(learner_mesh.devices.flat)
    if tensor < 1 or len(devices) % tensor:
        raise MeshError(f"rollout.tensor={tensor} does not divide the mesh's {len(devices)} "
                        "devices")
    grid = np.asarray(devices, dtype=object).reshape(len(devices) // tensor, 1, tensor)
    for replica in grid.reshape(-1, tensor):
        if len({d.process_index for d in replica}) > 1:
            raise MeshError(f"rollout.tensor={tensor}: a replica's devices would span processes "
                            f"{sorted({d.process_index for d in replica})}; use at most the "
                            f"{jax.local_device_count()} devices of one process")
    return Mesh(grid, shd.MESH_AXES)


def _sharding(mesh: Mesh, logical: PartitionSpec, shape: tuple[int, ...]) -> NamedSharding:
    return NamedSharding(mesh, shd.logical_to_mesh_spec(logical, shape, mesh,
                                                        shd.ROLLOUT_AXIS_RULES))


def actor_shardings(actor: Any, logical_axes: Any, mesh: Mesh) -> Any:
    """The rollout layout of an actor tree (`quant.requantize`'s output, arrays or
    ShapeDtypeStructs): every leaf by `shd.ROLLOUT_AXIS_RULES` on the rollout `mesh` from its
    parameter's logical axes (`models.param_logical_axes`); a quantized kernel's codes like the
    kernel, its scales on the mesh axes that divide them (per-channel scales follow the output
    dimension, 128x128 block scales the blocks)."""
    logical = traverse_util.flatten_dict(logical_axes)
    flat = traverse_util.flatten_dict(actor)
    out = {}
    for path, leaf in flat.items():
        spec = logical[path]
        if isinstance(leaf, QuantizedTensor):
            out[path] = leaf.replace(qvalue=_sharding(mesh, spec, leaf.qvalue.shape),
                                     scale=_sharding(mesh, spec, leaf.scale.shape))
        else:
            out[path] = _sharding(mesh, spec, tuple(leaf.shape))
    return traverse_util.unflatten_dict(out)


def quantized_parameters(tree: Any) -> int:
    """Parameters held as quantized codes in an actor tree (its `QuantizedTensor`s' elements)."""
    return sum(int(np.prod(q.qvalue.shape)) for q in jax.tree.leaves(
        tree, is_leaf=lambda x: isinstance(x, QuantizedTensor)) if isinstance(q, QuantizedTensor))


@dataclasses.dataclass(frozen=True)
class ReshardBytes:
    """What one reshard moves, per device: `received` bytes (the replica's share after minus the
    learner-layout share it held before: at least what crossed the links) of which `codes` are
    quantized codes and their scales, and `quantized_parameters` the parameters those codes
    hold (unsharded count)."""

    received: int
    codes: int
    quantized_parameters: int

    @property
    def per_quantized_parameter(self) -> float:
        return self.received / max(self.quantized_parameters, 1)


DEFAULT_BUCKET_MIB = 1024  # `rollout.reshard_bucket_mib`: 2-3 buckets at 1.5B, 8-9 at 7B


def _share_bytes(leaf: Any, sharding: Any) -> int:
    """Bytes of one device's share of `leaf` (an array or a `QuantizedTensor`) under `sharding`
    (a `NamedSharding`, or a `QuantizedTensor` of them)."""
    if isinstance(leaf, QuantizedTensor):
        return (_share_bytes(leaf.qvalue, sharding.qvalue)
                + _share_bytes(leaf.scale, sharding.scale))
    return int(np.prod(sharding.shard_shape(tuple(leaf.shape)))) * jnp.dtype(leaf.dtype).itemsize


class Reshard:
    """Moves an actor (`quant.requantize`'s output on the learner's layout) to the rollout
    layout in buckets: the actor's leaves in order (a quantized kernel's codes and scales
    together), cut where a bucket's share on the rollout layout would pass `bucket_bytes` per
    device (a leaf larger than that is a bucket of its own, moved first; 0 = the whole actor in
    one bucket),
    each bucket one jitted identity whose `out_shardings` are the rollout layout. A program's
    collectives and temporaries then hold one bucket, not the whole replica, so the reshard's
    peak is the replica's share plus one bucket's transfer buffers. One compile per bucket
    structure. The input is not donated (the learner-layout codes are the reshard's
    temporaries, freed when the caller drops them) and the learner's own parameters and
    optimizer state are never its arguments."""

    def __init__(self, logical_axes: Any, mesh: Mesh,
                 bucket_bytes: int = DEFAULT_BUCKET_MIB << 20) -> None:
        if bucket_bytes < 0:
            raise ValueError(f"Reshard: bucket_bytes={bucket_bytes} must be >= 0 (0 = one "
                             "bucket)")
        self.logical_axes = logical_axes
        self.mesh = mesh
        self.bucket_bytes = int(bucket_bytes)
        self._fns: dict[Any, Callable] = {}
        self._plans: dict[Any, list[list[tuple[str, ...]]]] = {}

    def shardings(self, actor: Any) -> Any:
        return actor_shardings(actor, self.logical_axes, self.mesh)

    def abstract(self, actor: Any) -> Any:
        """`actor` (arrays or `jax.ShapeDtypeStruct`s) as `jax.ShapeDtypeStruct`s on the
        rollout layout: what resharding it gives, without running anything."""
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            actor, self.shardings(actor))

    def buckets(self, actor: Any) -> list[Any]:
        """`actor` cut into the sub-trees (nested dicts of its own leaves, in order) that one
        program each moves."""
        flat = traverse_util.flatten_dict(actor)
        key = jax.tree.structure(actor)
        if key not in self._plans:
            shardings = traverse_util.flatten_dict(self.shardings(actor))
            shares = {path: _share_bytes(leaf, shardings[path]) for path, leaf in flat.items()}
            # A leaf larger than a bucket (the 7B's embedding and LM head) moves first, alone:
            # its program's temporaries (a whole-tensor gather) then meet the least of the
            # replica already moved.
            big = [p for p in flat if self.bucket_bytes and shares[p] > self.bucket_bytes]
            plan: list[list[tuple[str, ...]]] = [[p] for p in big] + [[]]
            size = 0
            for path in (p for p in flat if p not in big):
                if plan[-1] and self.bucket_bytes and size + shares[path] > self.bucket_bytes:
                    plan.append([])
                    size = 0
                plan[-1].append(path)
                size += shares[path]
            self._plans[key] = [paths for paths in plan if paths]
        return [traverse_util.unflatten_dict({path: flat[path] for path in paths})
                for paths in self._plans[key]]

    def fn(self, tree: Any) -> Callable:
        """The jitted reshard of trees of `tree`'s structure: a bucket of `buckets`, or a
        whole actor in one program (its `.lower(tree)` compiles it without running)."""
        key = jax.tree.structure(tree)
        if key not in self._fns:
            self._fns[key] = jax.jit(lambda t: t, out_shardings=self.shardings(tree))
        return self._fns[key]

    def __call__(self, actor: Any) -> Any:
        out: dict[tuple[str, ...], Any] = {}
        for bucket in self.buckets(actor):
            out.update(traverse_util.flatten_dict(self.fn(bucket)(bucket)))
        return traverse_util.unflatten_dict(out)

    def bytes(self, actor: Any) -> ReshardBytes:
        """What resharding `actor` moves per device (from shapes and shardings; nothing runs)."""
        after = self.abstract(actor)
        is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
        codes_after = [x for x in jax.tree.leaves(after, is_leaf=is_q) if is_q(x)]
        codes_before = [x for x in jax.tree.leaves(actor, is_leaf=is_q) if is_q(x)]
        return ReshardBytes(
            received=max(tree_bytes_per_device(after) - tree_bytes_per_device(actor), 0),
            codes=max(tree_bytes_per_device(codes_after) - tree_bytes_per_device(codes_before),
                      0),
            quantized_parameters=quantized_parameters(actor))


def resolve_tensor(setting: int | None, *, replica_bytes: int, kv_bytes: Callable[[int], int],
                   resident_bytes: int, device_bytes: int | None, local_devices: int,
                   num_kv_heads: int) -> int:
    """The rollout's tensor degree.

    setting: `parse_tensor(rollout.tensor)`: an int is checked and kept, None ('auto') is the
      smallest power of two t dividing `local_devices` and `num_kv_heads` at which
      replica_bytes / t + kv_bytes(t) + resident_bytes <= device_bytes.
    replica_bytes: one whole replica of the actor (codes, scales, unquantized leaves).
    kv_bytes: t -> KV cache bytes per device at tensor degree t (the smallest pool the sampler
      can run with; the rest of the device is the pool's to grow into).
    resident_bytes: the learner's state per device that stays while the rollout runs.
    device_bytes: what a device may hold (None: unknown, e.g. host devices: 1 / the setting).

    Raises MeshError naming rollout.tensor and the device memory when the layout does not fit.
    """
    def need(t: int) -> int:
        return -(-replica_bytes // t) + kv_bytes(t) + resident_bytes

    def describe(t: int) -> str:
        gib = 1 << 30
        return (f"a replica's share {replica_bytes / t / gib:.2f} GiB + its KV "
                f"{kv_bytes(t) / gib:.2f} GiB + the learner's state {resident_bytes / gib:.2f} "
                f"GiB = {need(t) / gib:.2f} GiB, more than the device's {device_bytes / gib:.2f} "
                "GiB")

    if setting is not None:
        if local_devices % setting and setting % local_devices:
            raise MeshError(f"rollout.tensor={setting} does not divide a process's "
                            f"{local_devices} devices")
        if device_bytes is not None and need(setting) > device_bytes:
            raise MeshError(f"rollout.tensor={setting}: {describe(setting)}; raise "
                            "rollout.tensor or lower rollout.max_concurrent_rows / kv_pages")
        return setting
    candidates = _tensor_degrees(local_devices, num_kv_heads)
    if device_bytes is None:
        return 1
    for t in candidates:
        if need(t) <= device_bytes:
            return t
    raise MeshError(f"rollout.tensor=auto: even at {candidates[-1]} (one process's devices) "
                    f"{describe(candidates[-1])}")


def kv_bytes_per_device(settings: Any, model_config: Any, devices: int) -> int:
    """The rollout's KV cache per device, whatever the tensor degree (rows over the replicas,
    kv heads over the tensor axis): a paged pool's `rollout.kv_pages` pages, else the rows
    decoded at once (`rollout.max_concurrent_rows`, 0 = a step's rows) at prompt + response
    length; keys and values of every layer at `rollout.kv_precision` (8-bit: with the scales)."""
    r, m = settings.rollout, model_config
    token = m.num_layers * r.sampler.kv_precision.bytes_per_token(m.num_kv_heads, m.head_dim,
                                                                  m.compute_dtype)
    if r.sampler.kv_pages:
        tokens = r.sampler.kv_pages * r.sampler.kv_page_size
    else:
        rows = r.sampler.max_concurrent_rows or settings.rollout_rows
        tokens = rows * (settings.data.max_prompt_len + r.max_new_tokens)
    return -(-tokens * token // devices)


def plan_tensor(settings: Any, model_config: Any, learner_mesh: Mesh, abstract_params: Any,
                abstract_opt_state: Any, device_bytes: int | None, resident: Any = None) -> int:
    """`resolve_tensor` of a run (`settings.rollout.tensor`): the replica from the requantized
    abstract parameters (the larger of the rollout's actor and the evaluation's full-precision
    one), the learner's parameters and optimizer state as what stays resident,
    the KV by `kv_bytes_per_device`, `device_bytes` the usable memory of one device (None:
    unknown). A LoRA run (`settings.model.lora`) has one replica, its frozen base, which the
    evaluation reads too, and `resident` (its adapter and optimizer state) instead."""
    from qurl_jax import quant

    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params)

    def replica_bytes(recipe: Any) -> int:
        actor = jax.eval_shape(lambda p: quant.requantize(
            p, recipe, compute_dtype=model_config.compute_dtype), params)
        return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(actor))

    # The rollout's quantized actor, or the evaluation's full-precision one in the compute dtype
    # (`Trainer.evaluate` samples it on the same replicas), whichever is larger.
    lora = settings.model.lora.enabled
    replica = max(replica_bytes(settings.rollout.recipe),
                  replica_bytes(settings.rollout.recipe if lora else "fp"))
    devices = learner_mesh.size
    local = _local_devices(learner_mesh)
    return resolve_tensor(
        parse_tensor(settings.rollout.tensor), replica_bytes=replica,
        kv_bytes=lambda t: kv_bytes_per_device(settings, model_config, devices),
        resident_bytes=tree_bytes_per_device(
            resident if resident is not None else (abstract_params, abstract_opt_state)),
        device_bytes=device_bytes, local_devices=local, num_kv_heads=model_config.num_kv_heads)


def _tensor_degrees(local_devices: int, num_kv_heads: int) -> list[int]:
    """The rollout tensor degrees one process's devices allow: powers of two dividing both its
    devices and the kv heads, smallest first."""
    return [t for t in (2 ** i for i in range(int(math.log2(max(local_devices, 1))) + 1))
            if local_devices % t == 0 and num_kv_heads % t == 0]


def _local_devices(mesh: Mesh) -> int:
    """Devices of `mesh` in the process of its first device."""
    first = mesh.devices.flat[0].process_index
    return sum(1 for d in mesh.devices.flat if d.process_index == first)


def check_concurrent_rows(settings: Any, rollout_mesh: Mesh, num_kv_heads: int) -> None:
    """`ConfigError` (one line naming `rollout.max_concurrent_rows`, `rollout.tensor` and the
    group size) when `rollout.max_concurrent_rows` cannot run on the rollout's replicas, which
    `rollout.tensor` ('auto' included) decides only once the mesh is known: a static sampler's
    chunk holds whole groups of `rollout.n` rows on every replica, so it needs at least
    n x replicas rows; a refilling sampler's slots are split evenly over the replicas. Without it
    the first rollout stops with a traceback from inside the sampler. (The evaluation sampler,
    static always, draws `eval.k` samples in rounds when a chunk cannot hold them,
    `sampling.factory.samples_per_call`: one row per replica, which either rollout sampler's
    rows hold.)"""
    r = settings.rollout
    rows = r.sampler.max_concurrent_rows
    if rows == 0:  # every row of a call at once: batch padding makes whole groups
        return
    replicas = rollout_mesh.shape["data"] * rollout_mesh.shape["fsdp"]
    tensor = f"rollout.tensor={r.tensor}" + (
        f" -> {rollout_mesh.shape['tensor']}" if parse_tensor(r.tensor) is None else "")
    where = f"on the rollout's {replicas} replicas ({tensor})"
    if r.sampler.refills:
        if rows % replicas:
            raise ConfigError(f"config.rollout.max_concurrent_rows={rows} must be a multiple of "
                              f"the {replicas} rollout replicas ({tensor}): the refilling "
                              "sampler splits its slots evenly over them")
        return
    n = r.n
    if n * replicas <= rows:
        return
    local = _local_devices(rollout_mesh)
    fits = [t for t in _tensor_degrees(local, num_kv_heads) if rollout_mesh.size // t * n <= rows]
    other = (f", or set rollout.tensor={fits[0]} ({rollout_mesh.size // fits[0]} replicas)"
             if fits else "")
    raise ConfigError(
        f"config.rollout.max_concurrent_rows={rows} holds no whole group {where}: the static "
        f"sampler decodes whole groups (rollout.n={n}) on every replica, at least {n} x "
        f"{replicas} = {n * replicas} rows at once; raise rollout.max_concurrent_rows to "
        f"{n * replicas}{other}, or rollout.refill=on")
