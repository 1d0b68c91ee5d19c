"""Private: verifier worker processes with a hard per-call time limit, on pebble's ProcessPool.

Verifying a model's answer with sympy can run for hours (an exponent tower, a huge factorial) inside
C code that no signal handler interrupts, and `math_verify`'s own signal-based timeout only works
in a main thread. `VerifierPool` runs each call in a worker process of a `pebble.ProcessPool`:
pebble kills a worker whose call outlives its limit and starts a replacement, and reports a worker
that died. Workers are fresh interpreters (the "spawn" start method, never a fork of the
JAX-threaded parent); each one, before taking work, asks the kernel to kill it when the parent
dies (Linux; no orphans even when the parent is SIGKILLed), caps its address space, and warms
math_verify up so the first call does not pay for the imports.

When workers cannot be started at all (pebble then reports a broken pool), the call is answered
"unavailable" and the next call builds a new pool, so the pool keeps trying to restore its size
while the caller scores the response as a failure and goes on.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import multiprocessing
import os
import resource
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Literal

import pebble

Status = Literal["ok", "error", "timeout", "crash", "unavailable"]

# Set in every worker's environment; code can test it to know it already runs isolated.
WORKER_ENV = "QURL_JAX_VERIFIER_WORKER"

# pebble's ProcessPool starts its first workers from the thread that first uses it, and Linux sends
# a worker its parent-death signal when that *thread* exits; one long-lived thread starts them all.
_starter: concurrent.futures.ThreadPoolExecutor | None = None
_starter_lock = threading.Lock()


def _start_from_long_lived_thread(pool: pebble.ProcessPool) -> None:
    global _starter
    with _starter_lock:
        if _starter is None:
            _starter = concurrent.futures.ThreadPoolExecutor(1, "verifier-starter")
    _starter.submit(pool.schedule, os.getpid).result()


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent dies, even mid-computation."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def init_worker(memory_limit_mb: int | None, preload: Sequence[str]) -> None:
    """Runs in each worker before it takes work (pebble's `initializer`).

    pebble stops a timed-out worker with SIGTERM; its Python-level handler would wait for sympy's C
    code to return, the default action ends the process at once.
    """
    _die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.environ[WORKER_ENV] = "1"
    if memory_limit_mb:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # math_verify warns once that its signal-based timeouts are off; the hard limit is the pool's.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for entry in preload:
        module, _, function = entry.partition(":")
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()


class VerifierPool:
    """Worker processes running picklable functions with a hard per-call timeout.

    `call` is thread-safe; up to `num_workers` calls run at once, more wait for a free worker (the
    limit counts from the moment a worker starts the call). Functions and their arguments travel by
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
          preload: what each worker does before it takes work: "module" imports it,
            "module:function" also calls function().
        """
        if num_workers <= 0:
            raise ValueError(f"VerifierPool: num_workers must be positive, got {num_workers}")
        if timeout_s <= 0:
            raise ValueError(f"VerifierPool: timeout_s must be positive, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self._initargs = (memory_limit_mb, tuple(preload))
        self._lock = threading.Lock()
        self._closed = False
        self._pool = self._new_pool()

    def _new_pool(self) -> pebble.ProcessPool:
        pool = pebble.ProcessPool(self.num_workers, initializer=init_worker,
                                  initargs=self._initargs,
                                  context=multiprocessing.get_context("spawn"))
        _start_from_long_lived_thread(pool)
        return pool

    def _schedule(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float
                  ) -> concurrent.futures.Future:
        with self._lock:
            if self._closed:
                raise RuntimeError("VerifierPool.call after close()")
            if not self._pool.active:  # broken: its workers could not be (re)started
                self._pool.stop()
                self._pool = self._new_pool()
            return self._pool.schedule(fn, args, timeout=timeout_s)

    def call(
        self, fn: Callable[..., Any], *args: Any, timeout_s: float | None = None
    ) -> tuple[Status, Any]:
        """Runs `fn(*args)` in a worker.

        Returns:
          ("ok", result); ("error", "<type>: <message>") when fn raised; ("timeout", None) when it
          ran past `timeout_s` (default: the pool's) and the worker was replaced; ("crash", reason)
          when the worker died; ("unavailable", reason) when no worker could be started.
        """
        try:
            future = self._schedule(fn, args, self.timeout_s if timeout_s is None else timeout_s)
            return "ok", future.result()
        except Exception as e:  # noqa: BLE001 - sorted below; anything else is re-raised
            if hasattr(e, "traceback"):  # raised by fn in the worker; pebble attaches its trace
                return "error", f"{type(e).__name__}: {e}"
            if isinstance(e, pebble.ProcessExpired):
                return "crash", f"verifier worker exited with code {e.exitcode}"
            if isinstance(e, TimeoutError):
                return "timeout", None
            if isinstance(e, BrokenProcessPool | RuntimeError) and not self._closed:
                return "unavailable", f"{type(e).__name__}: {e}"
            raise

    def close(self) -> None:
        """Stops all workers; the pool cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pool.stop()
            self._pool.join()

    def __enter__(self) -> VerifierPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
