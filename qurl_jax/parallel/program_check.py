"""`train.check_collectives`: every process must dispatch the same jitted programs in one order.

A multi-process run hangs when its processes dispatch different programs (or the same ones in a
different order): each waits inside a collective the others never reach. This debug check finds
such a divergence before it hangs, or names it when it does not hang:

- `install()` wraps `jax.jit` (and the jitted functions already bound in `qurl_jax`'s modules) so
  that every call of a jitted function records its name and its arguments' shapes, dtypes and
  shardings in this process's `ProgramLog`;
- `ProgramCheck.compare(step)`, called by the trainer at every step end on every process, sends
  the count and a digest of the step's records to every process (one all-gather of 5 words); when
  they differ it finds the first record that differs (two more small all-gathers) and stops the
  process with one line naming that program and the processes, exit code `EXIT_MISMATCH`.

The recording costs a pytree flatten and a hash per dispatch (debug only: off by default). Only
programs dispatched through `jax.jit` are seen, not JAX's own eager operations; those the
trainer runs on global arrays are the same on every process by construction (they follow the
jitted ones).

Test hook (for the multi-process tests only): `QURL_JAX_TEST_PROGRAM_HOOK=extra:P:S` makes
process P dispatch one extra (collective-free) program in step S, which `compare` must catch;
`hang:P:S` makes process P never reach step S's comparison (it skips the collective and waits),
so the others wait in it: a hang the stall watchdog must catch. (Skipping a collective and going
on does not hang on the CPU: Gloo aborts the next one, 'Received data size doesn't match
expected size. Is there a distributed collective mismatch in your code?'.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import threading
import time
import types
from typing import Any

import jax
import numpy as np
from absl import logging

EXIT_MISMATCH = 76
HOOK_ENV = "QURL_JAX_TEST_PROGRAM_HOOK"
_NAME_BYTES = 400  # a program's record, as exchanged on a mismatch (truncated)


class ProgramLog:
    """This process's record of the jitted programs dispatched since the last `take`."""

    def __init__(self) -> None:
        self.records: list[str] = []
        self._lock = threading.Lock()

    def record(self, name: str, args: tuple, kwargs: dict) -> None:
        text = f"{name}({_signature(args, kwargs)})"
        with self._lock:
            self.records.append(text)

    def take(self) -> list[str]:
        with self._lock:
            out, self.records = self.records, []
        return out


_LOG: ProgramLog | None = None
_ORIGINAL_JIT = jax.jit


def install() -> ProgramLog:
    """Records every jitted program this process dispatches from now on (idempotent)."""
    global _LOG
    if _LOG is None:
        _LOG = ProgramLog()
        jax.jit = _recording_jit
        _rebind_module_functions()
    return _LOG


def uninstall() -> None:
    """Stops recording new programs (wrappers already made keep recording into nothing)."""
    global _LOG
    jax.jit = _ORIGINAL_JIT
    _LOG = None


class _Recorded:
    """A jitted function that records each call in the `ProgramLog`; everything else (`lower`,
    `trace`, ...) is the jitted function's."""

    def __init__(self, jitted: Any, name: str) -> None:
        self._jitted, self._name = jitted, name
        functools.update_wrapper(self, jitted, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _LOG is not None and not _traced(args, kwargs):
            _LOG.record(self._name, args, kwargs)
        return self._jitted(*args, **kwargs)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else types.MethodType(self, obj)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._jitted, name)


def _traced(args: tuple, kwargs: dict) -> bool:
    """Whether the call is inside a trace (another jit, `eval_shape`, ...): it is then inlined
    into the traced program, not dispatched as a program of its own, and its arguments are
    tracers, which have no sharding to record."""
    return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs)))


def _recording_jit(fun: Any = None, *args: Any, **kwargs: Any) -> Any:
    if fun is None:  # used as @jax.jit(...) with keywords only
        return functools.partial(_recording_jit, *args, **kwargs)
    return _Recorded(_ORIGINAL_JIT(fun, *args, **kwargs), _program_name(fun))


def _program_name(fun: Any) -> str:
    while isinstance(fun, functools.partial):
        fun = fun.func
    fun = getattr(fun, "__func__", fun)  # a bound method
    name = getattr(fun, "__qualname__", None) or type(fun).__name__
    code = getattr(fun, "__code__", None)
    if "<lambda>" in name and code is not None:
        name += f"@{os.path.basename(code.co_filename)}:{code.co_firstlineno}"
    return name


