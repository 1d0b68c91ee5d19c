"""Preemption of a two-process run: SIGTERM reaches one process only, and both save a checkpoint
at the same step through JAX's preemption sync point, exit 143, and resume together."""

from __future__ import annotations

import os
import signal
import time

import pytest

from qurl_jax.runtime.metrics import read_metrics
from tests.test_multiprocess import MESH, RUN_TIMEOUT_S, _Children, _free_port, _wait_ok

# Generous: on a loaded machine a 5 s heartbeat can lapse while both processes compile.
HEARTBEAT_S = 60


def _start_group(children: _Children, workdir: str, *args: str, logs: str):
    port = _free_port()
    return [children.start(workdir, *args, f"--coordinator_address=127.0.0.1:{port}",
                           "--num_processes=2", f"--process_id={i}",
                           f"--heartbeat_timeout_s={HEARTBEAT_S}", "--init_timeout_s=120",
                           devices=4, log=f"{logs}.{i}")
            for i in range(2)]


def _python_child(pid: int) -> int:
    """The python process `timeout` runs (the signal must reach it, not `timeout`)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return int(f.read().split()[0])


@pytest.mark.slow  # ~3 min on two loaded cores: two runs of two processes
def test_sigterm_to_one_process_saves_the_same_step_on_both_and_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    logs = str(tmp_path / "log")
    steps = ("--config.train.num_steps=6", "--config.train.checkpoint_every=100")
    children = _Children()
    try:
        procs = _start_group(children, workdir, *MESH, *steps, logs=logs)
        deadline = time.time() + RUN_TIMEOUT_S
        while not any(r.get("step", 0) >= 2 and "rollout/reward_mean" in r
                      for r in read_metrics(workdir)):
            assert time.time() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        os.kill(_python_child(procs[1].pid), signal.SIGTERM)  # process 1 only
        codes = [p.wait(timeout=RUN_TIMEOUT_S) for p in procs]
        out = [open(f"{logs}.{i}").read() for i in range(2)]
        assert codes == [143, 143], [o[-3000:] for o in out]
        line = [x for x in out[0].splitlines() if "preempted at step" in x]
        assert len(line) == 1, out[0][-3000:]
        step = int(line[0].split("preempted at step ")[1].split(";")[0])
        assert 2 <= step < 6
        assert str(step) in os.listdir(os.path.join(workdir, "checkpoints"))

        procs = _start_group(children, workdir, *MESH, *steps, logs=logs + ".resumed")
        _wait_ok(procs, [f"{logs}.resumed.{i}" for i in range(2)])
        assert f"resumed from step {step}" in open(f"{logs}.resumed.0").read()
        rows = [r["step"] for r in read_metrics(workdir) if "rollout/reward_mean" in r]
        assert rows == [1, 2, 3, 4, 5, 6]
    finally:
        children.kill_all()
