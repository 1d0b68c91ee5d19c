"""Compile targets: the devices of a machine we do not have, for XLA to compile programs against.

    target = targets.parse("tpu:v5p-16")
    devices = target.devices()           # 8 compile-only TPU v5p devices
    mesh = sharding.make_mesh(2, 4, 1, devices=devices)
    jax.jit(f).lower(<ShapeDtypeStructs with NamedShardings on mesh>).compile().memory_analysis()

A target string names a machine:

- `cpu`: this host's CPU devices (XLA:CPU); the only target that can also run what it compiles.
- `tpu:v5e-N`, `tpu:v6e-N`: a Cloud TPU v5e / v6e slice of N chips (one TensorCore each);
  N = 4, 8, 16, ... (a power of two; libtpu's smallest topology is one 2x2 host).
- `tpu:v5p-N`: a Cloud TPU v5p slice named, as Cloud TPU names v5p slices, by its TensorCores:
  two per chip, so v5p-16 is 8 chips (topology 2x2x2); N = 8, 16, 32, ...
- `gpu:h100-N`: N NVIDIA H100 SXM GPUs, 8 per host (N <= 8, or a multiple of 8).

TPU and GPU devices are compile-only (`jax.experimental.topologies`): `jit(...).lower(...)
.compile()` runs that chip's compiler (libtpu's TPU compiler; XLA's GPU pipeline and ptxas for
sm_90a), and `memory_analysis()` gives its buffer sizes; nothing can run on them. They need the
backend installed beside JAX: `pip install -e .[tpu-compile]` (libtpu) or `.[gpu-compile]` (the
CUDA plugin, which brings its own ptxas); no accelerator is needed. The H100's device description
(`GpuTargetConfigProto`) is `third_party/xla_specs/h100_sxm.txtpb` (from openxla/xla).

Memory per chip, from the vendors' public specifications (HBM per chip):
- TPU v5e: 16 GiB HBM2 (cloud.google.com/tpu/docs/v5e, "System architecture");
- TPU v6e: 32 GiB HBM (cloud.google.com/tpu/docs/v6e, "System architecture");
- TPU v5p: 95 GiB HBM2e (cloud.google.com/tpu/docs/v5p, "System architecture");
- H100 SXM: 80 GB HBM3 (nvidia.com/en-us/data-center/h100, "Technical specifications"), of
  which the device reports 84,942,979,072 bytes (79.1 GiB; `device_memory_size` of the XLA
  device description above), the figure used here.
Google's tables write "GB" for these capacities; the chips' runtimes report GiB-sized limits
(a v5e's is 15.75 GiB usable of 16 GiB), so they are taken as GiB.

On a machine with libtpu installed but no TPU attached, JAX still starts the TPU backend in every
process and libtpu logs warnings; `use_cpu_unless_accelerator_attached()` (called by the entry
points before JAX starts a backend) keeps such a process on the CPU. Building a compile-only TPU
topology still starts libtpu, which prints an `E0000 ... unexpected worker hostname` error and a
warning about the accelerator type it cannot determine (it looks for the TPU VM it is not on);
`_topology_devices` keeps those known lines out of the terminal and passes any other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax

from qurl_jax.runtime.errors import UserError

GIB = 1 << 30

XLA_SPECS_DIR = Path(__file__).resolve().parents[2] / "third_party" / "xla_specs"


class TargetError(UserError):
    """A target string that names no known machine, or a target whose compiler is not installed;
    the message is one line naming it."""

    what = "bad target"


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator kind: its JAX platform, the pip extra that brings its compiler, and its
    memory per device (public specification, see the module docstring)."""

    name: str
    platform: str  # the JAX platform of its devices: 'tpu' | 'gpu'
    memory_bytes: int
    extra: str  # `pip install -e .[extra]`
    cores_per_name_unit: int = 1  # TensorCores a slice name counts per chip (v5p: 2)


CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "tpu", 16 * GIB, "tpu-compile"),
    "v6e": Chip("v6e", "tpu", 32 * GIB, "tpu-compile"),
    "v5p": Chip("v5p", "tpu", 95 * GIB, "tpu-compile", cores_per_name_unit=2),
    "h100": Chip("h100", "gpu", 84_942_979_072, "gpu-compile"),
}

_PLATFORM_OF_PREFIX = {"tpu": "tpu", "gpu": "gpu"}
GPUS_PER_HOST = 8


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to compile for.

    name: the target string (`cpu`, `tpu:v5p-16`, `gpu:h100-8`); platform: the JAX platform of
    its devices ('cpu' | 'tpu' | 'gpu'); chip: None for `cpu`; num_devices: devices of the slice
    (chips; None for `cpu`: this host's CPU devices); topology: the name `topologies.
    get_topology_desc` takes (None for `cpu`).
    """

    name: str
    platform: str
    chip: Chip | None = None
    num_devices: int | None = None
    topology: str | None = None

    @property
    def memory_bytes(self) -> int | None:
        """Memory per device from the chip's public specification (None for `cpu`)."""
        return self.chip.memory_bytes if self.chip else None

    @property
    def compile_only(self) -> bool:
        return self.chip is not None

    def devices(self) -> list[jax.Device]:
        """The target's devices: compile-only ones for an accelerator target (`TargetError` when
        its compiler is not installed), this host's CPU devices for `cpu`."""
        if self.chip is None:
            return jax.devices("cpu")
        return list(_topology_devices(self))

    def device_kind(self) -> str:
        """The devices' `device_kind` as their compiler reports it (e.g. 'TPU v5', 'NVIDIA H100
        80GB HBM3', 'cpu')."""
        return self.devices()[0].device_kind

    def describe(self) -> dict[str, object]:
        """JSON-able facts about the target: name, platform, device kind, devices, topology and
        memory per device."""
        devices = self.devices()
        return {"target": self.name, "platform": devices[0].platform,
                "device_kind": devices[0].device_kind, "devices": len(devices),
                "topology": self.topology, "memory_bytes_per_device": self.memory_bytes}


def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _tpu_topology(chip: Chip, chips: int) -> str:
    """Cloud TPU slice shapes: v5e/v6e are 2D (rows x columns, columns >= rows), v5p is a 3D torus
    grown from one 2x2x1 host by doubling its smallest dimension, the last of equals (2x2x2,
    2x2x4, 2x4x4, 4x4x4, 4x4x8, ...)."""
    if chip.name == "v5p":
        dims = [2, 2, 1]
        while dims[0] * dims[1] * dims[2] < chips:
            smallest = min(dims)
            dims[max(i for i in range(3) if dims[i] == smallest)] *= 2
        return f"{chip.name}:{dims[0]}x{dims[1]}x{dims[2]}"
    rows = 1 << ((chips.bit_length() - 1) // 2)
    return f"{chip.name}:{rows}x{chips // rows}"


def parse(text: str) -> Target:
    """The `Target` a target string names (see the module docstring); `TargetError` naming the
    string otherwise."""
    text = text.strip()
    if text == "cpu":
        return Target("cpu", "cpu")
    m = re.fullmatch(r"(tpu|gpu):([a-z0-9]+)-(\d+)", text)
    if not m or m.group(2) not in CHIPS or CHIPS[m.group(2)].platform != m.group(1):
        raise TargetError(f"target {text!r}: expected cpu, tpu:v5e-N, tpu:v6e-N, tpu:v5p-N or "
                          "gpu:h100-N")
    chip, count = CHIPS[m.group(2)], int(m.group(3))
    if chip.platform == "tpu":
        chips, rem = divmod(count, chip.cores_per_name_unit)
        if rem or not _power_of_two(chips) or chips < 4:
            smallest = 4 * chip.cores_per_name_unit
            raise TargetError(f"target {text!r}: {chip.name} slices are {chip.name}-N with N a "
                              f"power of two >= {smallest}")
        return Target(text, "tpu", chip, chips, _tpu_topology(chip, chips))
    if count < 1 or (count > GPUS_PER_HOST and count % GPUS_PER_HOST):
        raise TargetError(f"target {text!r}: {chip.name}-N needs 1 <= N <= {GPUS_PER_HOST} or N "
                          f"a multiple of {GPUS_PER_HOST} ({GPUS_PER_HOST} GPUs per host)")
    hosts = max(count // GPUS_PER_HOST, 1)
    return Target(text, "gpu", chip, count, f"1x{hosts}x{min(count, GPUS_PER_HOST)}")


def compiler_installed(platform: str) -> bool:
    """Whether this Python can compile for `platform` ('tpu': libtpu; 'gpu': JAX's CUDA plugin),
    with or without such a device attached."""
    if platform == "tpu":
        return importlib.util.find_spec("libtpu") is not None
    try:
        import jax_plugins  # namespace package of the PJRT plugins
    except ImportError:
        return False
    import pkgutil

    return any(m.name.startswith("xla_cuda") for m in pkgutil.iter_modules(jax_plugins.__path__))


# What libtpu prints when it starts on a machine that is not a TPU VM (compile-only topologies):
# harmless there, and alarming ("E0000 ... INVALID_ARGUMENT").
_LIBTPU_OFF_TPU_VM = ("Failed to find host bounds for accelerator type",
                      "WARNING: Logging before InitGoogle()", "unexpected worker hostname",
                      "=== Source Location Trace", "libtpu_init_utils.cc")


@contextlib.contextmanager
def _without_libtpu_off_vm_lines() -> Iterator[None]:
    """Captures this process's stderr (the file descriptor: libtpu writes from C++) while libtpu
    starts, then writes back every line but `_LIBTPU_OFF_TPU_VM`'s."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines()
                    if line.strip() and not any(k in line for k in _LIBTPU_OFF_TPU_VM)]
            if kept:
                sys.stderr.write("\n".join(kept) + "\n")
                sys.stderr.flush()


@functools.cache
def _topology_devices(target: Target) -> tuple[jax.Device, ...]:
    from jax.experimental import topologies

    chip = target.chip
    assert chip is not None
    if not compiler_installed(chip.platform):
        raise TargetError(f"target {target.name!r}: no {chip.platform.upper()} compiler "
                          f"installed; pip install -e .[{chip.extra}]")
    if chip.platform == "tpu":
        # libtpu takes a machine-wide lock for the chips it drives; compile-only devices drive
        # none, so other processes (pytest workers, a run beside it) may load it too.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        with _without_libtpu_off_vm_lines():
            topology = topologies.get_topology_desc(platform="tpu", topology_name=target.topology)
    else:
        spec = (XLA_SPECS_DIR / f"{chip.name}_sxm.txtpb").read_text()
        topology = topologies.get_topology_desc(chip.name, platform="cuda", target_config=spec,
                                                topology=target.topology)
    return tuple(topology.devices)


def platform_of(devices: object) -> str:
    """The JAX platform of a mesh's (or a device list's) devices: what CPU-only choices follow,
    never the compiling machine's default backend."""
    flat = getattr(devices, "devices", devices)
    flat = getattr(flat, "flat", flat)
    return next(iter(flat)).platform


def use_cpu_unless_accelerator_attached() -> None:
    """Keeps this process on the CPU backend when no accelerator is attached and the user chose
    no platform (`JAX_PLATFORMS` unset): with libtpu installed (`.[tpu-compile]`), JAX would
    otherwise start the TPU backend in every process, and libtpu logs warnings about the missing
    TPU. Compile-only targets still work (they load their compiler on demand). Must run before JAX
    starts a backend; does nothing afterwards or when a TPU or GPU is attached."""
    if os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms:
        return
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0] or \
            hardware_utils.has_visible_nvidia_gpu() or hardware_utils.num_available_amd_gpus(1):
        return
    jax.config.update("jax_platforms", "cpu")
