"""The paged KV cache's host bookkeeping (`qurl_jax.sampling._page_pool`): pages never held twice
or lost, rows never lost or duplicated, every row finishes, preemption when the pool runs short."""

from __future__ import annotations

import numpy as np
import pytest

from qurl_jax.sampling._page_pool import Admission, PagedScheduler, PagePool, pages_for


def test_pool_grows_all_or_nothing_and_release_returns_pages():
    pool = PagePool(num_pages=6, page_size=4, slots=3, pages_per_slot=4)
    assert pool.grow(np.array([0, 1]), np.array([5, 4]))  # 2 + 1 pages
    assert pool.free_pages == 3 and pool.held.tolist() == [2, 1, 0]
    assert pool.shortfall(np.array([0, 2]), np.array([9, 8])) == 1 + 2
    assert not pool.grow(np.array([0, 2]), np.array([16, 5]))  # 2 + 2 > 3: nothing changes
    assert pool.free_pages == 3 and pool.held.tolist() == [2, 1, 0]
    owners = pool.owners()
    assert sorted(owners[owners >= 0].tolist()) == [0, 0, 1]
    table0 = pool.page_table[0, :2].copy()
    assert pool.release([0]) == 2 and pool.free_pages == 5
    assert (pool.page_table[0] == 0).all()
    # Freed pages go to the next row that grows: reuse, never double ownership.
    assert pool.grow(np.array([2]), np.array([8]))
    assert sorted(pool.page_table[2, :2].tolist()) == sorted(table0.tolist())
    pool.owners()
    with pytest.raises(ValueError, match="exceed"):
        pool.shortfall(np.array([1]), np.array([17]))


def _check(sched: PagedScheduler, finished: list[int]) -> None:
    """Pages held once or free; a row in one place only (waiting, one slot, or finished)."""
    owners = sched.pool.owners()
    assert set(owners[owners >= 0].tolist()) <= set(np.flatnonzero(sched.active).tolist())
    in_flight = sched.slot_row[sched.active].tolist()
    places = in_flight + list(sched._queue) + finished
    assert len(places) == len(set(places)), places


def _run(sched: PagedScheduler, targets: dict[int, int], finished: list[int] | None = None,
         ahead: int = 1, max_steps: int = 100_000) -> tuple[list[int], int]:
    """Drives the scheduler like the sampler, `ahead` decode steps per host call: row r finishes
    after generating targets[r] tokens (or at max_tokens); a preempted row starts again from its
    prompt. Checks the invariants every call; returns (finish order, calls)."""
    finished = [] if finished is None else finished
    generated = np.zeros(sched.pool.slots, np.int64)
    steps = 0
    while not sched.idle:
        for slot, _ in sched.admit():
            generated[slot] = 0
        sched.reserve_step(ahead)
        active = sched.active
        # Every active slot has room for the tokens it writes before the next call.
        room = np.minimum(sched.lengths[active] + ahead, sched.max_tokens)
        assert (sched.pool.held[active] * sched.pool.page_size >= room).all()
        generated[active] += ahead
        done = np.zeros(sched.pool.slots, bool)
        done[active] = generated[active] >= [targets[r] for r in sched.slot_row[active]]
        finished += sched.advance(done, steps=ahead)
        _check(sched, finished)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return finished, steps


def test_rows_wait_for_pages_and_all_finish_in_a_small_pool():
    pool = PagePool(num_pages=10, page_size=4, slots=4, pages_per_slot=8)
    sched = PagedScheduler(pool, max_tokens=32)
    prompts = [3, 5, 8, 2, 4, 6]
    sched.submit(range(6), prompts)
    placed = sched.admit()
    # Pages for prompts: 1, 2, 2, 1 = 6 of 10, all 4 slots; rows 4 and 5 wait for a slot.
    assert [r for _, r in placed] == [0, 1, 2, 3] and sched.waiting == 2
    finished, _ = _run(sched, {0: 20, 1: 1, 2: 24, 3: 5, 4: 10, 5: 3})
    assert sorted(finished) == list(range(6))
    assert pool.free_pages == 10


