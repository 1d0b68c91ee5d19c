"""Shared by the tests that compile for a TPU or H100 target without one
(`qurl_jax.parallel.targets`)."""

import pytest

from qurl_jax.parallel import targets


def compiler_or_skip(target: str) -> targets.Target:
    """The parsed `target` whose compile-only devices exist; the test is skipped, with the line
    naming the extra to install, where its compiler is absent."""
    t = targets.parse(target)
    try:
        t.devices()
    except targets.TargetError as e:
        pytest.skip(str(e))
    return t
