"""Logical-axis sharding: one rules table maps parameter/activation axis names to mesh axes.

Model code never names mesh axes. Parameters carry logical names (`embed`, `heads`, `kv_heads`,
`mlp`, `vocab`, `norm`, `head_dim`); activations use `batch` and `length`. `LOGICAL_AXIS_RULES`
maps them onto a `Mesh(('data', 'fsdp', 'tensor'))`: batch over data x fsdp (data parallel plus
ZeRO-3 style parameter sharding over fsdp), the model dimension over fsdp, heads / MLP / vocab over
tensor (Megatron-style tensor parallelism). A dimension that a mesh axis does not divide stays
replicated on that axis rather than failing, so tiny test models run on any mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qurl_jax.runtime.errors import MeshError

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

# The rollout's replicas (`qurl_jax.parallel.rollout_layout`, a mesh whose 'data' axis is the
# replicas and whose 'fsdp' axis is 1): no weight sharded over fsdp; heads, MLP and kv heads over
# the rollout's tensor axis; the embedding and the LM head whole on every device (a
# vocabulary-sharded head would gather every slot's logits every token); rows, slots and pages over
# the replicas.
ROLLOUT_AXIS_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", ("data", "fsdp")),
    ("length", None),
    ("embed", None),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", None),
    ("norm", None),
    ("head_dim", None),
    ("layers", None),
    ("cache_length", None),
)


def mesh_shape(sizes: Mapping[str, int], num_devices: int,
               dcn: Mapping[str, int] | None = None) -> dict[str, int]:
    """The mesh's axis sizes over `num_devices` devices, -1 resolved (`MeshError` if impossible).

    `sizes` are the axes within one slice (ICI; the whole run when `dcn` is None or all 1); `dcn`
    the number of slices (or processes) each axis spans across the data-center network. An axis
    of -1 takes the devices of one slice that the other axes leave. The result is the total size
    of each axis (ICI x DCN).
    """
    dcn = {a: 1 for a in MESH_AXES} if dcn is None else {a: int(dcn[a]) for a in MESH_AXES}
    ici = {a: int(sizes[a]) for a in MESH_AXES}
    if list(ici.values()).count(-1) > 1:
        raise MeshError(f"mesh {ici}: at most one axis may be -1")
    for axis in MESH_AXES:
        if ici[axis] < 1 and ici[axis] != -1:
            raise MeshError(f"mesh.{axis}={ici[axis]} must be >= 1 (or -1: the rest)")
        if dcn[axis] < 1:
            raise MeshError(f"mesh.dcn.{axis}={dcn[axis]} must be >= 1")
    slices = int(np.prod(list(dcn.values())))
    if num_devices % slices:
        raise MeshError(f"mesh.dcn {dcn} spans {slices} slices but {num_devices} devices do not "
                        "split into that many equal parts")
    per_slice = num_devices // slices
    if -1 in ici.values():
        known = int(np.prod([v for v in ici.values() if v != -1]))
        if per_slice % known or per_slice < known:
            raise MeshError(f"mesh {ici}: the other axes ({known} devices) do not divide the "
                            f"{per_slice} devices {'of each slice ' if slices > 1 else ''}that -1 "
                            "would share")
        ici[next(a for a in MESH_AXES if ici[a] == -1)] = per_slice // known
    return {a: ici[a] * dcn[a] for a in MESH_AXES}


def _describe(devices: Sequence[jax.Device]) -> str:
    processes = sorted({d.process_index for d in devices})
    return (f"{len(devices)} device{'s' * (len(devices) != 1)}" if len(processes) == 1 else
            f"{len(devices)} devices on {len(processes)} processes "
            f"({len(devices) // len(processes)} each)")


def _pick(devices: list[jax.Device], n: int, shape: Mapping[str, int]) -> list[jax.Device]:
    """`n` of `devices`, the same number from every process (so no process is left without a
    device and each holds one block of the batch); `MeshError` when that is impossible."""
    if n > len(devices):
        raise MeshError(f"mesh {dict(shape)} needs {n} devices but the run has "
                        f"{_describe(devices)}; make the axes smaller or set one to -1 (the rest)")
    if n == len(devices):
        return devices
    by_process: dict[int, list[jax.Device]] = {}
    for d in devices:
        by_process.setdefault(d.process_index, []).append(d)
    if n % len(by_process):
        raise MeshError(f"mesh {dict(shape)} of {n} devices cannot take the same number from each "
                        f"of the run's {len(by_process)} processes ({_describe(devices)}); use a "
                        f"multiple of {len(by_process)} devices, or -1 on one axis")
    share = n // len(by_process)
    return [d for p in sorted(by_process) for d in by_process[p][:share]]


def _process_blocks_aligned(grid: np.ndarray) -> bool:
    """Whether every process's devices hold one aligned contiguous block of the batch shards
    (rows of the data x fsdp axes), which the host-local data path needs."""
    batch = grid.reshape(-1, grid.shape[-1])  # [data * fsdp, tensor]
    owners = [sorted({d.process_index for d in row}) for row in batch]
    blocks: dict[int, list[int]] = {}
    for i, procs in enumerate(owners):
        for p in procs:
            blocks.setdefault(p, []).append(i)
    for rows in blocks.values():
        if rows != list(range(rows[0], rows[0] + len(rows))) or rows[0] % len(rows):
            return False
    return True


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None, *,
              dcn: Mapping[str, int] | None = None) -> Mesh:
    """A ('data', 'fsdp', 'tensor') mesh; an axis of -1 takes the devices the others leave.

    Uses every device when the sizes multiply to their count, else the same number of devices
    from every process. The device order comes from `jax.experimental.mesh_utils`:
    `create_hybrid_device_mesh` when `dcn` spans several slices (TPU slices, else processes),
    `create_device_mesh` (topology-aware) within one, falling back to the plain device order
    when that order would split a process's batch rows. `MeshError` names the mesh and devices
    when it does not fit.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(dict(data=data, fsdp=fsdp, tensor=tensor), len(devices), dcn)
    n = int(np.prod(list(shape.values())))
    picked = _pick(devices, n, shape)
    sizes = [shape[a] for a in MESH_AXES]
    slices = [1 if dcn is None else int(dcn[a]) for a in MESH_AXES]
    if int(np.prod(slices)) > 1:
        ici = [s // k for s, k in zip(sizes, slices, strict=True)]
        granule_is_process = not hasattr(picked[0], "slice_index")
        try:
            grid = mesh_utils.create_hybrid_device_mesh(
                ici, slices, picked, process_is_granule=granule_is_process,
                allow_split_physical_axes=True)
        except (ValueError, AssertionError, NotImplementedError) as e:
            raise MeshError(f"mesh {shape} with mesh.dcn {dict(dcn)} does not fit "
                            f"{_describe(picked)}: {e}") from None
        return Mesh(grid, MESH_AXES)
    grid = np.asarray(picked).reshape(sizes)
    if n == len(devices) and n > 1:
        try:
            topo = mesh_utils.create_device_mesh(sizes, picked, allow_split_physical_axes=True)
            if _process_blocks_aligned(topo):
                grid = topo
        except (ValueError, AssertionError, NotImplementedError):
            pass  # no topology-aware order for this shape: the plain order
    return Mesh(grid, MESH_AXES)


def mesh_from_config(mesh: Mapping[str, Any], *, warn_idle: bool = True) -> Mesh:
    """The run's mesh of the config's `mesh` section (`MeshError` naming the mesh, devices and
    processes when it does not fit); warns once with the count of devices left idle."""
    dcn = mesh.get("dcn")
    built = make_mesh(mesh["data"], mesh["fsdp"], mesh["tensor"],
                      dcn=None if dcn is None else {a: dcn[a] for a in MESH_AXES})
    idle = jax.device_count() - built.size
    if idle and warn_idle:
        logging.warning("mesh %s uses %d of the %d devices: %d idle (set one mesh axis to -1 "
                        "to use them all)", dict(built.shape), built.size, jax.device_count(),
                        idle)
    return built


def check_mesh_fits(mesh: Mapping[str, Any]) -> None:
    """Raises `MeshError` (one line: the mesh, devices and processes) when the config's mesh does
    not fit the run's devices; builds nothing that lasts."""
    mesh_from_config(mesh, warn_idle=False)


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
