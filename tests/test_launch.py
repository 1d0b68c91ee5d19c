"""Dry runs of the launch scripts in launch/: the printed commands, and errors for missing flags.

Each script prints the commands it would run as "+ cmd arg ..." lines, quoted for a shell; the
tests split them with shlex and check whole arguments. gcloud, sbatch, srun and xpk are shadowed on
PATH by stand-ins that record any call, so a dry run that calls one fails the test.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
CONFIG = "configs/deepscaler_r1_1p5b_int8.py"
TOOLS = ("gcloud", "sbatch", "srun", "xpk")

if not (LAUNCH / "common.sh").exists():  # e.g. a Bazel sandbox without launch/ in its data
    pytest.skip("launch/ is not in this tree", allow_module_level=True)


@pytest.fixture
def sh(tmp_path):
    """Runs a launch script under bash; returns (returncode, commands, stderr)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    calls = tmp_path / "calls"
    for tool in TOOLS:
        stub = fake_bin / tool
        stub.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 97\n')
        stub.chmod(0o755)
    base_env = {k: v for k, v in os.environ.items()
                if not k.startswith("SLURM_") and k not in ("DRY_RUN", "ONE_PROCESS_PER_NODE")}
    base_env.update(PATH=f"{fake_bin}:{os.environ['PATH']}", TMPDIR=str(tmp_path))

    def run(script: str, *args: str, env: dict[str, str] | None = None, cwd: Path = REPO):
        proc = subprocess.run(["bash", str(LAUNCH / script), *args], cwd=cwd,
                              env={**base_env, **(env or {})}, capture_output=True, text=True,
                              timeout=60)
        assert not calls.exists(), f"a dry run called a cluster tool: {calls.read_text()}"
        commands = [shlex.split(line[2:], comments=True) for line in proc.stdout.splitlines()
                    if line.startswith("+ ")]
        return proc.returncode, commands, proc.stderr

    return run


def _flag(argv: list[str], name: str) -> str:
    """The value of --name=VALUE in argv (exactly one)."""
    values = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
    assert len(values) == 1, (name, argv)
    return values[0]


def _remote_words(argv: list[str]) -> list[str]:
    """The words of an ssh/xpk --command=..., as the remote shell splits them."""
    return shlex.split(_flag(argv, "command"))


TPU_ARGS = ["--project=my-proj", "--zone=us-east5-a", "--accelerator-type=v5p-32",
            "--bucket=gs://my-bucket/qurl/", "--run-name=grpo-int8", f"--config={CONFIG}"]


# ------------------------------------------------------------------------------------- TPU VM
def test_tpu_vm_dry_run_creates_installs_and_runs_on_every_worker(sh):
    rc, cmds, err = sh("tpu_vm.sh", "--dry-run", *TPU_ARGS, "--capacity=spot", "--",
                       "--config.rl.loss_mode=tis", "--config.model.path=gs://my-bucket/m")
    assert rc == 0, err
    create, archive, scp, setup, main = cmds
    assert create[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "create"]
    assert create[5] == "grpo-int8"
    assert {"--zone=us-east5-a", "--project=my-proj", "--accelerator-type=v5p-32",
            "--version=v2-alpha-tpuv5", "--spot"} <= set(create)
    assert archive[:2] == ["git", "-C"] and "HEAD" in archive
    assert scp[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "scp"] and "--worker=all" in scp
    assert setup[:5] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh"] and "--worker=all" in setup
    assert "--accelerator=tpu" in _remote_words(setup)
    assert main[:6] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "grpo-int8"]
    assert {"--worker=all", "--zone=us-east5-a", "--project=my-proj"} <= set(main)
    words = _remote_words(main)
    start = words.index("qurl_jax.main")
    assert words[start - 1] == "-m"
    assert words[start + 1:] == [f"--config={CONFIG}", "--workdir=gs://my-bucket/qurl/grpo-int8",
                                 "--config.rl.loss_mode=tis",
                                 "--config.model.path=gs://my-bucket/m"]


def test_tpu_vm_queued_reserved_request_waits_for_active(sh):
    rc, cmds, err = sh("tpu_vm.sh", *TPU_ARGS, "--queued", "--capacity=reserved",
                       "--valid-until=6h", "--skip-setup", "--detach", env={"DRY_RUN": "1"})
    assert rc == 0, err
    create, wait, main = cmds
    assert create[:5] == ["gcloud", "compute", "tpus", "queued-resources", "create"]
    assert {"--node-id=grpo-int8", "--accelerator-type=v5p-32",
            "--runtime-version=v2-alpha-tpuv5", "--reserved", "--valid-until-duration=6h"} \
        <= set(create)
    assert "--spot" not in create
    assert wait[3:5] == ["queued-resources", "describe"]
    assert "--format=value(state.state)" in wait
    remote = _flag(main, "command")
    assert "nohup" in remote and remote.rstrip().endswith("&")
    assert "--workdir=gs://my-bucket/qurl/grpo-int8" in remote


