"""The embedded default end to end (slow): the README's main-job command, a format-repair demo.

The warm start imitates a teacher whose correct answers often carry a stray end character that the
exact-match verifier rejects; RL has to learn the rewarded format. The run must finish within 10
minutes, print the summary table and raise the held-out sampled accuracy (Avg@4) by at least 10
points. The control run repeats it from the same warm start with the updates discarded (learning
rate 0 in effect, `train.apply_updates=False`): it must not gain, so the gain comes from the RL
updates, not from evaluation noise or a broken path that improves without learning.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(workdir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/arith_tiny.py",
         f"--workdir={workdir}", "--config.train.progress=False", *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))


def _avg4_before_after(workdir) -> tuple[float, float]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        evals = [json.loads(line) for line in f if '"eval/arith/avg@4"' in line]
    return evals[0]["eval/arith/avg@4"], evals[-1]["eval/arith/avg@4"]


@pytest.mark.slow
def test_format_repair_demo_gains_through_rl_updates_only(tmp_path):
    rl_dir, control_dir = tmp_path / "rl", tmp_path / "control"
    start = time.time()
    proc = _run(rl_dir)
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 600, f"took {elapsed:.0f} s"
    assert "before RL" in proc.stdout and "quantized / fp32" in proc.stdout
    before, after = _avg4_before_after(rl_dir)
    assert after - before >= 0.10, (before, after)

    # Same warm start (the cache is keyed on its settings), same seed, no parameter change.
    shutil.copytree(rl_dir / "sft_model", control_dir / "sft_model")
    proc = _run(control_dir, "--config.train.apply_updates=False",
                "--config.train.report_speed=False")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    control_before, control_after = _avg4_before_after(control_dir)
    assert control_before == before
    assert abs(control_after - control_before) < 0.05, (control_before, control_after)
