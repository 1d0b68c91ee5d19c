"""Preemption: SIGTERM / SIGINT end a run at a step boundary with a checkpoint, not mid-step.

Cloud TPU spot VMs, GKE and SLURM send SIGTERM some seconds before they kill a job; Ctrl-C sends
SIGINT. `PreemptionGuard.install()` (done by `python -m qurl_jax.main`) turns the first of either
into a request: the trainer finishes the step it is in, saves a checkpoint, and the run exits with
128 + the signal number after one line, "preempted at step N; checkpoint saved; rerun the same
command to resume". A second signal aborts at once (the default action of that signal, no
checkpoint): the handler resets the signal's disposition when the first one arrives.

Finishing a step is worth it only between steps of a running loop (`finishing_steps`, which the
trainer holds from the end of its first step to the end of its loop). Anywhere else -- the set-up
and the supervised warm start, the evaluation before RL, the first step's compiles, the final
evaluation, the speed check -- there is no step to finish: the first signal raises `Stopped` in the
main thread, and `python -m qurl_jax.main` exits with 128 + the signal after one line; checkpoints
already written are kept (the trainer waits for one still being written). Where the main thread
sits inside XLA (a compile) and cannot run Python, a listener thread on the signal wakeup fd ends
the process with the same line and code after `STOP_GRACE_S`. It does the same when the main
thread raised `Stopped` but no handler took it (`PreemptionGuard.caught`) within `CAUGHT_GRACE_S`:
an exception raised while a finaliser runs is printed and dropped by Python, and the run goes on
(a warm start under load once ignored a SIGTERM in a suite run, 2026-11-28).

Multi-process runs must save at the same step on every process, although the signal may reach only
one of them: `reached(step)`, called once per step on every process (as the trainer does), is a
small collective there, the largest of every process's "a stop was requested" flag, so every
process stops after the same step. The guard owns SIGTERM there too, instead of the SIGTERM
notifier `jax.distributed.initialize` installs (whose sync point,
`multihost_utils.reached_preemption_sync_point`, gave the same step): a Python handler is what
lets the stall watchdog (`qurl_jax.runtime.watchdog`) see a SIGTERM that arrives while the main
thread is stuck inside XLA, and what makes a second SIGTERM end the process at once (JAX's notifier
swallowed every further one).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import jax
from absl import logging

from qurl_jax.parallel import distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long after a signal outside the step loop the main thread may take to raise `Stopped`
# before the listener thread ends the process itself (it is inside XLA).
STOP_GRACE_S = 5.0
# How long after raising `Stopped` the main thread may take to reach the handler that ends the run
# (`PreemptionGuard.caught`) before the listener thread ends the process itself.
CAUGHT_GRACE_S = 15.0


class Stopped(BaseException):
    """A signal outside the step loop: the run stops now (a BaseException, as KeyboardInterrupt,
    so that no `except Exception` swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def line(self) -> str:
        return stop_line(self.signum)


def stop_line(signum: int) -> str:
    """The one line of a stop outside the step loop."""
    return (f"qurl_jax: {signal.Signals(signum).name} received outside the step loop (set-up, warm "
            "start, evaluation, compile or speed check): stopped; checkpoints already saved are "
            "kept; rerun the same command to resume")


class PreemptionGuard:
    """Records a stop request from SIGTERM / SIGINT (or `request`) for a step-boundary stop.

    `reached(step)` is True once the run should save and stop after `step`: on one process as
    soon as a request arrived, on several at the step the JAX preemption sync point names.
    """

    def __init__(self, stop_grace_s: float = STOP_GRACE_S,
                 exit_fn: Callable[[int], None] = os._exit,
                 caught_grace_s: float = CAUGHT_GRACE_S) -> None:
        self.signum: int | None = None
        self.stop_grace_s = stop_grace_s
        self.caught_grace_s = caught_grace_s
        self._caught = threading.Event()  # a handler took `Stopped`: it ends the run
        self.listeners: list[Callable[[int], None]] = []  # called with each signal's number
        self._previous: dict[int, object] = {}
        # Inside the step loop (the trainer sets it): a signal finishes the step, saves and stops.
        self.at_steps = False
        self._raised = threading.Event()  # the main thread raised `Stopped`: it ends the run
        self._exit = exit_fn
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1
        self._closed = threading.Event()

    def install(self) -> PreemptionGuard:
        """Installs the handlers and the wakeup-fd listener (main thread only; a no-op
        elsewhere). Returns self."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        self._previous_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        self._wakeup = (r, w)
        threading.Thread(target=self._listen, name="preemption-listener", daemon=True).start()
        return self

    def uninstall(self) -> None:
        """Restores the handlers `install` replaced."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
        if self._wakeup is not None:
            self._closed.set()
            with contextlib.suppress(ValueError):
                signal.set_wakeup_fd(self._previous_wakeup)
            # The listener closes the pipe's read end; the write end goes here.
            os.close(self._wakeup[1])
            self._wakeup = None

    @contextlib.contextmanager
    def finishing_steps(self) -> Iterator[None]:
        """Within: a first signal finishes the step, then saves and stops (the step loop)."""
        self.at_steps = True
        try:
            yield
        finally:
            self.at_steps = False

    def _listen(self) -> None:
        """Reads the signal numbers the interpreter's C handler writes, even while the main thread
        is inside XLA; outside the step loop, ends the process when the main thread has not
        raised `Stopped` within `stop_grace_s`."""
        assert self._wakeup is not None
        r = self._wakeup[0]
        try:
            while not self._closed.is_set():
                ready, _, _ = select.select([r], [], [], 0.5)
                if not ready:
                    continue
                try:
                    data = os.read(r, 512)
                except BlockingIOError:
                    continue
                for signum in (int(b) for b in data if b in SIGNALS):
                    for listener in self.listeners:
                        listener(signum)
                    if not self.at_steps:
                        self._backstop(signum)
        finally:
            os.close(r)

    def caught(self) -> None:
        """Called by the handler that took `Stopped` and ends the run: the listener thread
        leaves the ending to it (it may still wait for a checkpoint being written)."""
        self._caught.set()

    def _backstop(self, signum: int) -> None:
        if self._raised.wait(self.stop_grace_s) and self._caught.wait(self.caught_grace_s):
            return
        if self._closed.is_set() or self.at_steps or self._caught.is_set():
            return
        print(stop_line(self.signum or signum), file=sys.stderr, flush=True)
        logging.flush()
        self._exit(128 + (self.signum or signum))

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Asks the run to stop after the current step, as the signal `signum` does."""
        if self.signum is None:
            self.signum = int(signum)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        signal.signal(signum, signal.SIG_DFL)  # a second one acts at once, even inside XLA
        if self.signum is not None:  # only if the default could not be restored in time
            os.kill(os.getpid(), signum)
            return
        self.request(signum)
        if not self.at_steps:  # no step to finish: stop now
            self._raised.set()
            raise Stopped(signum)
        logging.warning("%s received: finishing this step, then saving a checkpoint (a second "
                        "%s aborts at once, without one)", signal.Signals(signum).name,
                        signal.Signals(signum).name)

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (a collective point in multi-process runs: call it
        after every step on every process)."""
        if _multi_process():
            # Every process's request (its signal number, 0 for none), agreed at this step.
            agreed = dist.agree_max(self.signum or 0)
            if agreed:
                self.request(agreed)
            return bool(agreed)
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal that stopped the run (143 for SIGTERM)."""
        return 128 + (self.signum or signal.SIGTERM)


def _multi_process() -> bool:
    return jax.process_count() > 1
