"""`qurl_jax.bench.paged`'s admission simulation on tiny settings: the fixed-slot schedule by hand,
and the paged pool holding more rows in flight than fixed slots in the same memory."""

from __future__ import annotations

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
