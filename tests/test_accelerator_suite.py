"""`python -m qurl_jax.bench.accelerator --suite`, the device run that fits one GPU lease, run as
its CPU dry run at tiny shapes: every field of its JSON is written, the rollout rows of the cases
asked for, the whole RL step with both rollouts, and the cases past the budget listed as skipped.
The figures mean nothing on a CPU; the fields and their relations are what is checked."""

from __future__ import annotations

import json

import pytest

from qurl_jax.bench import accelerator

ROLLOUT_FIELDS = {
    "model", "case", "precision", "kv_precision", "page_size", "steps_per_call", "batch",
    "prompt_len", "new_tokens", "decode_tokens_per_s", "decode_step_ms",
    "prefill_and_first_token_s", "warmup_s", "actor_s", "sampler_setup_s", "timed_s",
    "actor_weight_gib", "kv_cache_gib",
    "bytes_read_per_step_gib", "achieved_gb_per_s", "hbm_bound_ms", "fraction_of_hbm_bound",
    "achieved_fraction_of_bandwidth", "predicted_step_ms", "measured_over_predicted",
    "vs_bf16", "vs_bf16_kv", "vs_dense"}
RL_PHASES = {"requantize_s", "rollout_s", "logprobs_s", "update_s", "step_s",
             "generated_tokens"}


def test_suite_dry_run_writes_every_field(tmp_path):
    out = tmp_path / "suite.json"
    # The first rollout (bf16, paged, 256 rows), 8-bit KV on a paged pool, the whole RL step,
    # one layer's attention and the fused products against XLA's.
    assert accelerator.SUITE[2] == "rl_step" and accelerator.SUITE[6][0] == "attention"
    assert accelerator.SUITE[7][0] == "products"
    accelerator.main(["--suite", "--tiny", "--suite_only=0,3,2,6,7", "--prompt_len=16",
                      "--new_tokens=8", "--rounds=1", "--rl_prompts=2", "--rl_n=2",
                      f"--json={out}"])
    figures = json.loads(out.read_text())
    assert figures["suite"] and figures["skipped"] == [] and figures["suite_s"] > 0
    assert {"chip", "chip_bandwidth_gb_per_s", "budget_s", "device"} <= set(figures)
    rows = figures["rollout"]
    assert [r["case"] for r in rows] == [accelerator.suite_case_name(*accelerator.SUITE[i])
                                         for i in (0, 3)]
    for r in rows:
        assert set(r) == ROLLOUT_FIELDS, set(r) ^ ROLLOUT_FIELDS
        # tokens/s of the decode steps (all but the first token) = rows / step time.
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] / r["decode_step_ms"] * 1e3)
        # No chip figures for a CPU: the fields are there, empty.
        assert r["hbm_bound_ms"] is None and r["predicted_step_ms"] is None
    assert rows[1]["kv_precision"] == "int8" and rows[1]["page_size"] == 16
    # Attention on the CPU: XLA's dense path, the CPU kernel, the paged pool in both KV
    # precisions (the tilings' sweep runs on a GPU only).
    assert [(r["cache"], r["kv_precision"]) for r in figures["attention"]] == [
        ("dense", "bf16"), ("dense", "bf16"), ("paged", "bf16"), ("paged", "int8")]
    products = figures["products"]  # on a CPU both samplers run XLA's products
    assert products["rows"] == 64 and products["order"] == "A B B A"
    assert products["fused_speedup"] == pytest.approx(products["xla_step_ms"]
                                                      / products["fused_step_ms"])
    assert products["fused_predicted_ms"] is None and products["xla_predicted_ms"] is None
    rl = figures["rl_step"]
    assert set(rl["fp"]) == set(rl["int8"]) == RL_PHASES
    assert rl["rows"] == 4 and rl["fp"]["generated_tokens"] == 4 * 8
    assert rl["step_speedup"] == pytest.approx(rl["fp"]["step_s"] / rl["int8"]["step_s"])


def test_suite_cases_past_the_budget_are_listed(tmp_path):
    out = tmp_path / "suite.json"
    accelerator.main(["--suite", "--tiny", "--budget_s=-1", f"--json={out}"])
    figures = json.loads(out.read_text())
    assert figures["rollout"] == [] and figures["rl_step"] is None
    assert len(figures["skipped"]) == len(accelerator.SUITE)
    assert all(s["reason"].startswith("budget") for s in figures["skipped"])