def test_preemption_frees_the_latest_row_and_requeues_it_in_front():
    pool = PagePool(num_pages=4, page_size=4, slots=2, pages_per_slot=4)
    sched = PagedScheduler(pool, max_tokens=16)
    sched.submit([7, 8], [4, 4])
    assert [r for _, r in sched.admit()] == [7, 8]  # one page each
    sched.submit([9], [4])
    preempted = []
    for _ in range(8):  # both rows grow to 12 tokens = 3 pages each > 4 pages
        preempted += sched.reserve_step()
        sched.advance()
    assert [r for _, r in preempted] == [8] and sched.preemptions == 1
    assert list(sched._queue) == [8, 9]  # the preempted row goes before later submissions
    assert sched.slot_row.tolist() == [7, -1] and sched.lengths[0] == 12
    pool.owners()


@pytest.mark.parametrize("seed", range(12))
def test_random_schedules_lose_nothing_and_finish_everything(seed):
    rng = np.random.default_rng(seed)
    page_size = int(rng.choice([1, 4, 16]))
    max_tokens = int(rng.integers(4, 12)) * page_size
    slots = int(rng.integers(1, 9))
    pages_per_slot = int(pages_for(max_tokens, page_size)) + int(rng.integers(0, 2))
    num_pages = int(rng.integers(pages_per_slot, pages_per_slot * slots + 2))
    pool = PagePool(num_pages, page_size, slots, pages_per_slot)
    sched = PagedScheduler(pool, max_tokens, Admission(int(rng.integers(0, 3))))
    n = int(rng.integers(1, 40))
    prompts = rng.integers(1, max_tokens // 2, n)
    rows = rng.permutation(1000)[:n]
    targets = {int(r): int(rng.integers(1, max_tokens + 1)) for r in rows}
    finished: list[int] = []
    # Rows arrive in a few batches while others are in flight (and stop at random there).
    for chunk in np.array_split(np.arange(n), 3):
        sched.submit(rows[chunk], prompts[chunk])
        for _ in range(int(rng.integers(0, 20))):
            sched.admit()
            sched.reserve_step()
            finished += sched.advance(rng.random(slots) < 0.02)
            _check(sched, finished)
    _run(sched, targets, finished, ahead=int(rng.choice([1, 1, 3, 8])))
    assert sorted(finished) == sorted(rows.tolist())
    assert sched.idle and pool.free_pages == num_pages
    assert (pool.page_table == 0).all() and (pool.held == 0).all()


def test_reserving_several_steps_ahead():
    pool = PagePool(num_pages=16, page_size=4, slots=2, pages_per_slot=4)
    sched = PagedScheduler(pool, max_tokens=16)
    sched.submit([0, 1], [3, 13])
    sched.admit()
    assert sched.reserve_step(ahead=6) == []
    assert pool.held.tolist() == [3, 4]  # 9 tokens; 19 capped at max_tokens = 16
    assert sched.advance(np.array([False, False]), steps=3) == [1]  # row 1 reached 16
    assert sched.lengths.tolist() == [6, 0] and pool.held.tolist() == [3, 0]
    with pytest.raises(ValueError, match="ahead=0"):
        sched.reserve_step(ahead=0)


def test_bad_settings_name_the_field():
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(0, 16, 4, 4)
    with pytest.raises(ValueError, match="max_tokens=100"):
        PagedScheduler(PagePool(4, 16, 2, 8), 100)
    sched = PagedScheduler(PagePool(8, 4, 2, 8), 16)
    with pytest.raises(ValueError, match="prompt of 16 tokens"):
        sched.submit([0], [16])
    sched.submit([1], [3])
    with pytest.raises(ValueError, match="row 1 was already submitted"):
        sched.submit([1], [3])
