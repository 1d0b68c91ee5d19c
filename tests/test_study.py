"""`python -m qurl_jax.study --quick`: two variants from one shared warm start, their table and
figures, and a rerun that finds every run finished and runs nothing again."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "qurl_jax.study.runner", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow  # ~2 min; CI runs it on its own (.ci/run), beside the embedded default
def test_quick_study_runs_two_variants_and_resumes(tmp_path):
    out = tmp_path / "study"
    proc = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("[study] start") == 2
    result = json.loads((out / "study.json").read_text())
    assert result["failed"] == [] and result["steps"] == 2
    assert set(result["variants"]) == {"fp", "int8_acr"}
    # Both runs loaded the one warm start, which only the first run evaluated (at step 0).
    assert set(result["before"]) >= {"eval/chain/greedy_acc", "eval/chain_carry10/greedy_acc"}
    assert (out / "warm_start" / "sft_model" / "config.json").is_file()
    for name in ("fp_s0", "int8_acr_s0"):
        rows = [json.loads(line) for line in (out / "runs" / name / "metrics.jsonl").open()]
        assert max(r["step"] for r in rows) == 2
        assert any("eval/chain/greedy_acc" in r and r["step"] == 0 for r in rows) == (
            name == "fp_s0")
        assert "--config.model.source=hf" in " ".join(
            json.loads((out / "runs" / name / "study_done.json").read_text())["command"])
    fp = result["variants"]["fp"]["runs"]["fp_s0"]
    int8 = result["variants"]["int8_acr"]["runs"]["int8_acr_s0"]
    assert int8["kl_behav_prox_k3"] > 0 and int8["kl_behav_prox_k3"] > 10 * abs(
        fp["kl_behav_prox_k3"])  # the quantized actor is off-policy, the fp one is not
    assert "quant/code_change_fraction" in int8 and "quant/code_change_fraction" not in fp
    table = (out / "study.md").read_text()
    for row in ("| warm start (before RL) |", "| fp rollout (reference) * | 1 |",
                "| int8 rollout, ACR (s = 1) * | 1 |"):
        assert row in table
    for png in ("study.png", "quantized.png"):
        assert (out / "plots" / png).stat().st_size > 10_000

    again = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "[study] start" not in again.stdout
    assert (out / "study.md").read_text().split("\n", 3)[3] == table.split("\n", 3)[3]
    # Finished runs are reused only for the same command; other settings stop the study.
    other = _study("--config=configs/chain_tiny.py", f"--out={out}", "--quick", "--steps=5",
                   "--variants=fp")
    assert other.returncode == 0, other.stderr[-3000:]  # --quick keeps its own 2 steps
    changed = _study(f"--config={REPO}/configs/chain_tiny.py", f"--out={out}", "--quick")
    assert changed.returncode == 1
    assert "finished runs made with other settings (fp_s0, int8_acr_s0)" in changed.stderr


def test_study_rejects_an_unknown_variant(tmp_path):
    proc = _study(f"--out={tmp_path}", "--variants=fp,int4_magic")
    assert proc.returncode == 2
    assert "--variants: unknown ['int4_magic']" in proc.stderr


def test_study_rejects_a_first_seed_for_rows_run_under_the_first_seed_only(tmp_path):
    proc = _study(f"--out={tmp_path}", "--variants=int8_acr,jetrl_fp8_block", "--first_seed=1")
    assert proc.returncode == 2
    assert "--first_seed=1: ['jetrl_fp8_block'] run under the first seed only" in proc.stderr
    assert not list(tmp_path.iterdir())  # refused before anything is written