@pytest.mark.parametrize("accelerator,version", [
    ("v4-32", "tpu-ubuntu2204-base"), ("v5litepod-16", "v2-alpha-tpuv5-lite"),
    ("v5p-128", "v2-alpha-tpuv5"), ("v6e-8", "v2-alpha-tpuv6e")])
def test_tpu_vm_runtime_version_follows_accelerator(sh, accelerator, version):
    args = [a for a in TPU_ARGS if not a.startswith("--accelerator-type")]
    rc, cmds, err = sh("tpu_vm.sh", "--dry-run", *args, f"--accelerator-type={accelerator}")
    assert rc == 0, err
    assert f"--version={version}" in cmds[0]
    assert not {"--spot", "--reserved"} & set(cmds[0])  # on-demand by default


def test_tpu_vm_rejects_tpu7x_and_points_to_gke(sh):
    args = [a for a in TPU_ARGS if not a.startswith("--accelerator-type")]
    rc, cmds, err = sh("tpu_vm.sh", "--dry-run", *args, "--accelerator-type=tpu7x-64")
    assert rc != 0 and not cmds
    assert "xpk.sh" in err


# ---------------------------------------------------------------------------------------- SLURM
SLURM_JOB_ENV = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8",
                 "SLURM_SUBMIT_DIR": str(REPO), "SLURM_NTASKS": "16", "DRY_RUN": "1"}


def test_slurm_outside_a_job_submits_itself_with_sbatch(sh, tmp_path):
    rc, cmds, err = sh("gpu_slurm.sbatch", "--dry-run", f"--config={CONFIG}",
                       "--workdir=/shared/runs/a", "--nodes=4", "--partition=gpu", "--",
                       "--config.train.num_steps=10", cwd=tmp_path)
    assert rc == 0, err
    (sbatch,) = cmds
    assert sbatch[0] == "sbatch"
    assert {"--nodes=4", "--gpus-per-node=8", "--ntasks-per-node=8", f"--chdir={REPO}",
            "--partition=gpu"} <= set(sbatch)
    script = sbatch.index(str(LAUNCH / "gpu_slurm.sbatch"))
    # The job gets the same arguments, less --dry-run.
    assert sbatch[script + 1:] == [f"--config={CONFIG}", "--workdir=/shared/runs/a", "--nodes=4",
                                   "--partition=gpu", "--", "--config.train.num_steps=10"]


def test_slurm_job_runs_one_process_per_gpu(sh):
    rc, cmds, err = sh("gpu_slurm.sbatch", f"--config={CONFIG}", "--workdir=/shared/runs/a",
                       "--", "--config.rl.loss_mode=tis", env=SLURM_JOB_ENV)
    assert rc == 0, err
    (srun,) = cmds
    assert srun[0] == "srun"
    assert {"--nodes=2", "--ntasks=16", "--ntasks-per-node=8", "--kill-on-bad-exit=1"} <= set(srun)
    main = srun[srun.index("-m"):]
    assert main == ["-m", "qurl_jax.main", f"--config={CONFIG}", "--workdir=/shared/runs/a",
                    "--config.rl.loss_mode=tis"]
    assert "JAX_LOCAL_DEVICE_IDS" not in " ".join(" ".join(c) for c in cmds)
    assert not any(a.startswith(("--coordinator_address", "--process_id")) for a in srun)


@pytest.mark.parametrize("switch", ["flag", "env"])
def test_slurm_job_one_process_per_node_sets_local_device_ids(sh, switch):
    args = ["--one-process-per-node"] if switch == "flag" else []
    env = {**SLURM_JOB_ENV, "SLURM_GPUS_ON_NODE": "4"}
    if switch == "env":
        env["ONE_PROCESS_PER_NODE"] = "1"
    rc, cmds, err = sh("gpu_slurm.sbatch", *args, f"--config={CONFIG}", "--workdir=gs://b/a",
                       env=env)
    assert rc == 0, err
    export, srun = cmds
    assert export == ["export", "JAX_LOCAL_DEVICE_IDS=0,1,2,3"]
    assert {"--nodes=2", "--ntasks=2", "--ntasks-per-node=1"} <= set(srun)
    assert srun[-3:] == ["qurl_jax.main", f"--config={CONFIG}", "--workdir=gs://b/a"]


