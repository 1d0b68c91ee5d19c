"""Quiet good runs: library INFO chatter (orbax logs a line per array on every save or restore)
kept out of the commands' output; warnings and errors, and qurl_jax's own INFO lines, still pass."""

from __future__ import annotations

import logging as std_logging

from absl import logging


class QuietLibraries(std_logging.Filter):
    """Drops INFO chatter from orbax/JAX internals; warnings and errors still pass, and qurl_jax's
    own INFO lines are kept."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        noisy = any(part in record.pathname for part in ("orbax", "jax/_src", "tensorboardX"))
        return record.levelno >= std_logging.WARNING or not noisy


def quiet_libraries() -> None:
    """Adds `QuietLibraries` to absl's handler (what `python -m qurl_jax.main` and
    `python -m qurl_jax.evaluate` log through)."""
    handler = logging.get_absl_handler()
    if not any(isinstance(f, QuietLibraries) for f in handler.filters):
        handler.addFilter(QuietLibraries())
