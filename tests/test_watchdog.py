"""The stall watchdog (`qurl_jax.runtime.watchdog`) and the program recorder of
`train.check_collectives` (`qurl_jax.parallel.program_check`), in one process; their two-process
behaviour is in tests/test_multiprocess_hangs.py."""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.parallel import program_check
from qurl_jax.runtime.metrics import PhaseTimer
from qurl_jax.runtime.watchdog import EXIT_STALL, StallWatchdog, for_run


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _watchdog(tmp_path, **kwargs) -> tuple[StallWatchdog, _Clock, list[int]]:
    clock, exits = _Clock(), []
    wd = StallWatchdog(str(tmp_path), 1, clock=clock, exit_fn=exits.append, **kwargs)
    return wd, clock, exits


def test_limit_is_the_first_step_limit_then_ten_times_the_slowest_phase_with_a_floor(tmp_path):
    wd, clock, exits = _watchdog(tmp_path, floor_s=60.0, first_step_s=900.0)
    assert wd.check() is None  # not armed before the first phase
    timer = PhaseTimer(wd)
    with timer.phase("rollout"):
        assert wd.limit_s() == 900.0
        clock.now += 500.0  # the first step compiles: slow, not counted
    wd.step_done(1)
    assert wd.limit_s() == 60.0
    with timer.phase("rollout"):
        clock.now += 20.0
    assert wd.limit_s() == 200.0 and wd.phase == "after rollout"
    clock.now += 199.0
    assert wd.check() is None and not exits
    fixed, _, _ = _watchdog(tmp_path, timeout_s=5.0)
    fixed.enter("update")
    assert fixed.limit_s() == 1800.0  # the first step compiles
    fixed.step_done(1)
    assert fixed.limit_s() == 5.0
    with pytest.raises(ValueError, match="timeout_s"):
        StallWatchdog(str(tmp_path), timeout_s=0.0)


def test_a_stalled_phase_writes_the_stacks_and_exits_75_with_one_line(tmp_path):
    wd, clock, exits = _watchdog(tmp_path, timeout_s=30.0)
    wd.step_done(3)
    wd.enter("update")
    clock.now += 31.0
    line = wd.check()
    assert exits == [EXIT_STALL]
    assert "step 4, phase 'update'" in line and "stall-1.txt" in line and "exiting 75" in line
    text = open(tmp_path / "stall-1.txt").read()
    assert text.startswith("process 1: stalled in step 4, phase 'update'")
    assert "test_a_stalled_phase_writes_the_stacks" in text  # this thread's stack is in it
    assert wd.check() == line and exits == [EXIT_STALL]  # fires once


def test_sigterm_without_a_step_end_within_the_grace_is_a_stall(tmp_path):
    wd, clock, exits = _watchdog(tmp_path, timeout_s=1e6, sigterm_grace_s=60.0)
    wd.step_done(1)
    wd.enter("rollout")
    wd.note_sigterm()
    clock.now += 59.0
    assert wd.check() is None
    wd.step_done(2)  # the step ended: the preemption check takes it from here
    clock.now += 120.0
    assert wd.check() is None
    wd.enter("rollout")
    wd.note_sigterm()
    clock.now += 119.0  # step 2 took 59 s: the grace is 118 s
    assert "SIGTERM 119 s ago and no step end (grace 118 s)" in wd.check()
    assert exits == [EXIT_STALL]
    # Steps longer than half the grace stretch it to twice the slowest step.
    slow, clock, exits = _watchdog(tmp_path, timeout_s=1e6, sigterm_grace_s=60.0)
    slow.step_done(1)
    clock.now += 100.0
    slow.step_done(2)
    slow.note_sigterm()
    clock.now += 199.0
    assert slow.grace_s() == 200.0 and slow.check() is None
    clock.now += 2.0
    assert "grace 200 s" in slow.check() and exits == [EXIT_STALL]


