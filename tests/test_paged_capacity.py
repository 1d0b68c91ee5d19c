"""`bench.paged.kv_capacity`: the rows one device's KV memory keeps in flight, fixed slots vs a
paged pool, on made-up numbers; and the decode program's KV figures it reads
(`memory_plan.decode_kv`, `bench.memory.capacity`) on a tiny model."""

from __future__ import annotations

import pytest

from qurl_jax.bench import memory as memory_bench
from qurl_jax.bench import paged
from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.models import ModelConfig
from qurl_jax.plan import memory_plan

# Made-up per-device figures: 1000 bytes of KV per token, rows of 32 + 256 tokens (288000 bytes),
# a decode program of 5 MB whose cache is 4 such rows.
TOKEN, PROMPT, NEW = 1000, 32, 256
ROW = TOKEN * (PROMPT + NEW)
PEAK, CACHE = 5_000_000, 4 * ROW
NON_KV = PEAK - CACHE


def _capacity(budget: int, **kwargs):
    return paged.kv_capacity(budget_bytes=budget, peak_bytes=PEAK, cache_bytes=CACHE,
                             token_bytes=TOKEN, prompt_len=PROMPT, max_new_tokens=NEW,
                             page_size=8, stream_rows_per_slot=40, **kwargs)


def test_memory_arithmetic_and_paged_rows_in_the_stream():
    # Room for 10 rows and a bit: 10 fixed slots, 2885000 // 8000 = 360 pages.
    c = _capacity(NON_KV + 10 * ROW + 5000, batch_rows=8)
    assert (c["non_kv_bytes"], c["kv_bytes"]) == (NON_KV, 10 * ROW + 5000)
    assert (c["fixed_slots"], c["num_pages"], c["paged_slots"]) == (10, 360, 40)
    assert c["watermark_pages"] == 22 and c["fits_one_row"]
    stream = c["cases"]["stream"]
    assert stream["rows"] == 400
    # While rows wait, every fixed slot is busy; the paged pool holds more in the same memory,
    # near the time-average expectation (responses of median 64 of 256 tokens, 32-token prompts).
    assert stream["fixed"]["mean_in_flight_busy"] == 10.0
    ratio = stream["ratio_in_flight"]
    assert ratio == stream["paged"]["mean_in_flight_busy"] / 10.0
    assert 1.8 < ratio <= 4, ratio
    assert abs(ratio - stream["expected"]["time_average"]) < 0.5, stream
    assert stream["paged"]["peak_pages"] <= 360
    # One rollout of 8 rows, fewer than the fixed slots: both hold all of them from the start.
    batch = c["cases"]["batch"]
    assert batch["fixed"]["steps"] == batch["paged"]["steps"]
    assert batch["ratio_in_flight"] == 1.0
    assert paged.describe_capacity(c)[0].startswith("KV capacity per device")


def test_no_room_for_one_row_gives_zero_rows():
    for budget in (NON_KV - 1, NON_KV + ROW - 1):
        c = _capacity(budget, batch_rows=8)
        assert not c["fits_one_row"]
        assert (c["fixed_slots"], c["paged_slots"], c["cases"]) == (0, 0, {})
        assert c["kv_bytes"] == max(budget - NON_KV, 0)
        assert "no room for one row" in paged.describe_capacity(c)[-1]
    # Exactly one row: one fixed slot, a pool of exactly that row's 36 pages.
    c = _capacity(NON_KV + ROW)
    assert (c["fixed_slots"], c["num_pages"], c["paged_slots"]) == (1, 36, 4)
    assert set(c["cases"]) == {"stream"}


def test_non_kv_memory_per_decoded_row():
    # 12000 bytes of non-KV per row decoded at once, 4 of them in the planned program: the rest
    # of non-KV stays; 10 fixed slots of row + overhead; the pool pays for its 40 page-table rows.
    over = 12000
    base = NON_KV - 4 * over
    c = _capacity(base + 10 * (ROW + over) + 5000, row_overhead_bytes=over, planned_rows=4)
    assert c["kv_bytes"] == 10 * (ROW + over) + 5000 - 4 * over
    assert (c["fixed_slots"], c["paged_slots"]) == (10, 40)
    assert c["pool_bytes"] == 10 * (ROW + over) + 5000 - 40 * over
    assert c["num_pages"] == c["pool_bytes"] // 8000 == 315
    assert any("non-KV per row" in line for line in paged.describe_capacity(c))
    # Room for one fixed slot, but the paged batch's overhead leaves its pool no whole row.
    c = _capacity(base + 2 * ROW, row_overhead_bytes=ROW, planned_rows=4)
    assert not c["fits_one_row"] and c["pool_bytes"] == 0 and c["cases"] == {}


def test_bad_figures_are_refused():
    with pytest.raises(ValueError, match="token_bytes=0"):
        paged.kv_capacity(budget_bytes=1, peak_bytes=1, cache_bytes=0, token_bytes=0,
                          prompt_len=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="cache_bytes=9"):
        paged.kv_capacity(budget_bytes=1, peak_bytes=8, cache_bytes=9, token_bytes=1,
                          prompt_len=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="fixed slots per device"):
        _capacity(NON_KV + (paged.MAX_SIMULATED_SLOTS + 1) * ROW)


CFG = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)


def _tiny_config():
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.data.prompts_per_step, c.rollout.n = 8, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 48
    c.rollout.max_concurrent_rows = 8  # 8 refill slots of 16 rows, 4 per device
    c.mesh.fsdp = 2
    return c


