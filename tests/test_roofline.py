"""plan.roofline (and its command line, bench.roofline): the counted decode-step flops, the live
slots of the tail_limits distribution, the ragged adjustment of a hand-made record, the table,
and a compile for an H100 (skipped without the CUDA plugin)."""

from __future__ import annotations

import numpy as np
import pytest

from qurl_jax.bench import roofline as roofline_cli
from qurl_jax.bench.sampler import tail_limits
from qurl_jax.models.config import ModelConfig
from qurl_jax.parallel import targets
from qurl_jax.plan import roofline

TINY = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")


def test_step_flops_counts_every_matrix_parameter_and_the_cache() -> None:
    # per layer: q 128x128, k and v 128x64, o 128x128, MLP 3 x 128x256; LM head 128x512
    params = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256) + 128 * 512
    attention = 4 * 2 * 4 * 32 * 100
    assert roofline.step_flops(TINY, 3, 100) == 3 * (2 * params + attention)


def test_table_gives_the_ratio_to_bf16_and_the_measurement() -> None:
    rows = [dict(target="gpu:h100-1", model="m", batch=64, actor=a, argument_bytes=2**30 * b,
                 bound="memory", predicted_step_ms=1.0, predicted_tokens_per_s=t,
                 measured_tokens_per_s=meas)
            for a, b, t, meas in (("bf16", 6.0, 1000.0, 900.0), ("int8", 4.8, 1250.0, None))]
    table = roofline_cli.markdown_table(rows).splitlines()
    assert "| 1.00x | 900 |" in table[2]
    assert "| 1.25x |  |" in table[3]


@pytest.mark.slow
def test_h100_decode_compile_predicts_a_memory_bound_step() -> None:
    target = targets.parse("gpu:h100-1")
    try:
        target.devices()
    except targets.TargetError as e:
        pytest.skip(str(e))
    bf16 = roofline.predict(target, "tiny", 8, "bf16", config=TINY)
    int8 = roofline.predict(target, "tiny", 8, "int8", config=TINY)
    assert bf16["bound"] == "memory" and bf16["argument_bytes"] >= bf16["weight_bytes"]
    assert int8["weight_bytes"] < bf16["weight_bytes"]
    assert bf16["predicted_tokens_per_s"] == pytest.approx(
        8 / (bf16["argument_bytes"] / roofline.CHIPS["h100"]["bandwidth"]))


def _record(actor: str, weight_bytes: float, batch: int = 256) -> dict:
    """A hand-made dense record (no compile): a 7B-like case, 2 GiB of KV per 64 slots."""
    record = dict(target="gpu:h100-1", chip="h100", model="m", batch=batch, actor=actor,
                  attention="dense", cache_slots=1536, kv_cache_bytes=24 * 2**30,
                  argument_bytes=weight_bytes + 24 * 2**30 + 2**20,
                  attention_flops_per_step=1.0e12, measured_tokens_per_s=None)
    record.update(roofline._roofline(record, record["argument_bytes"], 5.0e12))
    return record


def test_length_pmf_is_the_distribution_tail_limits_draws_from() -> None:
    pmf = roofline.length_pmf(1024)
    draws = tail_limits(200_000, 1024)
    assert pmf.shape == (1024,) and pmf.sum() == pytest.approx(1.0, abs=1e-12)
    assert pmf[-1] == pytest.approx(np.mean(draws == 1024), abs=3e-3)  # the clip at max_new
    lengths = np.arange(1, 1025)
    assert (pmf * lengths).sum() == pytest.approx(draws.mean(), rel=5e-3)
    # the row-step mean of live slots in a rollout of these draws: sum of (512 + k), k <= L
    empirical = 512 + (draws * (draws + 1.0) / 2).sum() / draws.sum()
    assert roofline.live_slots(512, 1024) == pytest.approx(empirical, rel=2e-3)


def test_live_slots_by_schedule() -> None:
    refill, equal = roofline.live_slots(512, 1024), roofline.live_slots(512, 1024, "equal")
    assert equal == 512 + 512.5
    assert 512 + 256 < refill < equal < 512 + 1024  # the tail pulls the mean past the median
    assert roofline.live_slots(0, 1) == 1.0  # one token: its own slot
    with pytest.raises(ValueError, match="schedule"):
        roofline.live_slots(512, 1024, "paged")


def test_ragged_record_drops_exactly_the_dead_slot_bytes_and_flops() -> None:
    dense = _record("bf16", 15e9)
    live = 1536 * 0.25
    ragged = roofline.ragged_record(dense, live)
    assert ragged["attention"] == "ragged" and "adjusted analytically" in ragged["note"]
    assert dense["bytes_per_step"] - ragged["bytes_per_step"] == 0.75 * 24 * 2**30
    assert dense["flops_per_step"] - ragged["flops_per_step"] == pytest.approx(0.75e12)
    assert ragged["argument_bytes"] == dense["argument_bytes"]  # the compiled figure is kept
    assert ragged["predicted_tokens_per_s"] == pytest.approx(
        256 / (ragged["bytes_per_step"] / roofline.CHIPS["h100"]["bandwidth"]))
    full = roofline.ragged_record(dense, 1536)  # every row at full length reads every slot
    for field in ("bytes_per_step", "flops_per_step", "predicted_tokens_per_s", "bound"):
        assert full[field] == pytest.approx(dense[field])
    assert dense["attention"] == "dense"  # not changed in place
    with pytest.raises(ValueError, match="live"):
        roofline.ragged_record(dense, 1537)


def test_ragged_attention_raises_the_quantized_actor_ratio() -> None:
    live = roofline.live_slots(512, 1024)
    bf16, int8 = _record("bf16", 15.2e9), _record("int8", 7.6e9)
    dense_ratio = int8["predicted_tokens_per_s"] / bf16["predicted_tokens_per_s"]
    r_bf16, r_int8 = roofline.ragged_record(bf16, live), roofline.ragged_record(int8, live)
    ragged_ratio = r_int8["predicted_tokens_per_s"] / r_bf16["predicted_tokens_per_s"]
    assert 1.0 < dense_ratio < ragged_ratio < 15.2 / 7.6
    assert r_bf16["predicted_tokens_per_s"] > bf16["predicted_tokens_per_s"]


def test_table_shows_dense_and_ragged_side_by_side() -> None:
    live = roofline.live_slots(512, 1024)
    records = []
    for actor, weights in (("bf16", 15.2e9), ("int8", 7.6e9)):
        dense = _record(actor, weights)
        records += [dense, roofline.ragged_record(dense, live)]
    head, _, bf16, int8 = roofline_cli.markdown_table(records).splitlines()
    assert "vs bf16 (dense)" in head and "vs bf16 (ragged)" in head and "ragged / dense" in head
    cells = [c.strip() for c in int8.split("|")[1:-1]]
    tokens = [r["predicted_tokens_per_s"] for r in records]  # bf16 dense, ragged; int8 same
    assert cells[8] == f"{tokens[2] / tokens[0]:.2f}x"  # int8 vs bf16, dense
    assert cells[13] == f"{tokens[3] / tokens[1]:.2f}x"  # int8 vs bf16, ragged
    assert cells[14] == f"{tokens[3] / tokens[2]:.2f}x" and bf16.count("1.00x") == 2


def test_cli_rejects_an_unknown_attention() -> None:
    with pytest.raises(SystemExit, match="--attention=paged"):
        roofline_cli.main(["--target=gpu:h100-1", "--attention=paged"])