# ------------------------------------------------------------------------------------------ xpk
XPK_ARGS = ["--cluster=my-gke", "--project=my-proj", "--zone=us-east5-a",
            "--bucket=my-bucket", "--run-name=grpo-int8", f"--config={CONFIG}"]


def test_xpk_tpu_workload_with_slices_and_cluster_create(sh):
    rc, cmds, err = sh("xpk.sh", "--dry-run", *XPK_ARGS, "--tpu-type=v5p-128", "--num-slices=2",
                       "--create-cluster", "--capacity=spot", "--", "--config.rl.loss_mode=tis")
    assert rc == 0, err
    cluster, workload = cmds
    assert cluster[:3] == ["xpk", "cluster", "create"]
    assert {"--cluster=my-gke", "--tpu-type=v5p-128", "--num-slices=2", "--spot"} <= set(cluster)
    assert workload[:3] == ["xpk", "workload", "create"]
    assert {"--cluster=my-gke", "--project=my-proj", "--zone=us-east5-a", "--workload=grpo-int8",
            "--tpu-type=v5p-128", "--num-slices=2", "--base-docker-image=python:3.11",
            f"--script-dir={REPO}"} <= set(workload)
    words = _remote_words(workload)
    assert words[:3] == ["bash", "launch/install.sh", "--accelerator=tpu"]
    main = words[words.index("qurl_jax.main") + 1:]
    assert main == [f"--config={CONFIG}", "--workdir=gs://my-bucket/grpo-int8",
                    "--config.rl.loss_mode=tis"]


def test_xpk_gpu_workload_passes_coordinator_from_pod_env(sh):
    rc, cmds, err = sh("xpk.sh", "--dry-run", *XPK_ARGS, "--device-type=h100-80gb-8",
                       "--num-nodes=4", "--docker-image=gcr.io/my-proj/qurl:1")
    assert rc == 0, err
    (workload,) = cmds
    assert {"--device-type=h100-80gb-8", "--num-nodes=4", "--docker-image=gcr.io/my-proj/qurl:1"} \
        <= set(workload)
    assert not any(a.startswith(("--tpu-type", "--num-slices", "--base-docker-image"))
                   for a in workload)
    words = _remote_words(workload)
    assert words[:3] == ["python3", "-m", "qurl_jax.main"]
    # Left for the pod's shell to expand.
    assert "--coordinator_address=${JAX_COORDINATOR_ADDRESS}:${JAX_COORDINATOR_PORT}" in words
    assert "--num_processes=${NNODES}" in words and "--process_id=${NODE_RANK}" in words


def test_xpk_reserved_cluster_needs_a_reservation(sh):
    rc, cmds, err = sh("xpk.sh", "--dry-run", *XPK_ARGS, "--tpu-type=v5p-128",
                       "--create-cluster", "--capacity=reserved")
    assert rc != 0 and not cmds and "--reservation" in err
    rc, cmds, err = sh("xpk.sh", "--dry-run", *XPK_ARGS, "--tpu-type=v5p-128",
                       "--create-cluster", "--capacity=reserved", "--reservation=my-res")
    assert rc == 0, err
    assert "--reservation=my-res" in cmds[0]


# ---------------------------------------------------------------------------- missing flags
@pytest.mark.parametrize("script,args,flag", [
    *[("tpu_vm.sh", TPU_ARGS, f.split("=")[0]) for f in TPU_ARGS],
    *[("xpk.sh", [*XPK_ARGS, "--tpu-type=v5p-8"], f.split("=")[0]) for f in XPK_ARGS],
    ("xpk.sh", [*XPK_ARGS, "--device-type=h100-80gb-8", "--num-nodes=2"], "--num-nodes"),
    ("xpk.sh", [*XPK_ARGS, "--tpu-type=v5p-8"], "--tpu-type"),
    ("gpu_slurm.sbatch", [f"--config={CONFIG}", "--workdir=/shared/a"], "--config"),
    ("gpu_slurm.sbatch", [f"--config={CONFIG}", "--workdir=/shared/a"], "--workdir"),
])
def test_missing_required_flag_fails_naming_it(sh, script, args, flag):
    kept = [a for a in args if a.split("=")[0] != flag]
    rc, cmds, err = sh(script, "--dry-run", *kept)
    assert rc == 2 and not cmds
    assert re.search(rf"missing required flag\(s\):.*{re.escape(flag)}\b", err), err