def _rebind_module_functions() -> None:
    """Wraps the jitted functions module-level decorators already made in `qurl_jax`'s modules
    (the same object everywhere it was imported)."""
    jit_type = type(_ORIGINAL_JIT(lambda x: x))
    modules = [m for n, m in list(sys.modules.items())
               if m is not None and (n == "qurl_jax" or n.startswith("qurl_jax."))]
    wrapped: dict[int, _Recorded] = {}
    for module in modules:
        for attr, value in list(vars(module).items()):
            if isinstance(value, jit_type):
                if id(value) not in wrapped:
                    wrapped[id(value)] = _Recorded(value, _program_name(
                        getattr(value, "__wrapped__", value)))
                setattr(module, attr, wrapped[id(value)])


def _signature(args: tuple, kwargs: dict) -> str:
    parts = []
    for leaf in jax.tree.leaves((args, kwargs)):
        if isinstance(leaf, jax.Array):
            parts.append(f"{leaf.dtype}{list(leaf.shape)}{_sharding(leaf)}")
        elif isinstance(leaf, np.ndarray | np.generic):
            parts.append(f"np.{leaf.dtype}{list(np.shape(leaf))}")
        elif isinstance(leaf, bool | str | type(None)):
            parts.append(repr(leaf))
        else:  # a Python number (its value may differ between processes without harm) or other
            parts.append(type(leaf).__name__)
    return ", ".join(parts)


def _sharding(x: jax.Array) -> str:
    sharding = x.sharding
    spec = getattr(sharding, "spec", None)
    if spec is not None:
        return f"@{tuple(spec)}"
    return f"@{type(sharding).__name__}"


def _words(text: str) -> np.ndarray:
    return np.frombuffer(hashlib.blake2b(text.encode(), digest_size=16).digest(), np.uint32)


class ProgramCheck:
    """Compares the processes' program records at every step end (see the module docstring)."""

    def __init__(self, log: ProgramLog) -> None:
        self.log = log
        self.hook = _parse_hook(os.environ.get(HOOK_ENV, ""))

    def compare(self, step: int) -> None:
        """Returns when every process dispatched the same programs since the last call; else
        logs one line and ends the process (`EXIT_MISMATCH`)."""
        from jax.experimental import multihost_utils

        me = jax.process_index()
        if self.hook and self.hook[1:] == (me, step) and self.hook[0] == "extra":
            _ORIGINAL_JIT(lambda x: x + 1)(np.int32(step))  # a program only this process runs
            self.log.record("test_hook_extra_program", (np.int32(step),), {})
        records = self.log.take()
        if jax.process_count() == 1:
            return
        if self.hook and self.hook[1:] == (me, step) and self.hook[0] == "hang":
            logging.warning("test hook: process %d never reaches step %d's program check", me,
                            step)
            while True:
                time.sleep(1.0)
        digest = _words("\n".join(records))
        mine = np.concatenate([np.array([len(records)], np.uint32), digest])
        every = np.asarray(multihost_utils.process_allgather(mine))  # [processes, 5]
        if (every == every[0]).all():
            return
        line = self._first_difference(step, records, every[:, 0])
        logging.error("%s", line)
        logging.flush()
        print(f"qurl_jax: {line}", file=sys.stderr, flush=True)
        os._exit(EXIT_MISMATCH)

    @staticmethod
    def _first_difference(step: int, records: list[str], counts: np.ndarray) -> str:
        """The line naming the first record that differs (two more all-gathers)."""
        from jax.experimental import multihost_utils

        longest = int(counts.max())
        hashes = np.zeros((longest,), np.uint32)  # past a process's end: 0
        for i, text in enumerate(records):
            hashes[i] = _words(text)[0] | 1
        every = np.asarray(multihost_utils.process_allgather(hashes))  # [processes, longest]
        differs = np.nonzero((every != every[0]).any(axis=0))[0]
        first = int(differs[0]) if differs.size else longest
        text = records[first] if first < len(records) else "(nothing)"
        raw = np.zeros((_NAME_BYTES,), np.uint8)
        encoded = text.encode()[:_NAME_BYTES]
        raw[:len(encoded)] = np.frombuffer(encoded, np.uint8)
        names = np.asarray(multihost_utils.process_allgather(raw))
        texts = [bytes(r).rstrip(b"\0").decode(errors="replace") for r in names]
        groups: dict[str, list[int]] = {}
        for p, t in enumerate(texts):
            groups.setdefault(t, []).append(p)
        ran = "; ".join(f"process{'es' if len(ps) > 1 else ''} "
                        f"{','.join(map(str, ps))} ran {t}" for t, ps in groups.items())
        return (f"check_collectives: step {step}: the processes dispatched different programs "
                f"(counts {counts.tolist()}); the first that differs is program #{first}: {ran}")


def _parse_hook(value: str) -> tuple[str, int, int] | None:
    if not value:
        return None
    kind, process, step = value.split(":")
    if kind not in ("extra", "hang"):
        raise ValueError(f"{HOOK_ENV}={value!r}: expected extra:P:S or hang:P:S")
    return kind, int(process), int(step)
