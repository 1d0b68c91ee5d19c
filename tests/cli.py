"""Helpers for tests of the command-line entry points."""

from __future__ import annotations

import subprocess


def assert_one_line(out: subprocess.CompletedProcess, *words: str) -> str:
    """The one `qurl_jax: ...` error line of a run that stopped with rc 2 and no traceback; each
    of `words` must be in it."""
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("qurl_jax: ")]
    assert len(lines) == 1, text[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]
