"""Helpers for tests of the command-line entry points."""

from __future__ import annotations

import os
import subprocess

# The default suite's XLA flags: its programs are tiny and compile for far longer than they run
# (XLA's backend compile was about two thirds of four test files' worker time), so it compiles
# them without LLVM's optimisation passes and with XLA:CPU's older loop emitters instead of its
# MLIR fusion emitters: those files' compile time fell to about a quarter and their wall time to
# half (docs/testing.md). XLA's HLO passes (fusion, layouts, the Eigen and YNNPACK calls) are
# unchanged. conftest.py puts the flags in the suite's XLA_FLAGS unless the environment already
# has XLA_FLAGS; `cli_env` gives them to the subprocesses. The tests of a run's figures (the
# embedded default, the chain task, the study) set their own XLA_FLAGS and compile as a user's
# run does.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def cli_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a test's JAX subprocess: this process's, on the CPU with `devices` host
    devices and the suite's XLA flags, and `extra` on top."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {SUITE_XLA_FLAGS}")
    env.update(extra)
    return env


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tree_first_pythonpath() -> str:
    """PYTHONPATH with this tree first: a subprocess imports this tree's qurl_jax from any working
    directory (as an installed package would be), then what the user's PYTHONPATH holds."""
    return os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))


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
