"""Preemption: SIGTERM / SIGINT end a run at a step boundary with a checkpoint, not mid-step.

Cloud TPU spot VMs, GKE and SLURM send SIGTERM some seconds before they kill a job; Ctrl-C sends
SIGINT. `PreemptionGuard.install()` (done by `python -m qurl_jax.main`) turns the first of either
into a request: the trainer finishes the step it is in, saves a checkpoint, and the run exits with
128 + the signal number after one line, "preempted at step N; checkpoint saved; rerun the same
command to resume". A second signal aborts at once (the default action of that signal, no
checkpoint): the handler resets the signal's disposition when the first one arrives.

Multi-process runs must save at the same step on every process, although the signal may reach only
one of them. They use JAX's preemption sync point (`multihost_utils.reached_preemption_sync_point`):
`jax.distributed.initialize` installs the runtime's own SIGTERM notifier, which tells the
coordination service, and every process learns the same step to stop at. The guard therefore
leaves SIGTERM to JAX there and forwards a SIGINT to its own process as a SIGTERM.
`reached(step)` must then be called once per step on every process, as the trainer does.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import jax
from absl import logging
from jax.experimental import multihost_utils

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
            if signum == signal.SIGTERM and _multi_process():
                continue  # JAX's notifier owns SIGTERM and shares the notice with every process
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
        if _multi_process() and signum != signal.SIGTERM:
            os.kill(os.getpid(), signal.SIGTERM)  # into JAX's notifier, which tells every process

    def reached(self, step: int) -> bool:
        """Whether to save and stop after `step` (a collective point in multi-process runs: call it
        after every step on every process)."""
        if _multi_process():
            if multihost_utils.reached_preemption_sync_point(step):
                self.request(self.signum or signal.SIGTERM)
                return True
            return False
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's code for death by the signal that stopped the run (143 for SIGTERM)."""
        return 128 + (self.signum or signal.SIGTERM)


def _multi_process() -> bool:
    return jax.process_count() > 1
