"""Preemption: SIGTERM / SIGINT finish the current step, save a checkpoint of it and stop; the
rerun resumes there and reproduces the uninterrupted run's metrics. A second signal aborts at once.

In-process tests drive `Trainer.train` with an installed `PreemptionGuard` and send the signal to
this process from inside a step; the slow ones run the CLI (`python -m qurl_jax.main`) and signal
it from outside, as a scheduler does.
"""

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from qurl_jax.runtime.metrics import read_metrics
from qurl_jax.train.preemption import PreemptionGuard, Stopped
from qurl_jax.train.trainer import Trainer
from tests.cli import cli_env
from tests.test_trainer import REPO, _last_rows, _main, tiny_config


def _trainer(workdir: str, signal_after: int | None = None, signum: int = signal.SIGTERM):
    t = Trainer(tiny_config(**{"train.num_steps": 4, "train.checkpoint_every": 10}), workdir)
    if signal_after is not None:
        step = t.step

        def step_then_signal():
            metrics = step()
            if t.step_count == signal_after:
                os.kill(os.getpid(), signum)  # arrives while the step's caller still runs
            return metrics

        t.step = step_then_signal
    return t


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> str:
    """The uninterrupted run's workdir."""
    full = str(tmp_path_factory.mktemp("full"))
    _trainer(full).train()
    return full


def _stop_after_two_steps(workdir: str, signum: int) -> tuple[dict, PreemptionGuard]:
    guard = PreemptionGuard().install()
    try:
        summary = _trainer(workdir, signal_after=2, signum=signum).train(preemption=guard)
    finally:
        guard.uninstall()
    return summary, guard


@pytest.mark.slow  # ~30 s
def test_sigint_stops_after_the_step_with_a_checkpoint(tmp_path):
    summary, guard = _stop_after_two_steps(str(tmp_path), signal.SIGINT)
    assert summary["stopped"] == "preempted" and summary["preempted"] == 2
    assert guard.exit_code == 130
    assert "2" in os.listdir(os.path.join(str(tmp_path), "checkpoints"))


def test_sigterm_stops_after_the_step_with_a_checkpoint_and_resume_matches(tmp_path, full_run):
    signum = signal.SIGTERM
    full = full_run
    stopped = str(tmp_path / "stopped")
    summary, guard = _stop_after_two_steps(stopped, signum)
    assert summary["stopped"] == "preempted" and summary["preempted"] == 2
    assert guard.signum == signum and guard.exit_code == 128 + signum
    assert "eval_after" not in summary  # no final evaluation: the kill may follow soon
    assert "2" in os.listdir(os.path.join(stopped, "checkpoints"))
    assert max(r["step"] for r in read_metrics(stopped)) == 2

    resumed = _trainer(stopped)
    assert resumed.step_count == 2
    summary = resumed.train()
    # The summary's before-RL column is the step-0 evaluation the first run logged.
    before = {k.removeprefix("eval/"): v for r in read_metrics(full) if r["step"] == 0
              for k, v in r.items() if k.startswith("eval/")}
    assert summary["eval_before"] == pytest.approx(before) and before
    a, b = _last_rows(full), _last_rows(stopped)
    assert sorted(b) == [1, 2, 3, 4]
    for step in (3, 4):
        assert a[step].keys() == b[step].keys()
        for k in a[step]:
            assert a[step][k] == pytest.approx(b[step][k], rel=1e-6, abs=1e-7), (step, k)


def test_second_signal_restores_the_default_action():
    # SIGINT's handler before the guard: Python's default, or SIG_IGN when the test process was
    # started in the background by a non-interactive shell.
    before = signal.getsignal(signal.SIGINT)
    guard = PreemptionGuard().install()
    try:
        with guard.finishing_steps():
            guard._handle(signal.SIGTERM, None)
        assert guard.signum == signal.SIGTERM and guard.reached(7)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # a second one kills at once
        assert signal.getsignal(signal.SIGINT) == guard._handle
    finally:
        guard.uninstall()
    assert signal.getsignal(signal.SIGINT) is before


def test_a_signal_outside_the_step_loop_stops_at_once():
    guard = PreemptionGuard().install()
    try:
        with pytest.raises(Stopped) as e:
            guard._handle(signal.SIGINT, None)
        assert e.value.exit_code == 130 and guard.signum == signal.SIGINT
        assert "SIGINT received outside the step loop" in e.value.line()
        assert "rerun the same command to resume" in e.value.line()
    finally:
        guard.uninstall()


def test_the_listener_ends_a_process_whose_main_thread_is_inside_xla():
    """The interpreter writes the signal to the wakeup fd at once, but runs the Python handler only
    when the main thread next runs Python (not during a compile): here only the byte arrives."""
    exits = []
    guard = PreemptionGuard(stop_grace_s=0.2, exit_fn=exits.append).install()
    try:
        os.write(guard._wakeup[1], bytes([signal.SIGTERM]))
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
        assert exits == [143]
        # Inside the step loop the step is finished instead: no exit.
        with guard.finishing_steps():
            os.write(guard._wakeup[1], bytes([signal.SIGTERM]))
            time.sleep(0.8)
        assert exits == [143]
    finally:
        guard.uninstall()


