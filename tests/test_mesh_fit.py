"""Meshes that fit the run's devices: -1 takes the rest, a smaller mesh takes the same number of
devices from every process and warns with the count left idle, and a mesh that cannot fit fails
in one line naming the mesh, devices and processes, before anything starts."""

import dataclasses
import os
import subprocess
import sys

import jax
import pytest
from absl import logging

from qurl_jax.parallel import sharding as shd
from qurl_jax.runtime.errors import MeshError
from tests.cli import cli_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class _FakeDevice:
    id: int
    process_index: int


def _devices(processes: int, per_process: int) -> list[_FakeDevice]:
    return [_FakeDevice(p * per_process + i, p) for p in range(processes)
            for i in range(per_process)]


@pytest.mark.parametrize("sizes, devices, expected", [
    (dict(data=1, fsdp=-1, tensor=1), 8, dict(data=1, fsdp=8, tensor=1)),
    (dict(data=1, fsdp=-1, tensor=2), 16, dict(data=1, fsdp=8, tensor=2)),
    (dict(data=-1, fsdp=4, tensor=1), 8, dict(data=2, fsdp=4, tensor=1)),
    (dict(data=1, fsdp=2, tensor=1), 8, dict(data=1, fsdp=2, tensor=1)),
])
def test_minus_one_takes_the_remaining_devices(sizes, devices, expected):
    assert shd.mesh_shape(sizes, devices) == expected


def test_dcn_multiplies_the_axis_and_minus_one_is_per_slice():
    # 2 x v5p-128 (64 chips each): data over the two slices, FSDP over each slice's chips.
    assert shd.mesh_shape(dict(data=1, fsdp=-1, tensor=1), 128, dict(data=2, fsdp=1, tensor=1)) \
        == dict(data=2, fsdp=64, tensor=1)


@pytest.mark.parametrize("sizes, devices, dcn, message", [
    (dict(data=1, fsdp=4, tensor=1), 1, None, "needs 4 devices but the run has 1"),
    (dict(data=1, fsdp=-1, tensor=3), 8, None, "do not divide the 8 devices"),
    (dict(data=-1, fsdp=-1, tensor=1), 8, None, "at most one axis may be -1"),
    (dict(data=1, fsdp=1, tensor=1), 8, dict(data=3, fsdp=1, tensor=1), "3 slices"),
])
def test_impossible_meshes_fail_naming_mesh_and_devices(sizes, devices, dcn, message):
    with pytest.raises(MeshError, match=message):
        if "needs" in message:
            shd._pick(_devices(1, devices), 4, sizes)
        else:
            shd.mesh_shape(sizes, devices, dcn)


def test_smaller_mesh_takes_the_same_share_of_every_process():
    # 2 processes x 4 devices, mesh.fsdp=4: two devices of each, so no process is left out.
    picked = shd._pick(_devices(2, 4), 4, dict(data=1, fsdp=4, tensor=1))
    assert [(d.process_index, d.id) for d in picked] == [(0, 0), (0, 1), (1, 4), (1, 5)]
    with pytest.raises(MeshError, match="2 processes"):
        shd._pick(_devices(2, 4), 3, dict(data=1, fsdp=3, tensor=1))
    with pytest.raises(MeshError, match="8 devices on 2 processes"):
        shd._pick(_devices(2, 4), 16, dict(data=1, fsdp=16, tensor=1))


def test_idle_devices_warn_once_with_the_count(monkeypatch):
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    mesh = shd.mesh_from_config(dict(data=1, fsdp=2, tensor=1))
    assert mesh.size == 2 and len(warnings) == 1
    assert f"{jax.device_count() - 2} idle" in warnings[0]
    warnings.clear()
    assert shd.mesh_from_config(dict(data=1, fsdp=-1, tensor=1)).size == jax.device_count()
    assert not warnings


def test_dcn_without_slices_or_processes_fails_in_one_line():
    with pytest.raises(MeshError, match="mesh.dcn"):
        shd.make_mesh(1, -1, 1, dcn=dict(data=2, fsdp=1, tensor=1))


def _on_16_host_devices(code: str) -> subprocess.CompletedProcess:
    """Runs `code` in a Python process that sees 16 host CPU devices; it must succeed."""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=cli_env(16),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out


def test_sixteen_devices_and_fsdp_minus_one_run_as_written():
    # A launch example on a machine with more devices than the config's fixed mesh: fsdp=-1 spans
    # every device, and each batch block maps to the single process.
    code = ("from qurl_jax.parallel import distributed, sharding\n"
            "from qurl_jax.config.base import load_config_file\n"
            "c = load_config_file('configs/arith_tiny.py')\n"
            "c.unlock(); c.mesh.fsdp = -1\n"
            "m = sharding.mesh_from_config(c.mesh)\n"
            "print(dict(m.shape), distributed.row_block(m))\n")
    out = _on_16_host_devices(code)
    assert "{'data': 1, 'fsdp': 16, 'tensor': 1} (0, 1)" in out.stdout


def test_paper_configs_take_every_device_of_their_slice():
    # The paper configs say fsdp=-1: on 16 devices the 1.5B config spans all 16 and the 7B config
    # splits them 8 (fsdp) x 2 (tensor); a cpu memory plan of either runs on the devices the
    # config was sized for.
    from qurl_jax.bench.paged import host_devices_for
    from qurl_jax.config.base import load_config_file

    sized_for = {"deepscaler_r1_1p5b_int8": 8, "jetrl_r1_1p5b_fp8_block": 8,
                 "dapo_qwen2p5_7b_fp8": 16}
    for name, devices in sized_for.items():
        c = load_config_file(f"{REPO}/configs/{name}.py")
        assert c.mesh.fsdp == -1, name
        assert host_devices_for(c.mesh) == devices, name
    code = ("from qurl_jax.parallel import sharding\n"
            "from qurl_jax.config.base import load_config_file\n"
            "for n in ('deepscaler_r1_1p5b_int8', 'dapo_qwen2p5_7b_fp8'):\n"
            "    print(n, dict(sharding.mesh_from_config(load_config_file(f'configs/{n}.py').mesh)"
            ".shape))\n")
    out = _on_16_host_devices(code)
    assert "deepscaler_r1_1p5b_int8 {'data': 1, 'fsdp': 16, 'tensor': 1}" in out.stdout
    assert "dapo_qwen2p5_7b_fp8 {'data': 1, 'fsdp': 8, 'tensor': 2}" in out.stdout
