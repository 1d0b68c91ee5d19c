"""How many glibc malloc arenas the run's threads share (`config.train.malloc_arenas`).

glibc gives each thread that allocates an arena of its own, up to 8 per core, and keeps what is
freed in it for that arena's next allocation. XLA:CPU's worker threads allocate a learner
update's temporaries, so on a small machine the process's resident memory holds several arenas'
worth of freed buffers: measured on SmolLM2-135M's GRPO step (docs/performance.md, "The whole
RL step against main"), capping the arenas at 2 took 0.7-1.0 GB off the step's peak. The cap
is glibc's `M_ARENA_MAX` (what the `MALLOC_ARENA_MAX` environment variable sets when a process
starts); `mallopt` sets it in a running process, and it holds for the arenas created after it,
so `python -m qurl_jax.main` applies it right after reading the config, before JAX starts its
threads. A user's own `MALLOC_ARENA_MAX` wins. 0 leaves glibc's choice.

`trim` hands the heap's free pages back to the system (glibc's `malloc_trim`): a checkpoint save
(orbax and tensorstore's host buffers) left 1.4-2.2 GB of freed memory resident on a 1.9 GB
state, growing with each save, and the learner's next update allocated beside it
(docs/performance.md, "The real-model run on AVX2 CPUs"); `Checkpointer.save` trims after it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform

_M_ARENA_MAX = -8  # glibc's malloc.h


def cap_arenas(arenas: int) -> str | None:
    """Caps this process's malloc arenas at `arenas` (0: glibc's own limit); returns a line saying
    why it was not applied (not glibc, the environment already sets it), else None."""
    if arenas < 0:
        raise ValueError(f"malloc_arenas={arenas} must be >= 0")
    if arenas == 0:
        return None
    if os.environ.get("MALLOC_ARENA_MAX"):
        return None  # the user's own cap, read by glibc when the process started
    libc = _glibc()
    if libc is None:
        return f"config.train.malloc_arenas={arenas} not applied: this C library is not glibc"
    if libc.mallopt(_M_ARENA_MAX, arenas) != 1:
        return f"config.train.malloc_arenas={arenas} not applied: glibc's mallopt refused it"
    return None


def trim() -> bool:
    """Returns the free memory of the process's malloc heaps to the system (glibc's
    `malloc_trim(0)`); True when some was returned, False when none was or the C library is not
    glibc."""
    libc = _glibc()
    return False if libc is None else bool(libc.malloc_trim(0))


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library when it is glibc, else None; looked up once (`platform.libc_ver`
    reads the interpreter's binary, and `trim` runs twice a step)."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None