def test_unknown_flag_and_flag_without_value_fail(sh):
    rc, _, err = sh("tpu_vm.sh", "--dry-run", *TPU_ARGS, "--zonee=x")
    assert rc == 2 and "--zonee" in err
    rc, _, err = sh("xpk.sh", "--dry-run", *XPK_ARGS, "--tpu-type")
    assert rc == 2 and "--tpu-type needs a value" in err


# --------------------------------------------------------------------------------- install, lint
def test_install_matches_the_pinned_jax_and_skips_test_only_pins(sh):
    jax_pin = re.search(r"^jax==(\S+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    rc, cmds, err = sh("install.sh", "--dry-run", "--accelerator=tpu", "--venv=/opt/v")
    assert rc == 0, err
    pip = [c for c in cmds if c[:4] == ["/opt/v/bin/python", "-m", "pip", "install"]]
    assert [f"jax[tpu]=={jax_pin}" in c for c in pip] == [False, False, True, False]
    assert pip[-1][-3:] == ["--no-deps", "-e", "."]
    path = pip[1][pip[1].index("-r") + 1]
    assert not Path(path).exists()  # a dry run writes nothing: it says what it would
    requirements = _would_write(err, path)
    assert f"jax=={jax_pin}" in requirements and "torch==" not in requirements


def _would_write(stderr: str, path: str) -> list[str]:
    """The lines a dry run says it would write to `path` (each indented under its header)."""
    lines = stderr.splitlines()
    header = [i for i, line in enumerate(lines) if line.endswith(f"would write {path}:")]
    assert len(header) == 1, stderr
    out = []
    for line in lines[header[0] + 1:]:
        if not line.startswith("    "):
            break
        out.append(line[4:])
    return out


def test_dry_runs_write_nothing(sh, tmp_path):
    dest = tmp_path / "wheels"
    before = sorted(tmp_path.iterdir())  # TMPDIR is tmp_path
    rc, _, err = sh("install.sh", "--dry-run", "--accelerator=cpu", f"--venv={tmp_path}/v")
    assert rc == 0, err
    rc, _, err = sh("accelerator_wheels.sh", "--dry-run", f"--dest={dest}", "--with-jax=tpu",
                    "--with-torch", "--python=3.12")
    assert rc == 0, err
    assert sorted(tmp_path.iterdir()) == before
    assert "jax[tpu]==" in _would_write(err, f"{dest}/requirements.txt")[-1]
    assert [line.split("==")[0] for line in _would_write(err, f"{dest}/constraints.txt")] == [
        "jax", "jaxlib"]
    assert f"would append {dest}/requirements.txt:\n    torch==" in err


def test_scripts_are_shellcheck_clean():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed")
    scripts = sorted(str(p.relative_to(REPO)) for p in LAUNCH.iterdir()
                     if p.suffix in (".sh", ".sbatch"))
    proc = subprocess.run(["shellcheck", "-x", *scripts], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout


def test_accelerator_wheels_downloads_each_python_and_keeps_the_hosts_jax(sh):
    rc, cmds, err = sh("accelerator_wheels.sh", "--dry-run", "--dest=/w", "--python=3.12,3.11")
    assert rc == 0, err
    downloads = [c for c in cmds if c[:4] == ["python3", "-m", "pip", "download"]]
    assert [_value(c, "--python-version") for c in downloads] == ["3.12", "3.11"]
    for c in downloads:
        assert "--only-binary=:all:" in c and _value(c, "-r") == "/w/requirements.txt"
        assert "manylinux2014_x86_64" in c
    assert cmds[-1][:2] == ["find", "/w"] and "jaxlib-*.whl" in cmds[-1]  # the host keeps its JAX
    rc, cmds, err = sh("accelerator_wheels.sh", "--dry-run", "--dest=/w", "--with-jax=cuda12",
                       "--with-torch", "--python=3.12")
    assert rc == 0, err
    assert not any(c[0] == "find" for c in cmds)
    torch = [c for c in cmds if any(a.startswith("torch==") for a in c)]
    assert len(torch) == 1 and _value(torch[0], "--index-url").endswith("/whl/cpu")
    rc, _, err = sh("accelerator_wheels.sh", "--dry-run", "--dest=/w", "--with-jax=rocm")
    assert rc == 2 and "--with-jax: 'rocm' is not one of" in err


def _value(argv: list[str], flag: str) -> str:
    """The word after `flag` in argv (exactly one occurrence)."""
    assert argv.count(flag) == 1, (flag, argv)
    return argv[argv.index(flag) + 1]