def test_the_thread_sees_a_sigterm_while_the_main_thread_is_busy(tmp_path):
    """The signal arrives while the main thread does not return to the interpreter (as inside
    XLA): the wakeup fd carries it to the watchdog's thread."""
    fired = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    wd = StallWatchdog(str(tmp_path), 0, timeout_s=1e6, sigterm_grace_s=0.5, poll_s=0.05,
                       exit_fn=lambda code: fired.set()).start()
    try:
        wd.enter("rollout")
        os.kill(os.getpid(), signal.SIGTERM)
        assert fired.wait(10.0), "the watchdog did not fire"
        assert "SIGTERM" in wd.fired and os.path.exists(tmp_path / "stall-0.txt")
    finally:
        wd.stop()
        signal.signal(signal.SIGTERM, previous)


def test_for_run_is_on_in_multi_process_runs_or_with_a_limit(tmp_path):
    assert for_run(0.0, str(tmp_path), 1, 0) is None
    assert for_run(-1.0, str(tmp_path), 2, 0) is None
    wd = for_run(0.0, str(tmp_path), 2, 1)
    try:
        assert wd is not None and wd.timeout_s is None and wd.process == 1
    finally:
        wd.stop()


def test_phase_marks_cost_microseconds(tmp_path):
    """The trainer's cost: two marks per phase, a handful of phases per step."""
    wd = StallWatchdog(str(tmp_path), 0, timeout_s=1e6, exit_fn=lambda code: None)
    timer = PhaseTimer(wd)
    bare = PhaseTimer()
    n = 20000
    start = time.perf_counter()
    for _ in range(n):
        with timer.phase("x"):
            pass
    watched = (time.perf_counter() - start) / n
    start = time.perf_counter()
    for _ in range(n):
        with bare.phase("x"):
            pass
    unwatched = (time.perf_counter() - start) / n
    print(f"phase with watchdog {watched * 1e6:.2f} us, without {unwatched * 1e6:.2f} us")
    assert watched - unwatched < 100e-6  # a step's ~6 phases: < 1 ms, against steps of seconds


def test_program_log_records_jitted_calls_with_shapes_and_shardings():
    log = program_check.install()
    try:
        def double(x):
            return 2 * x

        f = jax.jit(double)
        log.take()
        f(jnp.ones((3, 2), jnp.float32))
        f(np.ones((4,), np.int32))
        g = jax.jit(lambda x, flag: x, static_argnums=1)
        g(jnp.ones(2), True)
        records = log.take()
        assert records[0].startswith("test_program_log_records_jitted_calls_with_shapes_and_"
                                     "shardings.<locals>.double(float32[3, 2]@")
        assert records[1].endswith("double(np.int32[4])")
        assert "<lambda>@test_watchdog.py:" in records[2] and records[2].endswith(", True)")
        assert f.lower(jnp.ones(2)) is not None  # the jitted function's own methods
        assert log.take() == []
        check = program_check.ProgramCheck(log)
        f(jnp.ones(2))
        check.compare(1)  # one process: nothing to compare, the records are taken
        assert log.take() == []
    finally:
        program_check.uninstall()
    assert jax.jit is program_check._ORIGINAL_JIT


def test_program_log_leaves_out_jitted_calls_inside_a_trace():
    # A jitted function called inside another trace (eval_shape, as the rollout layout's sizing
    # does with requantize, or an outer jit) is inlined there, not dispatched: not a program of
    # its own, and its arguments are tracers without a sharding.
    log = program_check.install()
    try:
        inner = jax.jit(lambda x: 2 * x)
        outer = jax.jit(lambda x: inner(x) + 1)
        log.take()
        assert jax.eval_shape(inner, jnp.ones(3)).shape == (3,)
        assert log.take() == []
        outer(jnp.ones(3))
        (record,) = log.take()
        assert "<lambda>@test_watchdog.py:" in record and "float32[3]" in record
    finally:
        program_check.uninstall()


def test_program_hook_parses_or_names_the_variable():
    assert program_check._parse_hook("") is None
    assert program_check._parse_hook("hang:1:2") == ("hang", 1, 2)
    with pytest.raises(ValueError, match="QURL_JAX_TEST_PROGRAM_HOOK"):
        program_check._parse_hook("drop:1:2")
