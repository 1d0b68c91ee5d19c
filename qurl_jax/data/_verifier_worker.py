"""Private: entry point of one verifier worker process (`python -m qurl_jax.data._verifier_worker`).

Started by `VerifierPool` with argv `[memory_limit_mb, *preload]`. It asks the kernel to kill it
when the parent dies (Linux), caps its address space, runs the preload entries ("module" imports it,
"module:function" also calls the function, e.g. to warm caches up), reports ready, then answers
`(fn, args)` requests from stdin until stdin closes. Replies go to a private copy of stdout while
anything printed goes to stderr, so output cannot corrupt the protocol.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import resource
import signal
import sys

from qurl_jax.data._process_pool import READY, read_payload, write_message


def _die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this worker when its parent dies, even mid-computation."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(pr_set_pdeathsig, signal.SIGKILL)


def main(argv: list[str]) -> None:
    """Serves requests until EOF on stdin; argv = [memory_limit_mb, *preload entries]."""
    _die_with_parent()
    memory_limit_mb = int(argv[0])
    if memory_limit_mb > 0:
        limit = memory_limit_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    out_fd = os.dup(1)
    os.dup2(2, 1)
    in_fd = sys.stdin.fileno()
    # math_verify warns once that its signal-based timeouts are off; the hard limit is the pool's.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    for entry in argv[1:]:
        module, _, function = entry.partition(":")
        imported = importlib.import_module(module)
        if function:
            getattr(imported, function)()
    write_message(out_fd, READY)
    while True:
        try:
            payload = read_payload(in_fd, None)
        except EOFError:
            return
        try:
            fn, args = pickle.loads(payload)
            reply = (True, fn(*args))
        except Exception as e:  # noqa: BLE001 - a failing request is reported, never fatal
            reply = (False, f"{type(e).__name__}: {e}")
        write_message(out_fd, reply)


if __name__ == "__main__":
    main(sys.argv[1:])
