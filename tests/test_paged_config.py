"""The paged KV pool as run configuration: `rollout.kv_pages` / `kv_page_size` /
`kv_watermark_pages` through validation, the typed sampler settings, the factory, the memory plan
(the pool's bytes instead of rows x slots), `bench.memory --kv_capacity`'s suggested flags
(checked by compiling them), and the trainer's rollout through a pool that preempts, which gives
the static sampler's tokens."""

from __future__ import annotations

import json

import jax
import pytest

from qurl_jax.bench import memory as memory_bench
from qurl_jax.config.base import base_config, format_config, validate
from qurl_jax.config.settings import RunSettings, rollout_sampler_settings
from qurl_jax.models import ModelConfig, hf
from qurl_jax.plan import memory_plan
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.sampling import KVPolicyConfig, RefillSampler
from qurl_jax.sampling.factory import RolloutSamplerSettings, build_rollout_sampler


def _tiny():
    c = base_config()
    c.model.source, c.data.task, c.eval.files = "tiny", "arithmetic", []
    c.data.prompts_per_step, c.rollout.n = 4, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 16  # rows of 32 tokens: 2 pages
    c.eval.max_new_tokens = 16  # the tiny model has 256 positions
    return c


def test_fields_default_to_fixed_slots_and_reach_the_sampler_settings():
    c = _tiny()
    assert (c.rollout.kv_pages, c.rollout.kv_page_size, c.rollout.kv_watermark_pages) == (
        0, 16, -1)
    s = rollout_sampler_settings(validate(c))
    assert (s.kv_pages, s.kv_page_size, s.kv_watermark_pages, s.refills) == (0, 16, None, False)
    # kv_pages > 0 implies the refilling sampler under refill 'auto', even with every row in a
    # slot (max_concurrent_rows 0); above, the watermark's -1 became the sampler's default None.
    c.rollout.kv_pages, c.rollout.kv_page_size, c.rollout.kv_watermark_pages = 8, 8, 2
    s = rollout_sampler_settings(validate(c))
    assert (s.kv_pages, s.kv_page_size, s.kv_watermark_pages, s.refills) == (8, 8, 2, True)
    assert RunSettings.from_config(c).rollout.sampler == s
    printed = format_config(c)
    assert "rollout.kv_pages = 8  # Paged KV pool" in printed
    assert "rollout.kv_watermark_pages = 2  # Free pages" in printed


def test_a_run_resumes_with_another_pool(tmp_path):
    # The pool changes where the KV lives, not the tokens: like max_concurrent_rows, resumable.
    from qurl_jax.config import run_config

    run_config.check_and_save(base_config(), str(tmp_path), resuming=False)
    paged = base_config()
    paged.rollout.kv_pages, paged.rollout.kv_page_size = 64, 32
    paged.rollout.kv_watermark_pages = 4
    run_config.check_and_save(paged, str(tmp_path), resuming=True)


@pytest.mark.parametrize("fields,match", [
    ({"rollout.kv_pages": -1}, r"config\.rollout\.kv_pages=-1 must be >= 0"),
    ({"rollout.kv_page_size": 0}, r"config\.rollout\.kv_page_size=0 must be > 0"),
    ({"rollout.kv_watermark_pages": -2}, r"config\.rollout\.kv_watermark_pages=-2"),
    ({"rollout.kv_pages": 8, "rollout.refill": "off"},
     r"config\.rollout\.kv_pages=8: .*refilling sampler"),
    ({"rollout.kv_pages": 8, "rollout.kv_policy": "snapkv", "rollout.kv_budget": 16,
      "rollout.kv_interval": 4}, r"config\.rollout\.kv_pages=8: .*kv_policy='snapkv'"),
    ({"rollout.kv_pages": 9, "mesh.fsdp": 2, "rollout.tensor": "1"},
     r"config\.rollout\.kv_pages=9 must be a multiple of the batch shards .* = 2\)"),
    ({"rollout.kv_pages": 12, "mesh.data": 2, "mesh.dcn.fsdp": 4, "rollout.tensor": "1"},
     r"config\.rollout\.kv_pages=12 must be a multiple of the batch shards .* = 8\)"),
    ({"rollout.kv_pages": 2, "mesh.fsdp": 2, "rollout.tensor": "1"},
     r"config\.rollout\.kv_pages=2: a batch shard's pool of 1 pages of 16 tokens holds no row "
     r".* = 32 tokens \(needs 2 pages per shard, 4 in all\)"),
])
def test_validate_names_the_bad_paging_field(fields, match):
    c = _tiny()
    for name, value in fields.items():
        *section, field = name.split(".")
        node = c
        for part in section:
            node = node[part]
        node[field] = value
    with pytest.raises(ConfigError, match=match):
        validate(c)


