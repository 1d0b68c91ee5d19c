"""Preemption: SIGTERM / SIGINT end a run at a step boundary with a checkpoint, not mid-step.

Cloud TPU spot VMs, GKE and SLURM send SIGTERM some seconds before they kill a job; Ctrl-C sends
SIGINT. `PreemptionGuard.install()` (done by `python -m qurl_jax.main`) turns the first of either
into a request: the trainer finishes the step it is in, saves a checkpoint, and the run exits with
128 + the signal number after one line, "preempted at step N; checkpoint saved; rerun the same
command to resume". A second signal aborts at once (the default action of that signal, no
checkpoint): the handler resets the signal's disposition when the first one arrives.

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

import os
import signal
import threading
from types import FrameType

import jax
from absl import logging

from qurl_jax.parallel import distributed as dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class PreemptionGuard:
    """Records a stop request from SIGTERM / SIGINT (or `request`) for a step-boundary stop.

    `reached(step)` is True once the run should save and stop after `step`: on one process as
    soon as a request arrived, on several at the step the JAX preemption sync point names.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionGuard:
        """Installs the handlers (main thread only; a no-op elsewhere). Returns self."""
        if threading.current_thread() is not threading.main_thread():
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def uninstall(self) -> None:
        """Restores the handlers `install` replaced."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

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
