"""What a long run prints while it works, on a terminal and in a log file alike.

`Progress(label, total, unit)`: a phase with a known amount of work (an evaluation's problems, a
run's steps). On a terminal it draws a tqdm bar with the rate and the time left; elsewhere (a log
file, `nohup`, a pod's log) it logs one plain line when it starts, one at least every `every_s`
seconds while work is done (30 by default), and one when it ends, each with the work done of the
total, tokens/s when tokens are counted, and the time left at the rate so far:

    eval test, 4 samples at T=0.7: 120/256 problems, 1,432 tokens/s, 1:20 so far, about 1:31 left

`Heartbeat`: a daemon thread that logs what the run is doing ("step 3: update: 1:05 so far")
when the process has logged no line for `every_s` seconds (50), e.g. in a long update on a slow
CPU or while a program compiles, so a log never goes silent for a minute. It watches
every log record of the process (a handler on Python's root logger, which absl's lines pass
through); `doing(text)` names the current activity.
"""

from __future__ import annotations

import logging as std_logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging


def clock(seconds: float) -> str:
    """`seconds` as m:ss, or h:mm:ss from an hour on ('?' when not finite)."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class _LastLine(std_logging.Handler):
    """Remembers when the process last printed a line (INFO or above), for `Heartbeat`: a record
    absl's handler drops (`runtime.quiet`: orbax's INFO lines, dozens on every checkpoint save)
    is not a line, or a save would restart the silence's clock with nothing printed."""

    def __init__(self) -> None:
        super().__init__(std_logging.INFO)
        self.at = time.monotonic()

    def emit(self, record: std_logging.LogRecord) -> None:
        if logging.get_absl_handler().filter(record):
            self.at = time.monotonic()


_LAST_LINE = _LastLine()


def _watch_lines() -> _LastLine:
    """The handler that records the time of every log line, installed once on the root logger."""
    root = std_logging.getLogger()
    if _LAST_LINE not in root.handlers:
        root.addHandler(_LAST_LINE)
    return _LAST_LINE


class Progress:
    """Progress of one phase: `update(done, tokens)` as work is done, `close()` at its end.

    label: what the phase is ("eval test, greedy"); total: its amount of work in `unit`s
    ("problems"); bar: draw a tqdm bar when `stream` (default stderr) is a terminal (False: plain
    lines there too); every_s: most seconds between two plain lines while work is done; enabled:
    False makes it silent (the processes other than 0 of a multi-process run).
    """

    def __init__(self, label: str, total: int, unit: str, *, bar: bool = True,
                 every_s: float = 30.0, stream: Any = None, enabled: bool = True) -> None:
        self.label, self.total, self.unit = label, max(int(total), 0), unit
        self.every_s = every_s
        self.enabled = enabled
        self.done = self.tokens = 0
        self._start = self._printed = time.monotonic()
        self._bar = None
        stream = sys.stderr if stream is None else stream
        if not enabled:
            return
        _watch_lines()
        if bar and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=label, unit=f" {unit}", dynamic_ncols=True,
                             file=stream)
        else:
            logging.info("%s: 0/%d %s", label, self.total, unit)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def line(self) -> str:
        """The status: done of total, tokens/s (when counted), time so far and time left."""
        parts = [f"{self.label}: {self.done}/{self.total} {self.unit}"]
        elapsed = self.elapsed
        if self.tokens:
            parts.append(f"{self.tokens / max(elapsed, 1e-9):,.0f} tokens/s")
        parts.append(f"{clock(elapsed)} so far")
        if 0 < self.done < self.total:
            parts.append(f"about {clock(elapsed * (self.total - self.done) / self.done)} left")
        return ", ".join(parts)

    def update(self, done: int, tokens: int | None = None) -> None:
        """`done` units of the total are finished and `tokens` generated so far."""
        if not self.enabled:
            return
        done = min(int(done), self.total)
        advance, self.done = done - self.done, done
        if tokens is not None:
            self.tokens = int(tokens)
        if self._bar is not None:
            if self.tokens:
                self._bar.set_postfix_str(f"{self.tokens / max(self.elapsed, 1e-9):,.0f} tokens/s",
                                          refresh=False)
            self._bar.update(advance)
        elif time.monotonic() - self._printed >= self.every_s and done < self.total:
            self._printed = time.monotonic()
            logging.info("%s", self.line())

    def close(self) -> None:
        """Ends the bar, or logs the final line."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        else:
            logging.info("%s", self.line())


class Heartbeat:
    """Logs what the run is doing when the process has logged nothing for `every_s` seconds.

    `doing(text)` sets the activity (and restarts its clock); `status` (optional) adds a tail to
    every heartbeat line, e.g. the run's time left. `start()` runs the thread, `stop()` ends it.
    """

    def __init__(self, every_s: float = 50.0, status: Callable[[], str] | None = None,
                 log: Callable[[str], None] | None = None) -> None:
        self.every_s = every_s
        self.status = status
        self._log = log or (lambda text: logging.info("%s", text))
        self._what, self._since = "starting", time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def doing(self, what: str) -> None:
        self._what, self._since = what, time.monotonic()

    def line(self) -> str:
        text = f"{self._what}: {clock(time.monotonic() - self._since)} so far"
        tail = self.status() if self.status is not None else ""
        return f"{text}; {tail}" if tail else text

    def start(self) -> Heartbeat:
        last = _watch_lines()
        last.at = time.monotonic()

        def run() -> None:
            while not self._stop.wait(min(1.0, self.every_s / 4)):
                if time.monotonic() - last.at >= self.every_s:
                    self._log(self.line())
                    last.at = time.monotonic()  # when the line went elsewhere than logging

        self._thread = threading.Thread(target=run, name="qurl-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
