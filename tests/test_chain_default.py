"""The chain task end to end (slow): the README's command for `configs/chain_tiny.py`.

The warm start imitates a teacher that forgets the carry of an addition whose units digits sum to
exactly ten most of the time, so greedy decoding inherits the slip; GRPO with full-precision
rollouts, rewarded on the final answer only, has to teach the carry. The whole run (warm start
included) must finish within the issue's 15 minutes on the 2-core CPU, raise held-out greedy
accuracy and sampled Avg@4 (temperature 1) by at least 10 points each, fix the sub-case (reported
as its own evaluation set) and write the run's plots.
"""

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _evals(workdir) -> tuple[dict, dict]:
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if '"eval/chain/greedy_acc"' in line]
    return rows[0], rows[-1]


@pytest.mark.slow
def test_chain_rl_teaches_the_carry_the_warm_start_gets_wrong(tmp_path):
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/chain_tiny.py",
         f"--workdir={tmp_path}", "--config.train.progress=False"],
        cwd=REPO, capture_output=True, text=True, timeout=1500,
        env=dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1"))
    elapsed = time.time() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert elapsed < 900, f"took {elapsed:.0f} s"
    before, after = _evals(tmp_path)
    assert before["step"] == 0 and after["step"] > 0
    for metric in ("eval/chain/greedy_acc", "eval/chain/avg@4"):
        assert after[metric] - before[metric] >= 0.10, (metric, before[metric], after[metric])
    # The warm start is systematically wrong on the sub-case, and RL is what fixes it.
    sub = "eval/chain_carry10/greedy_acc"
    assert before[sub] < 0.25 and after[sub] - before[sub] >= 0.30, (before[sub], after[sub])
    assert "chain_carry10/avg@4" in proc.stdout  # the summary table reports the sub-case
    assert os.path.getsize(tmp_path / "plots" / "reward_accuracy.png") > 0
