"""Logical-axis sharding: one rules table maps parameter/activation axis names to mesh axes.

Model code never names mesh axes. Parameters carry logical names (`embed`, `heads`, `kv_heads`,
`mlp`, `vocab`, `norm`, `head_dim`); activations use `batch` and `length`. `LOGICAL_AXIS_RULES`
maps them onto a `Mesh(('data', 'fsdp', 'tensor'))`: batch over data x fsdp (data parallel plus
ZeRO-3 style parameter sharding over fsdp), the model dimension over fsdp, heads / MLP / vocab over
tensor (Megatron-style tensor parallelism). A dimension that a mesh axis does not divide stays
replicated on that axis rather than failing, so tiny test models run on any mesh.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

LOGICAL_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("norm", None),
    ("head_dim", None),
    ("layers", None),
    ("cache_length", None),
)


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Mesh over the first data*fsdp*tensor devices; a size of -1 takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = [data, fsdp, tensor]
    if sizes.count(-1) > 1:
        raise ValueError(f"mesh sizes {dict(zip(MESH_AXES, sizes))}: at most one may be -1")
    if -1 in sizes:
        known = int(np.prod([s for s in sizes if s != -1]))
        sizes[sizes.index(-1)] = len(devices) // known
    for name, size in zip(MESH_AXES, sizes):
        if size < 1:
            raise ValueError(f"mesh.{name}={size} must be >= 1")
    n = int(np.prod(sizes))
    if n > len(devices):
        raise ValueError(
            f"mesh {dict(zip(MESH_AXES, sizes))} needs {n} devices but only {len(devices)} exist"
        )
    return Mesh(np.asarray(devices[:n]).reshape(sizes), MESH_AXES)


def _rule(name: str | None, rules: Sequence[tuple[str, Any]]) -> Any:
    if name is None:
        return None
    for logical, mesh_axes in rules:
        if logical == name:
            return mesh_axes
    raise KeyError(f"logical axis {name!r} has no entry in the sharding rules")


def logical_to_mesh_spec(logical: PartitionSpec, shape: Sequence[int] | None, mesh: Mesh,
                         rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> PartitionSpec:
    """Maps a logical PartitionSpec to a mesh PartitionSpec for an array of `shape`.

    Mesh axes of size 1, axes already used by an earlier dimension, and axes that do not divide the
    dimension are dropped (the dimension is replicated over them).
    """
    used: set[str] = set()
    out = []
    for i, name in enumerate(logical):
        axes = _rule(name, rules)
        axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        kept = []
        for ax in axes:
            size = mesh.shape[ax]
            dim_ok = shape is None or shape[i] % (size * int(np.prod(
                [mesh.shape[a] for a in kept]))) == 0
            if size > 1 and ax not in used and dim_ok:
                kept.append(ax)
        used.update(kept)
        out.append(None if not kept else (kept[0] if len(kept) == 1 else tuple(kept)))
    return PartitionSpec(*out)


def logical_shardings(logical_specs: Any, shapes: Any, mesh: Mesh,
                      rules: Sequence[tuple[str, Any]] = LOGICAL_AXIS_RULES) -> Any:
    """NamedShardings for a pytree of logical PartitionSpecs and a matching pytree of arrays."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    return jax.tree.map(
        lambda spec, x: NamedSharding(mesh, logical_to_mesh_spec(spec, np.shape(x), mesh, rules)),
        logical_specs, shapes, is_leaf=is_spec,
    )


def shard_params(params: Any, logical_specs: Any, mesh: Mesh) -> Any:
    """Places a parameter pytree on the mesh according to its logical axes."""
    return jax.device_put(params, logical_shardings(logical_specs, params, mesh))


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
    """Shards the leading (batch) dimension over ('data', 'fsdp'); other dimensions replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def activation_pinner(mesh: Mesh | None) -> Any:
    """A model's `shard_activation` for `mesh`: (activation, logical axes) -> the activation
    constrained to the rules' sharding, so the partitioner keeps the residual stream split over
    the batch and gathers FSDP-sharded weights for each product (left free, it may instead split
    every product over its contracting dimension with all tokens on every device and all-reduce
    the partial sums). None (leave the partitioner free) without a mesh or on one device."""
    if mesh is None or mesh.size == 1:
        return None

    def pin(x: jax.Array, logical: tuple[str, ...]) -> jax.Array:
        spec = logical_to_mesh_spec(PartitionSpec(*logical), x.shape, mesh)
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return pin
