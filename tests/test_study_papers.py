"""The papers' new study rows (`qurl_jax.study.runner.ROW_SETS`) for one RL step each, through
the study's own command, on SmolLM2-135M's layer widths (576 wide, 1536 MLP, 9 query and 3 KV
heads of 64; 2 of its 30 layers, the chain task's character vocabulary) with random weights (2
warm-start steps): each variant's own metrics are logged and within their ranges, and the
Sparse-RL rows' compressed-cache evaluations are written and tabled."""

import json
import math
import os
import subprocess
import sys

import pytest

from tests.cli import REPO, tree_first_pythonpath

CONFIG = '''
import os

from qurl_jax.config.base import load_config_file

_HERE = os.path.dirname(os.path.abspath(__file__))


def get_config():
    c = load_config_file({chain!r})
    c.model.tiny.update(dict(model_type="llama", hidden_size=576, intermediate_size=1536,
                             num_layers=2, num_heads=9, num_kv_heads=3, head_dim=64,
                             rope_theta=100000.0, tie_word_embeddings=True))
    c.sft.steps = 2
    c.data.prompts_per_step = 4
    c.rollout.n = 4
    c.rollout.max_new_tokens = 112  # 2 x the KV budget of 64 <= 16 prompt + 112 response tokens
    c.reward.function = os.path.join(_HERE, "reward.py") + ":digit_share"
    c.eval.max_examples = 2
    c.eval.max_new_tokens = 112
    c.optim.warmup_steps = 0
    c.train.loggers = ()
    return c
'''
# Random weights get no chain right: a reward that varies between samples gives GRPO advantages.
REWARD = '''
def digit_share(responses, answers):
    return [sum(ch.isdigit() for ch in r) / max(len(r), 1) for r in responses]
'''


def _metrics(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = [r for r in rows if "time/step_s" in r]
    assert len(steps) == 1, run_dir
    return steps[0]


def _fraction(m, key):
    assert key in m, key
    return 0.0 <= m[key] <= 1.0


@pytest.mark.slow  # ~14 min on 2 loaded cores: 15 one-step runs and 6 evaluations, 2 at a time
def test_papers_rows_run_one_step_with_their_metrics(tmp_path):
    from qurl_jax.study import runner

    (tmp_path / "cfg.py").write_text(CONFIG.format(chain=f"{REPO}/configs/chain_tiny.py"))
    (tmp_path / "reward.py").write_text(REWARD)
    names = sorted({v for rows in runner.ROW_SETS.values() for v in rows.variants})
    out = tmp_path / "study"
    env = dict(os.environ, PYTHONPATH=tree_first_pythonpath(),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    proc = subprocess.run(
        [sys.executable, "-m", "qurl_jax.study", f"--config={tmp_path / 'cfg.py'}",
         f"--out={out}", "--steps=1", "--seeds=1", "--jobs=2", f"--variants={','.join(names)}"],
        cwd=REPO, capture_output=True, text=True, timeout=1800, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    m = {n: _metrics(out / "runs" / f"{n}_s0") for n in names}
    variants = {v.name: v for v in runner.VARIANTS}
    for name in names:
        assert m[name]["rollout/kv_bytes_per_row"] > 0
        assert 0 < m[name]["time/rollout_share"] < 1
        done = json.loads((out / "runs" / f"{name}_s0" / "study_done.json").read_text())
        assert done["wall_s"] > 0 and 0.3 < done["peak_rss_gb"] < 20
        loss_mode = variants[name].overrides.get("rl.loss_mode", "acr")  # chain_tiny's: acr
        # ACR's bound share and its gradient's distance from TIS's, in TIS and ACR runs only.
        assert any(k.startswith("acr/") for k in m[name]) == (loss_mode in ("tis", "acr")), name
        if loss_mode in ("tis", "acr"):
            assert _fraction(m[name], "acr/bound_frac")
            assert math.isfinite(m[name]["acr/grad_rel_diff"]) and m[name][
                "acr/grad_rel_diff"] >= 0
        # The captured-code share, over all kernels and over q/k/v, for the quantized actors
        # (int8, and the unified flow's fp8_block).
        quantized = variants[name].overrides["rollout.precision"] != "fp"
        assert ("quant/code_change_fraction_qkv" in m[name]) == quantized, name
        if quantized:
            assert 0 < m[name]["quant/code_change_fraction"] <= 1
            assert 0 < m[name]["quant/code_change_fraction_qkv"] <= 1
        # The Sparse-RL rejection rate, counted by the corrected runs.
        assert ("sparse/vetoed_sequences" in m[name]) == (loss_mode == "sparse_rl"), name
        if loss_mode == "sparse_rl":
            assert _fraction(m[name], "vetoed_seq_frac")
    # The unified fp8_block flow with exact numerics: the rollout's log-probs are the learner's.
    exact = m["jetrl_fp8_block_exact"]
    assert exact["kl_behav_prox_k3"] == 0 and exact["logp_gap_abs_max"] == 0
    assert exact["raw_is_weight_min"] == exact["raw_is_weight_max"] == 1
    # The fp rollout is on-policy: nothing truncated, ACR's gradient is TIS's exactly.
    assert m["fp_mb4"]["acr/bound_frac"] == 0 and m["fp_mb4"]["acr/grad_rel_diff"] == 0
    # s = 1.5 shrinks the q/k/v kernels' quantization step: more of their codes move.
    assert (m["int8_acr_mb4_s1.5"]["quant/code_change_fraction_qkv"]
            > 1.2 * m["int8_acr_mb4"]["quant/code_change_fraction_qkv"])
    # KV bytes per row: 80 slots of the compressed caches against the dense 128, and 8-bit
    # codes with a float32 scale per token and head against float32 keys and values.
    dense = m["fp_mb4"]["rollout/kv_bytes_per_row"]
    for name in ("rkv_naive_mb4", "rkv_sparse_rl_mb4", "snapkv_naive_mb4", "snapkv_sparse_rl_mb4"):
        assert m[name]["rollout/kv_bytes_per_row"] == pytest.approx(dense * 80 / 128)
    assert m["int8_kv8_acr_mb4"]["rollout/kv_bytes_per_row"] == pytest.approx(
        m["int8_acr_mb4"]["rollout/kv_bytes_per_row"] * (64 + 4) / (64 * 4))
    # Each Sparse-RL row's policy evaluated under its compressed cache, the dense one under both.
    for name in names:
        for policy in variants[name].evals:
            record = json.loads((out / "runs" / f"{name}_s0" / "eval" /
                                 f"step_1_{policy}.json").read_text())
            assert record["kv_cache"] == {"policy": policy, "budget": 64, "interval": 16,
                                          "window": 8}
            assert _fraction(record["metrics"], "chain/greedy_acc")
    table = (out / "study.md").read_text()
    for column in ("rkv_cache chain greedy_acc", "snapkv_cache chain greedy_acc", "ACR bound",
                   "ACR-TIS grad", "capture qkv", "KV KiB/row", "learner share", "peak GB"):
        assert f" {column} |" in table
    assert "- fp_mb4_s0 under snapkv: " in table
