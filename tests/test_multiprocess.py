"""Multi-process runs on one machine: two `python -m qurl_jax.main` processes with 4 host CPU
devices each, joined by a loopback coordinator, against one process with 8 devices.

- two processes reach the same metrics and parameters as one process (within 1e-5);
- the two-process checkpoint restores in a one-process run on another mesh and continues like the
  one-process run's own checkpoint (slow);
- a peer killed mid-run makes the survivor exit non-zero within the heartbeat timeout (slow);
plus the pieces that need no second process: cluster detection, flag checks, host-local rows,
URL workdirs.

Failures in a multi-process run are aborts, not exceptions, and a missing peer makes the others
wait: every child gets a `timeout`, the tests check return codes, and every child still alive is
killed by pid when a test ends, passed or not.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from qurl_jax.parallel import distributed as dist
from qurl_jax.parallel.sharding import make_mesh
from qurl_jax.runtime.metrics import MetricWriter, read_metrics
from tests.cli import cli_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEARTBEAT_S = 5
RUN_TIMEOUT_S = 900  # one child's wall-clock limit (a loaded 2-core machine compiles slowly)

# A tiny config over 8 devices: FSDP 4 x tensor 2, so the FSDP axis spans both processes and the
# batch (8 prompts x 4 samples) has 4 shards, 2 per process. Rollouts run 16 rows at a time: the
# two-process run refills its slots (rollout.refill 'auto', RefillSampler), the one-process run
# samples in two chunks of 16 rows (refill off, Sampler); each row must keep its key. The
# entropy bonus gives every step a gradient even when the untrained policy earns no reward.
TINY = ("--config.sft.steps=0", "--config.model.tiny.num_layers=1",
        "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
        "--config.model.tiny.head_dim=16", "--config.data.prompts_per_step=8",
        "--config.rollout.n=4", "--config.rollout.max_new_tokens=4",
        "--config.eval.max_examples=4", "--config.eval.max_new_tokens=4", "--config.eval.k=2",
        "--config.train.progress=False", "--config.train.report_speed=False",
        "--config.rl.entropy_coef=0.05", "--config.optim.learning_rate=3e-3",
        "--config.optim.warmup_steps=0", "--config.train.checkpoint_every=1",
        # Two chunks of 16 rows: 4 rollout replicas of 2 devices (8 one-device replicas would
        # need n x 8 = 32 rows in a chunk, the whole step).
        "--config.rollout.max_concurrent_rows=16", "--config.rollout.tensor=2",
        "--config.train.check_collectives=True")
MESH = ("--config.mesh.fsdp=4", "--config.mesh.tensor=2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Children:
    """Started `qurl_jax.main` processes; `kill_all` ends the live ones by pid."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, workdir: str, *args: str, devices: int, log: str, tiny: bool = True
              ) -> subprocess.Popen:
        env = cli_env(devices, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
        cmd = ["timeout", "-s", "KILL", str(RUN_TIMEOUT_S), sys.executable, "-m", "qurl_jax.main",
               f"--config={REPO}/configs/arith_tiny.py", f"--workdir={workdir}",
               *(TINY if tiny else ()), *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def start_group(self, workdir: str, *args: str, num: int, logs: str, tiny: bool = True
                    ) -> list[subprocess.Popen]:
        port = _free_port()
        return [self.start(workdir, *args, f"--coordinator_address=127.0.0.1:{port}",
                           f"--num_processes={num}", f"--process_id={i}",
                           f"--heartbeat_timeout_s={HEARTBEAT_S}", "--init_timeout_s=120",
                           devices=8 // num, log=f"{logs}.{i}", tiny=tiny)
                for i in range(num)]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: timeout + python
                proc.wait(timeout=30)


def _wait_ok(procs: list[subprocess.Popen], logs: list[str]) -> None:
    for proc, log in zip(procs, logs, strict=True):
        rc = proc.wait(timeout=RUN_TIMEOUT_S + 60)
        assert rc == 0, f"{log}: rc {rc}\n{open(log).read()[-4000:]}"


def _comparable(workdir: str) -> dict[tuple[int, str], float]:
    """Metrics that measure neither time nor compilation, keyed by (step, name) (evaluation rows
    included)."""
    out = {}
    for row in read_metrics(workdir):
        kind = "eval" if any(k.startswith("eval/") for k in row) else "train"
        for k, v in row.items():
            # learner/: each process packs its own rows, so the packed rows depend on the split.
            if (k == "step" or k.startswith(("time/", "compile/", "learner/"))
                    or k == "rollout/tokens_per_s"):
                continue
            out[(row["step"], kind, k)] = float(v)
    return out


def _assert_close_metrics(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    bad = {k: (a[k], b[k]) for k in a if not np.isclose(a[k], b[k], rtol=1e-5, atol=1e-5)}
    assert not bad, bad


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three steps of the tiny config in two processes and in one process (8 devices each),
    both exporting their final policy; yields the two workdirs."""
    root = tmp_path_factory.mktemp("mp")
    children = _Children()
    two, one = str(root / "two"), str(root / "one")
    try:
        start = time.time()
        procs = children.start_group(two, *MESH, "--config.train.num_steps=3",
                                     f"--export_hf={root / 'two_hf'}", num=2, logs=two + ".log")
        single = children.start(one, *MESH, "--config.train.num_steps=3",
                                "--config.rollout.refill=off",
                                f"--export_hf={root / 'one_hf'}", devices=8, log=one + ".log")
        _wait_ok([*procs, single], [two + ".log.0", two + ".log.1", one + ".log"])
        print(f"2-process and 1-process runs: {time.time() - start:.0f} s")
        yield root
    finally:
        children.kill_all()


@pytest.mark.slow  # ~2 min: three CLI runs, two of them in parallel processes
def test_two_processes_match_one_process(runs):
    two, one = _comparable(str(runs / "two")), _comparable(str(runs / "one"))
    assert {s for s, kind, _ in two if kind == "train"} == {1, 2, 3}
    _assert_close_metrics(two, one)
    # The updates changed the policy (an entropy bonus), so equal parameters mean something.
    assert all(one[(s, "train", "update/grad_norm")] > 1e-4 for s in (1, 2, 3))
    assert all(one[(s, "train", "update/skipped")] == 0 for s in (1, 2, 3))
    # Process 1 wrote nothing in the workdir: one metrics file, one summary (process 0's).
    logs = [open(f"{runs / 'two'}.log.{i}").read() for i in range(2)]
    assert "per-step means" in logs[0] and "per-step means" not in logs[1]
    assert "rollout sampler: RefillSampler" in logs[0]  # process 1 logs warnings only
    assert "rollout sampler: Sampler" in open(f"{runs / 'one'}.log").read()
    a, b = load_file(str(runs / "two_hf" / "model.safetensors")), \
        load_file(str(runs / "one_hf" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.slow  # ~2 min: two more runs, LoRA in two processes and in one
def test_lora_in_two_processes_matches_one_process(tmp_path):
    """LoRA on a frozen int8 base across processes: the base placed once on the rollout's
    replicas (rollout.tensor=2 over both processes' devices), the learner reading it there, the
    adapter replicated; the metrics and the exported adapter match one process's."""
    children = _Children()
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    lora = ("--config.model.lora.rank=4", "--config.train.num_steps=2")
    try:
        procs = children.start_group(two, *MESH, *lora, f"--export_hf={tmp_path / 'two_hf'}",
                                     num=2, logs=two + ".log")
        single = children.start(one, *MESH, *lora, "--config.rollout.refill=off",
                                f"--export_hf={tmp_path / 'one_hf'}", devices=8,
                                log=one + ".log")
        _wait_ok([*procs, single], [two + ".log.0", two + ".log.1", one + ".log"])
    finally:
        children.kill_all()
    a, b = _comparable(two), _comparable(one)
    _assert_close_metrics(a, b)
    assert all(b[(s, "train", "update/grad_norm")] > 1e-4 for s in (1, 2))
    assert "LoRA: rank 4" in open(two + ".log.0").read()
    a, b = (load_file(str(tmp_path / d / "lora_adapter" / "adapter_model.safetensors"))
            for d in ("two_hf", "one_hf"))
    assert a.keys() == b.keys() and len(a) == 2 * 7  # one layer: a and b of 7 projections
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-5, err_msg=k)


@pytest.mark.slow  # ~2 min more: a third run, two processes with a paged KV pool
def test_two_processes_with_a_paged_pool_match_one_process(runs):
    # 64 pages of 4 tokens over 4 batch shards: 16 per shard behind 4 slots of rows of up to
    # 48 tokens, so rows wait for pages and are preempted; every process runs the same
    # schedule off the same live flags, and the rollout keeps the static sampler's tokens.
    # (Dropped once for hanging in the learner's minibatch resharding: docs/scaling.md,
    # "Failures".)
    children = _Children()
    paged = str(runs / "two_paged")
    try:
        procs = children.start_group(paged, *MESH, "--config.train.num_steps=3",
                                     "--config.rollout.kv_pages=64",
                                     "--config.rollout.kv_page_size=4", num=2,
                                     logs=paged + ".log")
        _wait_ok(procs, [paged + ".log.0", paged + ".log.1"])
    finally:
        children.kill_all()
    _assert_close_metrics(_comparable(paged), _comparable(str(runs / "one")))
    assert "rollout sampler: RefillSampler" in open(paged + ".log.0").read()


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process_with_another_mesh(runs, tmp_path):
    """Step 4 from the two-process checkpoint (saved on an FSDP 4 x tensor 2 mesh over two
    processes, restored on data 2 x FSDP 2 x tensor 2 in one process) equals step 4 from the
    one-process run's own checkpoint on the same mesh. (4 batch shards: the rollout's 16-row chunks
    hold whole groups of n = 4 on each.)"""
    children = _Children()
    try:
        dirs = {}
        for name in ("two", "one"):
            dirs[name] = str(tmp_path / name)
            shutil.copytree(runs / name, dirs[name])
        procs = [children.start(dirs[name], "--config.mesh.data=2", "--config.mesh.fsdp=2",
                                "--config.mesh.tensor=2", "--config.train.num_steps=4", devices=8,
                                log=dirs[name] + ".log")
                 for name in ("two", "one")]
        _wait_ok(procs, [dirs["two"] + ".log", dirs["one"] + ".log"])
    finally:
        children.kill_all()
    for name in ("two", "one"):
        assert "resumed from step 3" in open(dirs[name] + ".log").read()
    two, one = _comparable(dirs["two"]), _comparable(dirs["one"])
    assert {s for s, kind, _ in two if kind == "train"} == {1, 2, 3, 4}
    _assert_close_metrics({k: v for k, v in two.items() if k[0] == 4},
                          {k: v for k, v in one.items() if k[0] == 4})


@pytest.mark.slow
def test_killed_peer_makes_the_survivor_exit_within_the_heartbeat_timeout(tmp_path):
    children = _Children()
    workdir = str(tmp_path / "run")
    logs = workdir + ".log"
    try:
        survivor, victim = children.start_group(workdir, *MESH, "--config.train.num_steps=50",
                                                num=2, logs=logs)
        deadline = time.time() + RUN_TIMEOUT_S
        while not any("rollout/reward_mean" in r for r in read_metrics(workdir)):
            assert survivor.poll() is None and victim.poll() is None, open(logs + ".0").read()
            assert time.time() < deadline, "no step finished"
            time.sleep(0.5)
        os.killpg(victim.pid, signal.SIGKILL)
        killed = time.time()
        rc = survivor.wait(timeout=HEARTBEAT_S + 120)
        elapsed = time.time() - killed
    finally:
        children.kill_all()
    out = open(logs + ".0").read()
    assert rc != 0, out[-3000:]
    assert elapsed < HEARTBEAT_S + 60, elapsed
    # The coordination service names the lost process (task 1) before the survivor aborts.
    assert re.search(r"stopped sending heartbeats\):\s*1\b", out), out[-3000:]


# --------------------------------------------------------------------- without a second process
def test_detect_cluster_from_the_environment():
    assert dist.detect_cluster({}) is None
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "16",
             "SLURM_PROCID": "3", "SLURM_LOCALID": "3"}
    assert dist.detect_cluster(slurm) == "slurm"
    # sbatch's batch script (no job step yet) is not a cluster to join: no step node list.
    assert dist.detect_cluster({k: v for k, v in slurm.items()
                                if k != "SLURM_STEP_NODELIST"}) is None
    assert dist.detect_cluster({"TPU_WORKER_HOSTNAMES": "w0,w1"}) == "tpu"
    assert dist.detect_cluster({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:1"}) == "ompi"
    xpk = {"JAX_COORDINATOR_ADDRESS": "h0", "JAX_COORDINATOR_PORT": "1234", "NNODES": "2",
           "NODE_RANK": "1"}
    assert dist.detect_cluster(xpk) == "xpk-gpu"
    assert dist.detect_cluster({**xpk, "NNODES": ""}) is None


def test_initialize_checks_its_arguments_and_stays_single_without_a_cluster():
    with pytest.raises(ValueError, match="go together"):
        dist.initialize("127.0.0.1:1234", None, 0)
    with pytest.raises(ValueError, match="HOST:PORT"):
        dist.initialize("127.0.0.1", 2, 0)
    with pytest.raises(ValueError, match="not in"):
        dist.initialize("127.0.0.1:1234", 2, 2)
    assert dist.initialize(environ={}) is False  # nothing detected: a single process
    assert jax.process_count() == 1


def test_bad_distributed_flag_ends_the_run_with_one_line(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", f"--config={REPO}/configs/arith_tiny.py",
         f"--workdir={tmp_path}", "--coordinator_address=localhost", "--num_processes=2",
         "--process_id=0"], cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO),
        capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "qurl_jax: bad flag: --coordinator_address='localhost' is not HOST:PORT" in proc.stderr


def test_host_local_rows_on_one_process():
    mesh = make_mesh(1, jax.device_count(), 1)
    assert dist.row_block(mesh) == (0, 1)
    rows = np.arange(jax.device_count() * 6, dtype=np.float32).reshape(-1, 3)
    batch = dist.global_batch(mesh, {"x": rows})
    np.testing.assert_array_equal(dist.local_rows(batch["x"]), rows)
    assert dist.host_sums({"a": 1.5, "b": 2.0}) == {"a": 1.5, "b": 2.0}
    assert dist.agree_max(7) == 7


def test_metric_writer_on_a_url_workdir_and_disabled():
    url = "memory://qurl-test/run"
    writer = MetricWriter(url, tensorboard=False)
    writer.write(1, {"a": 1.0})
    writer.write(2, {"a": float("nan")})
    writer.close()
    assert [r["step"] for r in read_metrics(url)] == [1, 2]
    resumed = MetricWriter(url, resume_step=1, tensorboard=False)  # drops step 2's row
    resumed.write(2, {"a": 3.0})
    resumed.close()
    assert [(r["step"], r["a"]) for r in read_metrics(url)] == [(1, 1.0), (2, 3.0)]
    off = MetricWriter("memory://qurl-test/off", tensorboard=False, enabled=False)
    off.write(1, {"a": 1.0})
    off.close()
    assert read_metrics("memory://qurl-test/off") == []