def test_decode_kv_of_a_tiny_config_feeds_the_capacity():
    c = _tiny_config()
    setup = memory_plan.build_setup(RunSettings.from_config(c), CFG)
    kv = memory_plan.decode_kv(setup)  # no compile
    token = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * CFG.compute_dtype.itemsize
    assert kv == {"rows": 4, "cache_len": 64, "cache_bytes": 4 * 64 * token,
                  "token_bytes": token, "prompt_len": 16, "max_new_tokens": 48,
                  "rollout_rows": 8, "batch_shards": 2, "kv_dtype": str(CFG.compute_dtype),
                  "layer_elements": 4 * CFG.num_kv_heads * 64 * CFG.head_dim}
    # A report's figures (made-up peak) with room for 6 rows more than the decode program's 4:
    # 10 fixed slots, 10 * 64 / 16 = 40 pages; the batch case is the rollout's 8 rows per device.
    peak = kv["cache_bytes"] + 12345
    figures = {"budget_bytes_per_device": peak + 6 * 64 * token, "decode_kv": kv,
               "programs": {"rollout_decode": {"peak_bytes": peak}}}
    capacity = memory_bench.capacity(figures, page_size=16)
    assert (capacity["fixed_slots"], capacity["num_pages"]) == (10, 40)
    assert capacity["non_kv_bytes"] == 12345
    assert set(capacity["cases"]) == {"stream", "batch"}
    assert capacity["cases"]["batch"]["rows"] == 8
    # A compressed cache has no capacity figures; the command line says so in one line.
    c.rollout.kv_policy, c.rollout.kv_budget, c.rollout.kv_interval = "snapkv", 16, 8
    assert memory_plan.decode_kv(memory_plan.build_setup(RunSettings.from_config(c), CFG)) is None
    with pytest.raises(SystemExit, match="kv_policy compresses"):
        memory_bench.capacity({**figures, "decode_kv": None}, page_size=16)


@pytest.mark.parametrize("pages", [0, 32])
def test_an_8bit_cache_counts_its_codes_and_scales(pages):
    # rollout.kv_precision = int8: 1 byte per element plus a 4-byte scale per token and kv head,
    # K and V, every layer; the capacity then fits rows by those bytes (head_dim 16: 0.625x f32).
    c = _tiny_config()
    c.rollout.kv_pages = pages
    full = memory_plan.decode_kv(memory_plan.build_setup(RunSettings.from_config(c), CFG))
    c.rollout.kv_precision = "int8"
    kv = memory_plan.decode_kv(memory_plan.build_setup(RunSettings.from_config(c), CFG))
    token = 2 * CFG.num_layers * CFG.num_kv_heads * (CFG.head_dim + 4)
    assert kv["token_bytes"] == token and full["token_bytes"] == 2 * CFG.num_layers * (
        CFG.num_kv_heads * CFG.head_dim * 4)
    assert kv["cache_bytes"] * full["token_bytes"] == full["cache_bytes"] * token
    assert kv.pop("kv_dtype") == "int8" and full.pop("kv_dtype") == str(CFG.compute_dtype)
    assert {k: v for k, v in kv.items() if "bytes" not in k} == {
        k: v for k, v in full.items() if "bytes" not in k}


@pytest.mark.slow
def test_decode_row_overhead_of_a_tiny_config(tmp_path):
    # Two compiles of the tiny decode program (4 and 2 rows per device): the non-KV bytes grow
    # per row by at least the last position's logits (f32, vocabulary 512).
    import json

    from qurl_jax.models import hf

    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG), f)
    c = _tiny_config()
    settings = RunSettings.from_config(c)
    figures = memory_plan.report(settings, str(tmp_path), log=lambda _: None,
                                 programs=("rollout_decode",))
    overhead = memory_bench.decode_row_overhead(settings, str(tmp_path), "cpu", figures)
    assert overhead["rows"] == [4, 2]
    assert overhead["bytes_per_row"] >= CFG.vocab_size * 4, overhead
    capacity = memory_bench.capacity({**figures, "budget_bytes_per_device":
                                      figures["programs"]["rollout_decode"]["peak_bytes"]
                                      + 6 * figures["decode_kv"]["cache_bytes"] // 4},
                                     page_size=16, overhead=overhead)
    assert capacity["row_overhead_bytes"] == overhead["bytes_per_row"]
    assert 0 < capacity["fixed_slots"] < 10 and capacity["row_overhead_from"] == overhead


def test_simulate_splits_rows_over_batch_shards_not_tensor_ways():
    # 32 concurrent rows on a data 1 x fsdp -1 x tensor 2 mesh (16 devices on two 8-device
    # hosts): 8 batch shards, so 4 fixed slots per device (tensor parallelism splits heads).
    c = base_config()
    c.data.prompts_per_step, c.rollout.n = 4, 4
    c.data.max_prompt_len, c.rollout.max_new_tokens = 8, 64
    c.rollout.max_concurrent_rows = 32
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = 1, -1, 2
    out = paged.simulate(c, page_size=8, slot_factor=4, prompt_len=None, stream_rows=64, seed=0,
                         watermark_pages=None, log=lambda _: None)
    assert (out["fixed_slots"], out["paged_slots"]) == (4, 16)
    assert out["num_pages"] == 4 * (8 + 64) // 8
    assert out["batch"]["rows"] == 16 // 8