def test_validate_leaves_the_shard_check_to_the_sampler_when_an_axis_is_minus_one():
    c = _tiny()
    c.rollout.kv_pages, c.mesh.fsdp = 7, -1
    validate(c)


def test_sampler_settings_and_factory(tiny_model_config):
    with pytest.raises(ValueError, match="rollout.kv_pages=-1"):
        RolloutSamplerSettings(kv_pages=-1)
    with pytest.raises(ValueError, match="kv_page_size=0"):
        RolloutSamplerSettings(kv_page_size=0)
    with pytest.raises(ValueError, match="rollout.kv_pages=4: .*refill='off'"):
        RolloutSamplerSettings(kv_pages=4, refill="off")
    with pytest.raises(ValueError, match="rollout.kv_pages=4: .*'rkv'"):
        RolloutSamplerSettings(kv_pages=4, kv_policy=KVPolicyConfig(policy="rkv", budget=8,
                                                                    interval=4, window=2))
    cfg = tiny_model_config("llama")
    settings = RolloutSamplerSettings(kv_pages=12, kv_page_size=4, kv_watermark_pages=1,
                                      rows_per_step=8)
    sampler = build_rollout_sampler(cfg, jax.lax.dot_general, settings, max_prompt_len=16,
                                    max_new_tokens=16)
    assert type(sampler) is RefillSampler and sampler.kv_watermark_pages == 1
    assert (sampler.engine.paging.num_pages, sampler.engine.paging.page_size) == (12, 4)
    dense = build_rollout_sampler(cfg, jax.lax.dot_general,
                                  RolloutSamplerSettings(refill="on", rows_per_step=8),
                                  max_prompt_len=16, max_new_tokens=16)
    assert dense.engine.paging is None


# A tiny model shape for the memory plan (a config.json, as under configs/shapes/).
CFG = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)


def _plan_config(tmp_path, kv_pages: int):
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG), f)
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.data.prompts_per_step, c.rollout.n = 8, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 48  # rows of 64 tokens
    c.rollout.max_concurrent_rows = 8  # 4 page-table rows per device
    c.rollout.kv_pages = kv_pages
    c.mesh.fsdp = 2
    return c


def test_memory_plan_counts_the_pool_not_rows_times_slots(tmp_path):
    # 40 pages of 16 over 2 devices: 20 per device, 1.25 rows' worth each of 4 page-table rows'
    # 64 tokens. decode_kv and the estimate report the pool's share; the compiled decode
    # program holds it.
    token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * CFG.compute_dtype.itemsize
    c = _plan_config(tmp_path, 40)
    setup = memory_plan.build_setup(RunSettings.from_config(c), CFG)
    kv = memory_plan.decode_kv(setup)
    assert kv == {"rows": 4, "cache_len": 64, "cache_bytes": 20 * 16 * token,
                  "prompt_len": 16, "max_new_tokens": 48, "rollout_rows": 8, "batch_shards": 2,
                  "token_bytes": token, "pages": 20, "page_size": 16,
                  "kv_dtype": str(CFG.compute_dtype),
                  "layer_elements": CFG.num_kv_heads * 20 * 16 * CFG.head_dim}
    program = memory_plan.rollout_decode(setup)
    (pool,) = [p for p in program.estimate.parts if p[0].startswith("KV page pool")]
    assert pool[2] == kv["cache_bytes"]
    assert program.estimate.symbols["pages"] == 20
    peak = memory_plan.compiled_memory(program.lowered.compile())["peak_bytes"]
    assert peak > kv["cache_bytes"]
    # Fixed slots: 4 rows x 64 slots per device in the same place.
    dense = memory_plan.build_setup(RunSettings.from_config(_plan_config(tmp_path, 0)), CFG)
    assert memory_plan.decode_kv(dense)["cache_bytes"] == 4 * 64 * token
    (slots,) = [p for p in memory_plan.rollout_decode(dense).estimate.parts
                if p[0].startswith("KV cache")]
    assert slots[2] == 4 * 64 * token


