"""Two-process runs that used to hang, and the two guards against hangs (docs/scaling.md,
"Failures"): `train.check_collectives` names a program one process dispatched and the other did
not, and the stall watchdog turns a collective one process never reaches into an exit with stacks.

All slow (minutes each on two loaded cores). Every child has a `timeout`, and every child still
alive is killed by pid when a test ends (`tests.test_multiprocess._Children`).
"""

from __future__ import annotations

import os
import re

import pytest

from qurl_jax.parallel.program_check import EXIT_MISMATCH, HOOK_ENV
from qurl_jax.runtime.metrics import read_metrics
from qurl_jax.runtime.watchdog import EXIT_STALL
from tests import test_multiprocess
from tests.test_multiprocess import MESH, _Children, _wait_ok

# The issue's command: the arithmetic demo after 100 warm-start steps, FSDP over both processes'
# 8 devices, 32 rows at a time (the before-RL evaluation runs 32 static chunks, the rollout
# refills 32 slots).
ISSUE = ("--config.sft.steps=100", "--config.train.num_steps=2", "--config.mesh.fsdp=8",
         "--config.mesh.data=1", "--config.mesh.tensor=1",
         "--config.rollout.max_concurrent_rows=32", "--config.train.check_collectives=True",
         "--config.train.progress=False")
# A paged pool that preempts, DAPO's extra rounds and two minibatches (the issue's third config).
PAGED_DAPO = ("--config.rollout.kv_pages=96", "--config.rollout.kv_page_size=4",
              "--config.rollout.kv_watermark_pages=0", "--config.rl.dynamic_sampling=True",
              "--config.rl.num_minibatches=2")


def _group(children: _Children, workdir: str, *args: str, env: dict | None = None):
    """Two processes (4 devices each) of `qurl_jax.main` with the tiny test config."""
    saved = dict(os.environ)
    os.environ.update(env or {})
    try:
        return children.start_group(workdir, *args, num=2, logs=workdir + ".log")
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.slow  # ~12 min on two loaded cores (256 problems evaluated twice, a speed report)
def test_the_issue_command_with_concurrent_rows_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(test_multiprocess, "RUN_TIMEOUT_S", 1800)
    children = _Children()
    workdir = str(tmp_path / "run")
    try:
        procs = children.start_group(workdir, *ISSUE, num=2, logs=workdir + ".log", tiny=False)
        _wait_ok(procs, [workdir + ".log.0", workdir + ".log.1"])
    finally:
        children.kill_all()
    assert [r["step"] for r in read_metrics(workdir) if "rollout/reward_mean" in r] == [1, 2]
    assert "rollout sampler: RefillSampler, 32 concurrent rows" in open(workdir + ".log.0").read()


@pytest.mark.slow  # ~4 min
def test_paged_pool_with_dapo_and_minibatches_finishes(tmp_path):
    children = _Children()
    workdir = str(tmp_path / "run")
    try:
        procs = _group(children, workdir, *MESH, *PAGED_DAPO, "--config.train.num_steps=3")
        _wait_ok(procs, [workdir + ".log.0", workdir + ".log.1"])
    finally:
        children.kill_all()
    rows = [r for r in read_metrics(workdir) if "rollout/reward_mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]


@pytest.mark.slow  # ~3 min
def test_an_extra_program_on_one_process_is_named_by_the_check_in_its_step(tmp_path):
    children = _Children()
    workdir = str(tmp_path / "run")
    try:
        procs = _group(children, workdir, *MESH, "--config.train.num_steps=4",
                       env={HOOK_ENV: "extra:1:2"})
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        children.kill_all()
    logs = [open(f"{workdir}.log.{i}").read() for i in range(2)]
    # Both stop on the same finding; process 1 may lose the coordinator (process 0) first.
    assert codes[0] == EXIT_MISMATCH and codes[1] != 0, [x[-3000:] for x in logs]
    lines = [x for x in logs[0].splitlines() if x.startswith("qurl_jax: check_collectives")]
    assert len(lines) == 1, logs[0][-3000:]
    assert "step 2: the processes dispatched different programs" in lines[0]
    assert re.search(r"process 1 ran test_hook_extra_program\(np.int32\[\]\)", lines[0])
    assert "process 0 ran (nothing)" in lines[0]
    # Caught in the step it happened: step 1 is the last finished.
    assert max(r["step"] for r in read_metrics(workdir) if "rollout/reward_mean" in r) == 2


@pytest.mark.slow  # ~4 min
def test_a_process_that_never_reaches_a_collective_is_caught_by_the_watchdog(tmp_path):
    """Process 1 never reaches step 2's program check (a collective), so process 0 waits in it;
    both stall watchdogs fire within the 45 s limit: stacks written, one line, exit 75."""
    children = _Children()
    workdir = str(tmp_path / "run")
    timeout_s = 45
    try:
        procs = _group(children, workdir, *MESH, "--config.train.num_steps=6",
                       f"--config.train.stall_timeout_s={timeout_s}",
                       env={HOOK_ENV: "hang:1:2"})
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        children.kill_all()
    logs = [open(f"{workdir}.log.{i}").read() for i in range(2)]
    # Process 0 waits in step 2's check; process 1 sleeps in it. Either may instead see its peer
    # gone first (the coordination service aborts it) once the other exited.
    assert EXIT_STALL in codes and all(c != 0 for c in codes), [x[-3000:] for x in logs]
    for i, (code, log) in enumerate(zip(codes, logs, strict=True)):
        if code != EXIT_STALL:
            continue
        line = [x for x in log.splitlines()
                if "stalled: step 2, phase 'check_collectives'" in x]
        assert len(line) == 1, log[-3000:]
        assert f"stall-{i}.txt" in line[0]
        assert float(re.search(r"ran (\d+) s", line[0]).group(1)) < timeout_s + 10
        stacks = open(os.path.join(workdir, f"stall-{i}.txt")).read()
        assert "in compare" in stacks, stacks[-3000:]
    if codes[0] == EXIT_STALL:  # the process that waited inside the collective
        assert "process_allgather" in open(os.path.join(workdir, "stall-0.txt")).read()


@pytest.mark.slow  # ~30 min per round on two loaded cores (7 configurations)
def test_soak(tmp_path):
    """`tests/multiprocess_soak.py`: every two-process configuration QURL_JAX_SOAK_RUNS times
    (default 1; the soak's figures in docs/scaling.md come from its command), no hang."""
    from tests import multiprocess_soak

    runs = int(os.environ.get("QURL_JAX_SOAK_RUNS", "1"))
    results = multiprocess_soak.soak(list(multiprocess_soak.CONFIGS), runs, 0, str(tmp_path),
                                     900.0)
    print(multiprocess_soak.table(results))
    assert [r for r in results if r.outcome != "ok"] == []
