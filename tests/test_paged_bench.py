"""`qurl_jax.bench.paged`'s admission simulation on tiny settings: the fixed-slot schedule by hand,
and the paged pool holding more rows in flight than fixed slots in the same memory."""

from __future__ import annotations

import os

import numpy as np

from qurl_jax.bench import paged
from qurl_jax.bench.sampler import tail_limits


def test_fixed_slots_by_hand():
    # Two slots; rows of 3, 1 and 2 tokens. Step 1: rows 0 and 1; row 1 ends and its slot takes
    # row 2; steps 2 and 3: rows 0 and 2, which both end at step 3.
    result = paged.simulate_fixed(np.array([3, 1, 2]), slots=2)
    assert result.steps == 3
    assert result.mean_in_flight == 2.0 and result.mean_in_flight_busy == 2.0


def test_paged_holds_more_rows_than_fixed_slots_in_the_same_memory():
    max_new, prompt, page, fixed_slots = 256, 32, 8, 4
    limits = tail_limits(400, max_new, seed=3)
    fixed = paged.simulate_fixed(limits, fixed_slots)
    pages = fixed_slots * (prompt + max_new) // page
    result = paged.simulate_paged(limits, prompt, prompt + max_new, pages, page, 4 * fixed_slots,
                                  watermark_pages=pages // 16)
    expected = paged.expectations(limits, prompt, max_new)
    ratio = result.mean_in_flight_busy / fixed.mean_in_flight_busy
    assert 1.8 < ratio <= 4, ratio
    assert abs(ratio - expected["time_average"]) < 0.5, (ratio, expected)
    assert result.steps < fixed.steps and result.peak_pages <= pages


def test_decode_reads_by_hand():
    kw = dict(prompt_len=2, cache_len=5)
    # One slot: the 3-token row reads 3, 4, 5 slots, then the 1-token row 3.
    assert paged.decode_reads(np.array([3, 1]), 1, live=True, **kw) == (4, 15)
    assert paged.decode_reads(np.array([3, 1]), 1, live=False, **kw) == (4, 20)
    # Two slots: both rows' first tokens in one step (3 + 3), then 4 and 5.
    assert paged.decode_reads(np.array([3, 1]), 2, live=True, **kw) == (3, 15)
    assert paged.decode_reads(np.array([3, 1]), 2, live=False, **kw) == (3, 30)
    # Two one-slot replicas in one program: 3 steps of the slowest, each reading the actor
    # (100 bytes) on every device; the busiest device's KV (12 tokens of 10 bytes).
    assert paged.rollout_reads(np.array([3, 1]), 2, 1, token_bytes=10, actor_bytes=100,
                               live=True, **kw) == (3, 3 * 100 + 12 * 10)
    assert paged.rollout_reads(np.array([3, 1]), 2, 1, token_bytes=10, actor_bytes=100,
                               live=False, **kw) == (3, 3 * 100 + 3 * 5 * 10)


def test_reads_of_the_1p5b_config_favour_live_reads_of_every_row():
    config = os.path.join(os.path.dirname(__file__), "..", "configs", "deepscaler_r1_1p5b_int8.py")
    out = paged.reads_table(config, [64, 128], 2 << 30, log=lambda _: None)
    by = {(c["slots"], c["live"]): c["speedup"] for c in out["cases"]}
    steps = {(c["slots"], c["live"]): c["steps"] for c in out["cases"]}
    assert out["config_slots"] == 128 and by[(128, False)] == 1.0  # the whole rollout at once
    # Every slot read: more rows cost more than they save; live reads: the reverse.
    assert by[(128, False)] < by[(64, False)] < by[(64, True)] < by[(128, True)]
    assert by[(128, True)] / by[(64, False)] > 3  # the config's pool against 64 fixed slots
    assert steps[(128, True)] == 8192  # all rows at once: the longest row's steps