@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_the_suggestion_is_checked_by_compiling_the_insert_and_decode(tmp_path, monkeypatch):
    # The tiny shape's insert and decode with a suggested pool of 40 pages of 16 (20 per
    # device) behind 8 rows: within the 60 GiB cpu budget nothing changes; with a budget 2.5
    # pages short of the larger peak, at least 3 pages per device come off the pool, until the
    # programs compile within it.
    token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * CFG.compute_dtype.itemsize
    settings = RunSettings.from_config(_plan_config(tmp_path, 0))
    suggested = {"rollout.kv_pages": 40, "rollout.kv_page_size": 16,
                 "rollout.max_concurrent_rows": 8}
    check = memory_bench.check_suggestion(settings, str(tmp_path), "cpu", suggested, token)
    assert check["fits"] and check["suggested_config"] == suggested
    (first,) = check["checks"]
    assert set(first["peaks"]) == {"rollout_prefill", "rollout_decode"}
    budget = max(first["peaks"].values()) - 5 * 16 * token // 2
    monkeypatch.setattr(memory_plan, "budget_bytes", lambda target: budget)
    check = memory_bench.check_suggestion(settings, str(tmp_path), "cpu", suggested, token)
    assert check["checks"][0]["over_bytes"] == 5 * 16 * token // 2
    assert check["fits"] and check["checks"][-1]["over_bytes"] == 0
    pages = check["suggested_config"]["rollout.kv_pages"]
    assert pages <= 34 and pages % 2 == 0 and pages == check["checks"][-1]["kv_pages"]
    line = memory_bench.describe_suggestion(check["suggested_config"], check["fits"])
    assert line.endswith("(insert and decode compiled within the budget)") and "\n" not in line
    # A pool cut below one row (64 tokens: 4 pages per device) is no suggestion.
    monkeypatch.setattr(memory_plan, "budget_bytes", lambda target: budget - 14 * 16 * token)
    check = memory_bench.check_suggestion(settings, str(tmp_path), "cpu", suggested, token)
    assert check["suggested_config"] is None and not check["fits"]


def test_kv_capacity_suggests_the_pool_as_config_flags():
    kv = {"rows": 4, "cache_len": 64, "cache_bytes": 4 * 64 * 100, "token_bytes": 100,
          "prompt_len": 16, "max_new_tokens": 48, "rollout_rows": 8, "batch_shards": 2}
    # Room for 6 rows more than the decode program's 4: 10 fixed slots, 40 pages per device,
    # 4 x 10 paged rows per device, of which the rollout fills 8 (its rows per device).
    figures = {"budget_bytes_per_device": 54321 + 10 * 64 * 100, "decode_kv": kv,
               "programs": {"rollout_decode": {"peak_bytes": 54321 + kv["cache_bytes"]}}}
    capacity = memory_bench.capacity(figures, page_size=16)
    assert (capacity["fixed_slots"], capacity["num_pages"]) == (10, 40)
    assert capacity["paged_slots"] == 40
    assert capacity["suggested_config"] == {"rollout.kv_pages": 80, "rollout.kv_page_size": 16,
                                            "rollout.max_concurrent_rows": 16}
    line = memory_bench.describe_suggestion(capacity["suggested_config"])
    assert line == ("suggested config: --config.rollout.kv_pages=80 "
                    "--config.rollout.kv_page_size=16 --config.rollout.max_concurrent_rows=16")
    assert memory_bench.suggested_config(capacity, 2)["rollout.max_concurrent_rows"] == 80
    assert "\n" not in line
    # The suggestion is a valid config for that mesh.
    c = _tiny()
    c.mesh.fsdp = 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 48
    c.rollout.kv_pages = capacity["suggested_config"]["rollout.kv_pages"]
    validate(c)
    none = memory_bench.capacity({**figures, "budget_bytes_per_device": 54321}, page_size=16)
    assert none["suggested_config"] is None
    assert "none" in memory_bench.describe_suggestion(None)