def test_the_listener_ends_a_process_whose_stopped_was_swallowed():
    """The handler raised `Stopped` but nothing took it (raised inside a finaliser, whose
    exceptions Python prints and drops): the listener ends the process after the grace; once a
    handler says it took it (`caught`), the listener leaves the ending to it."""
    exits = []
    guard = PreemptionGuard(stop_grace_s=0.2, exit_fn=exits.append, caught_grace_s=0.3).install()
    try:
        with contextlib.suppress(Stopped):  # swallowed
            guard._handle(signal.SIGTERM, None)
        os.write(guard._wakeup[1], bytes([signal.SIGTERM]))
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
        assert exits == [143]
        guard.caught()
        os.write(guard._wakeup[1], bytes([signal.SIGTERM]))
        time.sleep(1.0)
        assert exits == [143]
    finally:
        guard.uninstall()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def test_a_signal_during_the_evaluation_before_rl_stops_the_train_call(tmp_path):
    t = Trainer(tiny_config(**{"train.num_steps": 3}), str(tmp_path))
    evaluate = t.evaluate

    def evaluate_then_signal(**kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # arrives while the evaluation runs
        return evaluate(**kwargs)

    t.evaluate = evaluate_then_signal
    guard = PreemptionGuard().install()
    try:
        with pytest.raises(Stopped):
            t.train(preemption=guard)
    finally:
        guard.uninstall()
        t._close()
    assert t.step_count == 0


def test_cli_sigterm_during_the_warm_start_exits_143_in_seconds(tmp_path):
    """A first SIGTERM in the supervised warm start (before the trainer's step loop) used to be
    logged and ignored until the warm start's end."""
    workdir = str(tmp_path / "run")
    proc = _main(workdir, "--config.sft.steps=100000")
    lines = []
    for line in proc.stdout:  # until the warm start runs
        lines.append(line)
        if "supervised warm start:" in line:
            break
    time.sleep(1.0)
    start = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    took = time.monotonic() - start
    out = "".join(lines) + out
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert took < 30, took
    ours = [line for line in out.splitlines() if line.startswith("qurl_jax: ")]
    assert len(ours) == 1 and "SIGTERM received outside the step loop" in ours[0], out[-3000:]
    assert "Traceback" not in out


def _wait_for_step(workdir: str, step: int, proc: subprocess.Popen, limit_s: float = 600) -> None:
    deadline = time.time() + limit_s
    while time.time() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= step and "rollout/reward_mean" in r
               for r in read_metrics(workdir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} never logged")


@pytest.mark.slow  # ~1.5 min: three CLI runs
def test_cli_sigterm_saves_exits_143_and_the_same_command_resumes(tmp_path):
    args = ("--config.train.num_steps=5", "--config.train.checkpoint_every=10")
    full = _main(str(tmp_path / "full"), *args)
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]

    workdir = str(tmp_path / "run")
    proc = _main(workdir, *args)
    _wait_for_step(workdir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 128 + signal.SIGTERM, out[-3000:]
    lines = [line for line in out.splitlines() if "preempted at step" in line]
    assert len(lines) == 1 and "rerun the same command to resume" in lines[0], out[-3000:]
    step = int(lines[0].split("preempted at step ")[1].split(";")[0])
    assert str(step) in os.listdir(os.path.join(workdir, "checkpoints"))
    assert "Traceback" not in out

    resumed = _main(workdir, *args)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert f"resumed from step {step}" in out
    a, b = _last_rows(str(tmp_path / "full")), _last_rows(workdir)
    assert sorted(b) == [1, 2, 3, 4, 5]
    for s in range(step + 1, 6):
        for k in a[s]:
            assert a[s][k] == pytest.approx(b[s][k], rel=1e-6, abs=1e-7), (s, k)


@pytest.mark.slow  # ~40 s: one CLI run
def test_cli_second_sigint_aborts_at_once(tmp_path):
    workdir = str(tmp_path / "run")
    proc = _main(workdir, "--config.train.num_steps=200", "--config.train.checkpoint_every=1000")
    _wait_for_step(workdir, 1, proc)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT), out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out



# Slow: on an idle machine this tiny evaluation can end before the signal (timing-dependent; it
# wants a wait on a line the evaluation prints, not a sleep).
@pytest.mark.slow
def test_cli_ctrl_c_during_evaluate_is_one_line_and_130(tmp_path):
    from tests.test_first_hour import TINY

    workdir = str(tmp_path / "run")
    t = Trainer(tiny_config(**{"sft.steps": 0}), workdir)
    t.step_count = 1  # a checkpoint to evaluate
    t._save(force=True)
    t._close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "qurl_jax.evaluate", "--config=configs/arith_tiny.py",
         f"--workdir={workdir}", *TINY, "--config.eval.max_examples=256",
         "--config.eval.max_new_tokens=64", "--config.rollout.max_new_tokens=64",
         "--config.eval.k=64"],  # an evaluation of minutes: the signal lands inside it
        cwd=REPO, env=cli_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(25)  # past the imports, on a loaded machine too: in the set-up or the evaluation
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    ours = [line for line in out.splitlines() if line.startswith("qurl_jax: ")]
    assert len(ours) == 1 and "SIGINT received during the evaluation" in ours[0], out[-3000:]
    assert not os.path.exists(os.path.join(workdir, "eval"))
