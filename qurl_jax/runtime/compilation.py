"""XLA compilation of a run: JAX's persistent compilation cache, and what compiling cost.

A run compiles each of its programs (rollout prefill and decode per bucket, log-probs, the learner
update, requantize) when it first calls them, again in every restarted process, and, with the
memory preflight (`train.preflight`), twice: the preflight compiles its own copies of the programs
to read their memory. At the paper scales one program takes tens of seconds to minutes. JAX's
persistent cache (`jax_compilation_cache_dir`) stores each executable under a key of its HLO,
compile options, device kind and JAX version, so a program that compiles again in this process or
a later one is loaded instead. `main.py` turns it on at
`train.compilation_cache_dir` (default `<workdir>/compile_cache`) before anything compiles.

JAX's own rules apply: an executable is written only if it took at least
`jax_persistent_cache_min_compile_time_secs` (default 1 s) to compile, and only by process 0 of a
multi-process run; the other processes read it when the directory is shared (a bucket URL workdir
is), and compile for themselves when it is not. The cache is initialised once per process, so a
later `enable_persistent_cache` with another path changes nothing (a warning says so).

`compile_stats()` counts what compiling cost from JAX's monitoring events: programs compiled (cache
hits included: JAX times the load as the compile), their seconds, the persistent-cache hits and
the compile seconds those saved. The trainer reports each step's delta (a program compiled after
the first step is a shape or setting that changed) and the run's totals.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
from absl import logging

from qurl_jax.runtime.metrics import join, local_abspath

_COMPILE = "/jax/core/compile/backend_compile_duration"
_HIT = "/jax/compilation_cache/cache_hits"
_SAVED = "/jax/compilation_cache/compile_time_saved_sec"


def cache_dir(setting: str, workdir: str) -> str | None:
    """The cache directory `train.compilation_cache_dir` names: 'auto' is `<workdir>/compile_cache`,
    '' is None (no persistent cache), anything else a path or URL as given."""
    if setting == "auto":
        return join(local_abspath(workdir), "compile_cache")
    return local_abspath(setting) if setting else None


def enable_persistent_cache(path: str | None) -> None:
    """Points JAX's persistent compilation cache at `path` (None: leaves it as it is). Call before
    the process compiles anything it should cache."""
    if path is None:
        return
    current = jax.config.jax_compilation_cache_dir
    if current and current != path:
        logging.warning("compilation cache: this process already uses %s; %s is not used",
                        current, path)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    logging.info("compilation cache: %s (programs compiling in >= %.1f s are stored)", path,
                 jax.config.jax_persistent_cache_min_compile_time_secs)


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Totals of this process's compilations since `compile_stats()` was first called.

    programs: executables compiled or loaded from the persistent cache; seconds: their time;
    cache_hits: loaded from the persistent cache; saved_s: compile seconds those hits saved (as
    recorded when each was stored, less the load).
    """

    programs: int = 0
    seconds: float = 0.0
    cache_hits: int = 0
    saved_s: float = 0.0

    def since(self, before: CompileStats) -> CompileStats:
        return CompileStats(self.programs - before.programs, self.seconds - before.seconds,
                            self.cache_hits - before.cache_hits, self.saved_s - before.saved_s)

    def metrics(self, prefix: str = "compile/") -> dict[str, float]:
        return {f"{prefix}{f.name}": float(getattr(self, f.name))
                for f in dataclasses.fields(self)}


_lock = threading.Lock()
_totals: dict[str, float] | None = None  # the process's running totals, once tracking started


def _on_duration(event: str, secs: float, **_: object) -> None:
    with _lock:
        if event == _COMPILE:
            _totals["programs"] += 1
            _totals["seconds"] += secs
        elif event == _SAVED:
            _totals["saved_s"] += secs


def _on_event(event: str, **_: object) -> None:
    if event == _HIT:
        with _lock:
            _totals["cache_hits"] += 1


def compile_stats() -> CompileStats:
    """The process's totals so far; the first call starts counting (registers JAX monitoring
    listeners, once per process), so compilations before it are not included."""
    global _totals
    with _lock:
        if _totals is None:
            _totals = dict.fromkeys(("programs", "seconds", "cache_hits", "saved_s"), 0.0)
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
        return CompileStats(int(_totals["programs"]), _totals["seconds"],
                            int(_totals["cache_hits"]), _totals["saved_s"])