@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_trainer_rollout_through_a_page_pool_gives_the_static_result(tmp_path):
    # 2 prompts x 4 samples, 4 page-table rows, a pool of 12 pages of 4 tokens (a row of the
    # 32-token prompt bucket + 6 new tokens needs 10), too small for 4 rows at once: rows are
    # preempted and regenerated, and the trainer's rollout (tokens, masks, behaviour log-probs)
    # is the static sampler's.
    import numpy as np

    from qurl_jax import quant
    from qurl_jax.runtime.metrics import PhaseTimer
    from qurl_jax.train.trainer import Trainer
    from tests.test_trainer import tiny_config

    rollouts = {}
    for pages in (12, 0):
        c = tiny_config(**{"rollout.max_concurrent_rows": 4, "rollout.max_new_tokens": 6,
                           "rollout.kv_pages": pages, "rollout.kv_page_size": 4,
                           "rollout.refill": "auto" if pages else "off"})
        t = Trainer(c, str(tmp_path / str(pages)))
        assert isinstance(t.sampler, RefillSampler) == bool(pages)
        r, _ = t.collect(quant.requantize(t.params, t.recipe), PhaseTimer())
        r.resolve()
        if pages:
            assert t.sampler.engine.paging.num_pages == 12
            run = t.sampler.last_run
            assert 0 < run.peak_pages <= 12 and run.preemptions > 0, run
        rollouts[pages] = r
    paged, static = rollouts[12], rollouts[0]
    for name in ("tokens", "attn_mask", "resp_mask", "lengths", "rewards"):
        np.testing.assert_array_equal(getattr(paged, name), getattr(static, name), err_msg=name)
    np.testing.assert_allclose(paged.logp_behav, static.logp_behav, rtol=1e-6, atol=1e-6)


def test_a_pool_the_compiler_refuses_is_shrunk_by_its_temporaries(tmp_path, monkeypatch):
    # XLA:TPU refuses to plan a program whose temporaries exceed the chip (the 7B config's
    # suggested pool on tpu:v5p-32 did): the round counts it as over the budget by them and
    # the next round compiles a smaller pool, instead of the command ending in a traceback.
    token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * CFG.compute_dtype.itemsize
    settings = RunSettings.from_config(_plan_config(tmp_path, 0))
    suggested = {"rollout.kv_pages": 40, "rollout.kv_page_size": 16,
                 "rollout.max_concurrent_rows": 8}
    budget = memory_plan.budget_bytes(memory_plan.targets.parse("cpu"))
    temps = (budget + 2 * 16 * token) / memory_plan.GIB  # 2 pages per device over
    kv = {"batch_shards": 2, "cache_len": 64}
    calls = []

    def refuse_once(*args, **kwargs):  # then a plan within the budget (no compile needed)
        calls.append(1)
        if len(calls) == 1:  # the report records the compiler's refusal (no traceback)
            return {"programs": {}, "budget_bytes_per_device": budget, "refused": {
                "rollout_prefill": "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total "
                f"memory required for HLO temporaries ({temps:.9f}G) exceeds available HBM "
                "(95.74G)."}, "fits": {"rollout_prefill": False}}
        return {"programs": {"rollout_prefill": {"peak_bytes": budget},
                             "rollout_decode": {"peak_bytes": budget - 1}},
                "budget_bytes_per_device": budget, "decode_kv": kv}

    monkeypatch.setattr(memory_plan, "report", refuse_once)
    with pytest.raises(memory_plan.PlanError):  # no decode_kv to shrink by: one line
        memory_bench.check_suggestion(settings, str(tmp_path), "cpu", suggested, token)
    calls.clear()
    check = memory_bench.check_suggestion(settings, str(tmp_path), "cpu", suggested, token,
                                          decode_kv=kv)
    first, second = check["checks"]
    assert first["refused"].startswith("RESOURCE_EXHAUSTED") and "peaks" not in first
    assert abs(first["over_bytes"] - 2 * 16 * token) <= 2
    assert second["kv_pages"] == 40 - 2 * 2 and check["fits"]
    assert check["suggested_config"]["rollout.kv_pages"] == 36
