"""A stall watchdog: a phase of a step that runs far longer than any before it ends the process.

In a multi-process run, processes that dispatch different programs (or the same ones in another
order) wait inside XLA's collectives for ever: every chip of the slice idles, and nothing says
where. `StallWatchdog` turns that into an abort the scheduler can restart from the last checkpoint:

- the trainer marks its phases (`enter(name)` / `leave(name)`, through `metrics.PhaseTimer`) and
  step ends (`step_done`), from the evaluation before RL on (the trainer's set-up, supervised
  warm start included, is not watched); a thread checks, every `poll_s`, how long the current
  phase (or the gap since the last one ended) has been running;
- past the limit, every process that notices writes its Python stacks (all threads) to
  `<workdir>/stall-<process>.txt`, logs one line naming the step, the phase and that file, and
  exits with `EXIT_STALL` (75, "try again") at once, from the watchdog thread: the main thread is
  blocked inside XLA and would never return to run an exception;
- the limit: `timeout_s` when given, else max(`factor` x the slowest phase seen so far, `floor_s`);
  until the first step has ended (its programs compile), at least `first_step_s`;
- a SIGTERM (the preemption notice) normally ends the run at the next step boundary
  (`qurl_jax.train.preemption`); when no step ends within max(`sigterm_grace_s`, 2 x the slowest
  step seen) of it, the run is stalled and takes the same exit. The signal is seen through Python's
  signal wakeup fd, which the interpreter writes from its C-level handler even while the main thread
  is inside XLA.

A lost peer is not this module's business: the coordination service's heartbeat aborts the
survivors (`qurl_jax.parallel.distributed`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import select
import signal
import threading
import time
from collections.abc import Callable, Iterator

from absl import logging

EXIT_STALL = 75  # EX_TEMPFAIL: the scheduler restarts the run, which resumes from its checkpoint


class StallWatchdog:
    """Aborts the process when a phase stalls; see the module docstring.

    Args:
      workdir: where `stall-<process>.txt` goes (a local path or URL).
      process: this process's index (names the file).
      timeout_s: a fixed limit per phase (None: max(factor x slowest phase seen, floor_s)).
      factor, floor_s: the automatic limit.
      first_step_s: the least limit until the first step has ended (compiles included).
      sigterm_grace_s: how long after a SIGTERM a step end may take before the run counts as
        stalled (or twice the slowest step seen, when longer).
      poll_s: how often the thread checks.
      exit_fn: what ends the process (tests pass a recorder); called with EXIT_STALL.
      clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, workdir: str, process: int = 0, *, timeout_s: float | None = None,
                 factor: float = 10.0, floor_s: float = 600.0, first_step_s: float = 1800.0,
                 sigterm_grace_s: float = 60.0, poll_s: float = 1.0,
                 exit_fn: Callable[[int], None] = os._exit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s is not None and timeout_s <= 0:
            raise ValueError(f"StallWatchdog: timeout_s={timeout_s} must be > 0 (or None: auto)")
        self.workdir, self.process = workdir, int(process)
        self.timeout_s, self.factor, self.floor_s = timeout_s, float(factor), float(floor_s)
        self.first_step_s, self.sigterm_grace_s = float(first_step_s), float(sigterm_grace_s)
        self.poll_s = float(poll_s)
        self._exit, self._clock = exit_fn, clock
        self._lock = threading.Lock()
        self.step = 0  # the last step that ended
        self.steps_seen = 0  # step ends seen by this watchdog
        self.phase: str | None = None  # armed by the first `enter`
        self._since = clock()
        self.slowest_s = 0.0
        self.slowest_step_s = 0.0  # between step ends, after the first
        self._step_since: float | None = None
        self.sigterm_at: float | None = None
        self.fired: str | None = None  # the stall line, once fired
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wakeup: tuple[int, int] | None = None
        self._previous_wakeup = -1

    # -------------------------------------------------------------------------- the trainer's side
    def enter(self, name: str) -> None:
        """A phase starts (the gap since the last one ended counts as a phase of its own)."""
        now = self._clock()
        with self._lock:
            self._close_phase(now)
            self.phase, self._since = name, now

    def leave(self, name: str) -> None:
        """A phase ended: the time until the next one starts counts as f'after {name}'."""
        now = self._clock()
        with self._lock:
            self._close_phase(now)
            self.phase, self._since = f"after {name}", now

    @contextlib.contextmanager
    def watch(self, name: str) -> Iterator[None]:
        """`enter(name)` ... `leave(name)` around a block."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def step_done(self, step: int) -> None:
        now = self._clock()
        with self._lock:
            self._close_phase(now)
            if self._step_since is not None:
                self.slowest_step_s = max(self.slowest_step_s, now - self._step_since)
            self._step_since = now
            self.step, self.steps_seen = int(step), self.steps_seen + 1
            self.phase, self._since = "between steps", now
            self.sigterm_at = None  # the preemption check of this step handles it

    def _close_phase(self, now: float) -> None:
        # Only after the first step: its phases compile, the later ones show the run's pace.
        if self.steps_seen:
            self.slowest_s = max(self.slowest_s, now - self._since)

    def limit_s(self) -> float:
        """The current phase's limit."""
        if not self.steps_seen:  # compiles: never less than `first_step_s`
            return max(self.timeout_s or 0.0, self.first_step_s)
        if self.timeout_s is not None:
            return self.timeout_s
        return max(self.factor * self.slowest_s, self.floor_s)

    def grace_s(self) -> float:
        """How long a step end may take after a SIGTERM: `sigterm_grace_s`, or twice the
        slowest step seen when that is longer (a long step is not a stall)."""
        return max(self.sigterm_grace_s, 2.0 * self.slowest_step_s)

    # ------------------------------------------------------------------------------- the thread
    def start(self) -> StallWatchdog:
        """Starts the checking thread (and, from the main thread, listens for SIGTERM through
        the signal wakeup fd). Returns self."""
        if threading.current_thread() is threading.main_thread():
            r, w = os.pipe()
            os.set_blocking(r, False)
            os.set_blocking(w, False)
            try:
                self._previous_wakeup = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
                self._wakeup = (r, w)
            except ValueError:
                os.close(r)
                os.close(w)
            if self._wakeup is not None and self._previous_wakeup != -1:
                # Someone listens already (the preemption guard, which forwards each signal to
                # `note_sigterm` when told to): leave the fd to it.
                signal.set_wakeup_fd(self._previous_wakeup, warn_on_full_buffer=False)
                os.close(r)
                os.close(w)
                self._wakeup = None
        self._thread = threading.Thread(target=self._run, name="stall-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wakeup is not None:
            with contextlib.suppress(ValueError):  # not the main thread: leave it
                signal.set_wakeup_fd(self._previous_wakeup)
            for fd in self._wakeup:
                os.close(fd)
            self._wakeup = None

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._wakeup is not None:
                ready, _, _ = select.select([self._wakeup[0]], [], [], self.poll_s)
                if ready:
                    self._read_signals()
            else:
                self._stop.wait(self.poll_s)
            if not self._stop.is_set():
                self.check()

    def _read_signals(self) -> None:
        try:
            data = os.read(self._wakeup[0], 512)
        except BlockingIOError:
            return
        if signal.SIGTERM in data or signal.SIGINT in data:  # either asks for a stop
            self.note_sigterm()

    def note_sigterm(self) -> None:
        with self._lock:
            if self.sigterm_at is None:
                self.sigterm_at = self._clock()

    def check(self) -> str | None:
        """Fires (and returns the stall line) when the current phase is past its limit, or a
        SIGTERM has waited past its grace for a step end."""
        now = self._clock()
        with self._lock:
            if self.fired:
                return self.fired
            if self.phase is None:
                return None
            elapsed, limit = now - self._since, self.limit_s()
            if elapsed > limit:
                why = f"ran {elapsed:.0f} s, limit {limit:.0f} s"
            elif self.sigterm_at is not None and now - self.sigterm_at > self.grace_s():
                why = (f"SIGTERM {now - self.sigterm_at:.0f} s ago and no step end (grace "
                       f"{self.grace_s():.0f} s)")
            else:
                return None
            step, phase = self.step + 1, self.phase
        path = self._write_stacks(step, phase, why)
        self.fired = (f"stalled: step {step}, phase '{phase}' ({why}); stacks of process "
                      f"{self.process} in {path}; exiting {EXIT_STALL} for a restart from the "
                      f"last checkpoint")
        logging.error("%s", self.fired)
        logging.flush()
        self._exit(EXIT_STALL)
        return self.fired

    def _write_stacks(self, step: int, phase: str, why: str) -> str:
        from qurl_jax.runtime import paths

        path = paths.join(self.workdir, f"stall-{self.process}.txt")
        header = f"process {self.process}: stalled in step {step}, phase '{phase}' ({why})\n\n"
        try:
            if paths.is_url(path):
                buf = io.StringIO()
                buf.write(header)
                _dump_stacks(buf)
                with paths.open_file(path, "w") as f:
                    f.write(buf.getvalue())
            else:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(header)
                    f.flush()
                    faulthandler.dump_traceback(f, all_threads=True)
        except OSError as e:  # the stacks go to stderr instead
            logging.error("could not write %s (%s); stacks follow on stderr", path, e)
            faulthandler.dump_traceback(all_threads=True)
        return path


def _dump_stacks(out: io.StringIO) -> None:
    """All threads' Python stacks into a text buffer (faulthandler needs a real file)."""
    import sys
    import traceback

    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
        out.write(f"Thread {ident:#x} ({names.get(ident, '?')}):\n")
        out.write("".join(traceback.format_stack(frame)))
        out.write("\n")


def for_run(stall_timeout_s: float, workdir: str, processes: int, process: int
            ) -> StallWatchdog | None:
    """The run's watchdog per `train.stall_timeout_s` (0: on with the automatic limit in
    multi-process runs only; > 0: on with that limit; < 0: off), started; None when off."""
    if stall_timeout_s < 0 or (stall_timeout_s == 0 and processes == 1):
        return None
    watchdog = StallWatchdog(workdir, process, timeout_s=stall_timeout_s or None)
    logging.info("stall watchdog: %s", f"limit {stall_timeout_s:.0f} s per phase"
                 if stall_timeout_s else "limit max(10 x slowest phase, 600 s) per phase, "
                 f"{watchdog.first_step_s:.0f} s until the first step ends")
    return watchdog.start()
