"""The embedded default end to end (slow): the README's main-job command, under 10 minutes, with RL
raising the held-out accuracy by at least 10 points and the summary table printed."""

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_arith_tiny_trains_and_improves(tmp_path):
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/arith_tiny.py",
         f"--workdir={tmp_path}", "--config.train.progress=False"],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 600, f"took {elapsed:.0f} s"
    assert "before RL" in proc.stdout and "quantized / fp32" in proc.stdout
    evals = [json.loads(line) for line in open(tmp_path / "metrics.jsonl", encoding="utf-8")
             if '"eval/arith/avg@4"' in line]
    before, after = evals[0]["eval/arith/avg@4"], evals[-1]["eval/arith/avg@4"]
    assert after - before >= 0.10, (before, after)
