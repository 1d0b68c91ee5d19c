"""Private: worker subprocesses that run picklable functions under a hard per-call wall-clock limit.

Verifying a model's answer with sympy can run for hours (an exponent tower, a huge factorial) inside
C code that no signal interrupts, and `math_verify`'s own signal-based timeout only works in a
main thread. Each worker here is a fresh interpreter (`python -m qurl_jax.data._verifier_worker`,
not a fork of the JAX-threaded parent) that reads `(fn, args)` messages from its stdin and writes
results to a private copy of its stdout. A call that is not answered within its limit gets the
worker killed (SIGKILL) and a replacement started in the background; a worker that dies (e.g. hits
its address-space limit) is replaced the same way. Messages are length-prefixed pickles.
"""

from __future__ import annotations

import concurrent.futures
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "error", "timeout", "crash"]

# Set in every worker's environment; code can test it to know it already runs isolated.
WORKER_ENV = "QURL_JAX_VERIFIER_WORKER"

_HEADER = struct.Struct("<I")
READY = "ready"
_STARTUP_TIMEOUT_S = 120.0
_WORKER_MODULE = "qurl_jax.data._verifier_worker"


def write_message(fd: int, obj: Any) -> None:
    """Writes obj to fd as a length-prefixed pickle."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes:
    """n bytes from fd; TimeoutError past monotonic `deadline`, EOFError when the pipe closes."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                raise TimeoutError
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def read_payload(fd: int, deadline: float | None) -> bytes:
    """One length-prefixed message's pickled bytes (see `_read_exact` for the errors)."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size, deadline))
    return _read_exact(fd, size, deadline)


def _read_message(fd: int, deadline: float | None) -> Any:
    return pickle.loads(read_payload(fd, deadline))


def _child_env() -> dict[str, str]:
    """The parent's environment plus its import path, so pickled functions resolve in the child."""
    env = dict(os.environ)
    package_root = str(Path(__file__).resolve().parents[2])
    paths = [package_root] + [p or os.getcwd() for p in sys.path]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env[WORKER_ENV] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _spawn(args: list[str]) -> subprocess.Popen[bytes]:
    """Starts a worker process from one long-lived thread.

    Linux delivers a child's parent-death signal (which workers request) when the *thread* that
    started it exits, so a worker started from a short-lived caller thread would die with it.
    """
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, "verifier-spawner")
    future = _spawner.submit(
        subprocess.Popen,
        args,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=_child_env(),
        bufsize=0,
    )
    return future.result()


class _Worker:
    """Parent-side handle of one worker process; used by one thread at a time."""

    def __init__(self, memory_limit_mb: int | None, preload: Sequence[str]) -> None:
        self._memory_limit_mb = memory_limit_mb
        self._preload = tuple(preload)
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._start()

    def _start(self) -> None:
        limit = str(self._memory_limit_mb or 0)
        args = [sys.executable, "-m", _WORKER_MODULE, limit, *self._preload]
        self._proc = _spawn(args)
        self._ready = False

    def _wait_ready(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        try:
            deadline = time.monotonic() + _STARTUP_TIMEOUT_S
            message = _read_message(self._proc.stdout.fileno(), deadline)
        except (EOFError, TimeoutError) as e:
            code = self._proc.poll()
            self.close()
            raise RuntimeError(f"verifier worker did not start (exit code {code})") from e
        if message != READY:
            self.close()
            raise RuntimeError(f"verifier worker sent {message!r} instead of {READY!r}")
        self._ready = True

    def close(self) -> None:
        """Kills the worker (it holds no state), reaps it and closes its pipes."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()
        self._proc = None

    def restart(self) -> None:
        self.close()
        self._start()

    def call(
        self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float
    ) -> tuple[Status, Any]:
        """Runs fn(*args) in the worker; the limit counts from the moment the request is sent."""
        if self._proc is None or self._proc.poll() is not None:
            self.restart()  # it died while idle (or a previous start failed)
        if not self._ready:
            self._wait_ready()
        assert self._proc is not None and self._proc.stdin is not None
        assert self._proc.stdout is not None
        try:
            write_message(self._proc.stdin.fileno(), (fn, args))
            ok, value = _read_message(self._proc.stdout.fileno(), time.monotonic() + timeout_s)
        except TimeoutError:
            self.restart()
            return "timeout", None
        except (EOFError, BrokenPipeError):
            code = self._proc.wait()
            self.restart()
            return "crash", f"verifier worker exited with code {code}"
        return ("ok" if ok else "error"), value


class VerifierPool:
    """A fixed set of worker processes running picklable functions with a hard per-call timeout.

    `call` is thread-safe: each call borrows an idle worker (blocking while all are busy), so up to
    `num_workers` calls run at once from as many threads. Functions and their arguments travel by
    pickle, so a function must be importable by module and name (no lambdas, nothing from
    `__main__`).
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        memory_limit_mb: int | None = 4096,
        preload: Sequence[str] = ("qurl_jax.data.rewards:warm_up_math_verify",),
    ) -> None:
        """Starts the workers (their start-up, ~1 s with math_verify, overlaps the caller).

        Args:
          num_workers: number of processes (> 0).
          timeout_s: default wall-clock limit of one call in seconds (> 0).
          memory_limit_mb: address-space limit (RLIMIT_AS) of each worker; None for no limit.
          preload: what each worker does before it reports ready, so it does not count against
            the first call's limit: "module" imports it, "module:function" also calls function().
        """
        if num_workers <= 0:
            raise ValueError(f"VerifierPool: num_workers must be positive, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"VerifierPool: timeout_s must be positive, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._workers = [_Worker(memory_limit_mb, preload) for _ in range(num_workers)]
        self._idle: queue.Queue[_Worker] = queue.Queue()
        for worker in self._workers:
            self._idle.put(worker)
        self._closed = False

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> tuple[Status, Any]:
        """Runs `fn(*args)` in a worker.

        Returns:
          ("ok", result); ("error", "<type>: <message>") when fn raised; ("timeout", None) when it
          ran past `timeout_s` (default: the pool's) and the worker was replaced; ("crash", reason)
          when the worker died.
        """
        if self._closed:
            raise RuntimeError("VerifierPool.call after close()")
        worker = self._idle.get()
        try:
            return worker.call(fn, args, self.timeout_s if timeout_s is None else timeout_s)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """Stops all workers; the pool cannot be used afterwards."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            worker.close()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
