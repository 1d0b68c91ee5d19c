"""Multi-process runs on JAX's own runtime (`jax.distributed`): joining a cluster, and the few
host-local data helpers the trainer needs so that every process handles only its own rows.

Joining (`initialize`, called by `python -m qurl_jax.main` before anything touches a device):
- explicit: `coordinator_address` ("host:port"), `num_processes`, `process_id` (and optionally
  `local_device_ids`) are passed to `jax.distributed.initialize`, as a GPU cluster without
  auto-detection or a test on one machine needs;
- automatic: without them, `jax.distributed.initialize()` is called only where `detect_cluster`
  finds a cluster in the environment (Cloud TPU VM or GKE TPU workers, SLURM inside `srun`, Open
  MPI, xpk GPU pods); otherwise the run stays a single process and nothing is initialised.
A peer that dies is noticed by the coordination service after `heartbeat_timeout_s`; the survivors
then abort (SIGABRT, exit code 134) after logging "The following tasks are unhealthy (stopped
sending heartbeats): <process ids>". Every process must run the same collectives in the same order,
or the others wait for it until that timeout.

Host-local data: the global batch is sharded on its leading axis over the mesh's ('data', 'fsdp')
axes, so each process's devices hold one contiguous block of rows (`row_block`). A process reads,
samples and verifies only that block, and `global_batch` assembles the global arrays from the
blocks with `jax.make_array_from_process_local_data`. `local_rows` reads a process's block back
from a global array without fetching rows it does not hold; `host_sums` and `agree_max` are the
small host-side collectives (a handful of numbers per step).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from qurl_jax.parallel.sharding import batch_sharding

# Environment variables that mark a cluster `jax.distributed.initialize()` can join without
# arguments, by name (all of a tuple's variables must be set).
_CLUSTER_ENV = (
    # SLURM, inside a job step (`srun`): the step's node list exists only there.
    ("slurm", ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
               "SLURM_LOCALID")),
    # GKE TPU node pools and multi-host TPU VMs (the TPU runtime's worker list).
    ("tpu", ("TPU_WORKER_HOSTNAMES",)),
    ("tpu", ("TPU_PROCESS_ADDRESSES",)),
    ("tpu", ("MEGASCALE_COORDINATOR_ADDRESS",)),
    # Open MPI <= 4 (`mpirun`).
    ("ompi", ("OMPI_MCA_orte_hnp_uri",)),
)
# xpk's GPU pods: the coordinator host (no port), its port, the node count and this node's rank.
_XPK_GPU_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "NNODES", "NODE_RANK")


def _on_cloud_tpu_vm() -> bool:
    """A Cloud TPU VM: TPU chips under /dev and the libtpu runtime installed. (JAX itself also
    asks the metadata server, which this check avoids: it must be cheap and offline.)"""
    import glob
    import importlib.util

    chips = glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
    return bool(chips) and importlib.util.find_spec("libtpu") is not None


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """The kind of cluster this process runs in ('slurm', 'tpu', 'ompi', 'xpk-gpu'), or None.

    Reads only the environment (and /dev on a TPU VM); contacts nothing. `TPU_SKIP_MDS_QUERY`
    (set by single-host TPU setups) turns the TPU VM check off.
    """
    env = os.environ if environ is None else environ
    for kind, names in _CLUSTER_ENV:
        if all(env.get(name) for name in names):
            return kind
    if all(env.get(name) for name in _XPK_GPU_ENV):
        return "xpk-gpu"
    if environ is None and "TPU_SKIP_MDS_QUERY" not in env and _on_cloud_tpu_vm():
        return "tpu"
    return None


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, local_device_ids: Sequence[int] | None = None, *,
               heartbeat_timeout_s: int = 100, init_timeout_s: int = 300,
               environ: Mapping[str, str] | None = None) -> bool:
    """Joins the multi-process run this process belongs to; returns whether one was joined.

    With `coordinator_address`, `num_processes` and `process_id` all given they are used as they
    are; with none of them, `jax.distributed.initialize()` runs only where `detect_cluster` finds a
    cluster (xpk GPU pods get the coordinator, count and rank from xpk's variables). Giving only
    some of the three is an error (ValueError), as is a malformed address.

    heartbeat_timeout_s: how long the coordination service waits for a silent peer before the
      others abort; init_timeout_s: how long start-up waits for every process to join.
    """
    explicit = (coordinator_address, num_processes, process_id)
    if any(v is not None for v in explicit) and not all(v is not None for v in explicit):
        raise ValueError("--coordinator_address, --num_processes and --process_id go together: "
                         f"got {coordinator_address=}, {num_processes=}, {process_id=}")
    if heartbeat_timeout_s < 1 or init_timeout_s < 1:
        raise ValueError(f"timeouts must be >= 1 s, got heartbeat {heartbeat_timeout_s}, "
                         f"initialization {init_timeout_s}")
    kwargs: dict[str, Any] = dict(initialization_timeout=int(init_timeout_s),
                                  heartbeat_timeout_seconds=int(heartbeat_timeout_s))
    if local_device_ids:
        kwargs["local_device_ids"] = [int(i) for i in local_device_ids]
    if coordinator_address is not None:
        host, sep, port = coordinator_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--coordinator_address={coordinator_address!r} is not HOST:PORT")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"--process_id={process_id} is not in [0, {num_processes})")
        kwargs.update(coordinator_address=coordinator_address, num_processes=int(num_processes),
                      process_id=int(process_id))
        kind = "explicit"
    else:
        kind = detect_cluster(environ)
        if kind is None:
            return False
        if kind == "xpk-gpu":
            env = os.environ if environ is None else environ
            kwargs.update(
                coordinator_address=f"{env['JAX_COORDINATOR_ADDRESS']}:"
                                    f"{env['JAX_COORDINATOR_PORT']}",
                num_processes=int(env["NNODES"]), process_id=int(env["NODE_RANK"]))
    jax.distributed.initialize(**kwargs)
    logging.info("joined a %s multi-process run: process %d of %d, %d local / %d global devices",
                 kind, jax.process_index(), jax.process_count(), jax.local_device_count(),
                 jax.device_count())
    return True


def is_primary() -> bool:
    """Whether this process writes the run's metrics, logs, plots and exports (process 0)."""
    return jax.process_index() == 0


# ------------------------------------------------------------------------------- host-local rows
def row_block(mesh: Mesh) -> tuple[int, int]:
    """(index, count): a batch sharded over ('data', 'fsdp') is cut into `count` contiguous blocks
    of rows, one per process (several processes share a block when a tensor-parallel group spans
    them), and this process's devices hold block `index`. (0, 1) on one process."""
    shards = int(mesh.shape["data"] * mesh.shape["fsdp"])
    index_map = batch_sharding(mesh, 1).devices_indices_map((shards,))
    mine = sorted({index_map[d][0].start or 0 for d in mesh.devices.flat
                   if d.process_index == jax.process_index()})
    if not mine:
        raise ValueError("this process has no device in the mesh")
    lo, size = mine[0], len(mine)
    if mine != list(range(lo, lo + size)) or lo % size or shards % size:
        raise ValueError(f"this process's devices hold batch shards {mine} of {shards}: not one "
                         "aligned contiguous block (order the mesh's devices by process)")
    return lo // size, shards // size


def global_batch(mesh: Mesh, local: Mapping[str, Any]) -> dict[str, jax.Array]:
    """Global arrays, batch-sharded over ('data', 'fsdp'), from this process's block of rows (its
    `row_block`): every process passes its own rows, the same shapes and dtypes."""
    _, count = row_block(mesh)
    out = {}
    for name, rows in local.items():
        rows = np.asarray(rows)
        out[name] = jax.make_array_from_process_local_data(
            batch_sharding(mesh, rows.ndim), rows, (rows.shape[0] * count, *rows.shape[1:]))
    return out


def local_rows(x: jax.Array) -> np.ndarray:
    """The rows of a batch-sharded global array that this process's devices hold (its block), as
    numpy; reads no other process's data. A fully addressable array is returned whole."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    starts: dict[int, Any] = {}
    for shard in x.addressable_shards:
        starts.setdefault(shard.index[0].start or 0, shard)
    blocks = [np.asarray(starts[s].data) for s in sorted(starts)]
    rows = np.concatenate(blocks, axis=0) if len(blocks) > 1 else blocks[0]
    if rows.shape[0] == x.shape[0]:  # replicated rows: keep this process's block of them
        index, count = row_block(x.sharding.mesh)
        size = x.shape[0] // count
        rows = rows[index * size:(index + 1) * size]
    return rows


def to_host(tree: Any) -> Any:
    """`jax.device_get` that also works for arrays spanning other processes' devices: those are
    gathered from every process (a collective: all processes must call it)."""
    def get(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(get, tree)


def host_sums(values: Mapping[str, float]) -> dict[str, float]:
    """Sums of host-side numbers over all processes (a collective; the same keys everywhere)."""
    if jax.process_count() == 1:
        return {k: float(v) for k, v in values.items()}
    keys = sorted(values)
    # float64 travels as pairs of uint32 words (JAX would round it to float32 without x64), so
    # the sums are those a single process would compute.
    local = np.array([float(values[k]) for k in keys], np.float64).view(np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(local)).astype(np.uint32)
    per_process = gathered.reshape(-1, 2 * len(keys)).view(np.float64)  # [processes, len(keys)]
    return dict(zip(keys, (float(v) for v in per_process.sum(axis=0)), strict=True))


def agree_max(value: int) -> int:
    """The largest of every process's `value` (a collective)."""
    if jax.process_count() == 1:
        return int(value)
    return int(np.max(multihost_utils.process_allgather(np.array(int(value), np.int64))))
