"""Host-side bookkeeping of a paged KV cache: which pages of one pool each decode slot holds.

A fixed-slot cache reserves max_tokens for every row although reasoning responses are long-tailed;
a paged cache gives a row fixed-size pages as it grows, so the same memory holds more rows in
flight. Two pieces, both pure numpy, no device work:

- `PagePool`: the pages of one pool (every layer's k and v pools share one page numbering) and the
  page table i32[slots, pages_per_slot] that `models.decode_attention.paged_decode_attention`
  reads. Slots grow all-or-nothing and release all their pages at once.
- `PagedScheduler`: rows through the slots. A queue of waiting rows; `admit` places queue heads in
  free slots while the pool has pages for their prompts (plus a watermark); `reserve_step` gives
  every active row a page for its next token, and when the pool runs short preempts the most
  recently admitted rows (their pages freed, their rows put back at the head of the queue, to be
  regenerated from the start with the same random stream); `advance` counts the step's token and
  releases finished rows. A row is always in exactly one place: waiting, in one slot, or done.

The driver's step (the sampler's decode loop, host side between device steps):

    for slot, row in sched.admit(): prefill row into slot's pages (sched.page_table[slot])
    for slot, row in sched.reserve_step(): forget slot's device state (the row was requeued)
    run one decode step on sched.page_table, with each active slot writing logical slot
        sched.lengths[slot] and attending to sched.lengths[slot] + 1 tokens
    sched.advance(finished)  # bool[slots]: rows that sampled EOS or reached their limit

The page table's unused entries hold 0 (a valid page index, as the kernels require); inactive
slots have length 0.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable

import numpy as np


def pages_for(tokens: np.ndarray | int, page_size: int) -> np.ndarray:
    """Pages that hold `tokens` tokens (ceil division), elementwise."""
    return -(-np.asarray(tokens) // page_size)


class PagePool:
    """`num_pages` pages of `page_size` tokens shared by `slots` page-table rows of at most
    `pages_per_slot` pages each. Pages are handed out from a free stack; a slot's pages fill its
    page-table row from the left."""

    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_slot: int):
        if min(num_pages, page_size, slots, pages_per_slot) < 1:
            raise ValueError(f"PagePool: num_pages={num_pages}, page_size={page_size}, "
                             f"slots={slots}, pages_per_slot={pages_per_slot} must all be >= 1")
        self.num_pages, self.page_size = num_pages, page_size
        self.slots, self.pages_per_slot = slots, pages_per_slot
        self.page_table = np.zeros((slots, pages_per_slot), np.int32)
        self.held = np.zeros(slots, np.int32)  # pages of each slot: page_table[s, :held[s]]
        # Free stack: _free[:_top] are free; popping takes from the top.
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int32)
        self._top = num_pages

    @property
    def free_pages(self) -> int:
        return self._top

    def shortfall(self, slots: np.ndarray, tokens: np.ndarray) -> int:
        """Pages missing for slots[i] to hold tokens[i] tokens (0 when they already do)."""
        slots = np.asarray(slots, np.int64)
        want = pages_for(tokens, self.page_size)
        if want.size and want.max() > self.pages_per_slot:
            raise ValueError(f"PagePool: {int(np.max(tokens))} tokens exceed a slot's "
                             f"{self.pages_per_slot * self.page_size}")
        return int(np.maximum(want - self.held[slots], 0).sum())

    def grow(self, slots: np.ndarray, tokens: np.ndarray) -> bool:
        """Gives slots[i] (distinct) enough pages for tokens[i] tokens; all or nothing. Returns
        False, changing nothing, when the free pages do not suffice."""
        slots = np.asarray(slots, np.int64)
        tokens = np.asarray(tokens, np.int64)
        if self.shortfall(slots, tokens) > self._top:
            return False
        extra = np.maximum(pages_for(tokens, self.page_size) - self.held[slots], 0)
        for slot, n in zip(slots[extra > 0].tolist(), extra[extra > 0].tolist(), strict=True):
            start = int(self.held[slot])
            self.page_table[slot, start:start + n] = self._free[self._top - n:self._top][::-1]
            self._top -= n
            self.held[slot] += n
        return True

    def release(self, slots: Iterable[int]) -> int:
        """Returns every page of these slots to the pool; the number of pages freed."""
        freed = 0
        for slot in slots:
            n = int(self.held[slot])
            self._free[self._top:self._top + n] = self.page_table[slot, :n]
            self._top += n
            self.page_table[slot, :n] = 0
            self.held[slot] = 0
            freed += n
        return freed

    def keep(self, slots: np.ndarray) -> None:
        """Keeps only these slots' page-table rows, renumbered 0 .. len(slots) - 1 in this order;
        the slots left out must hold no page."""
        slots = np.asarray(slots, np.int64)
        dropped = np.setdiff1d(np.arange(self.slots), slots)
        if self.held[dropped].any():
            raise ValueError(f"PagePool.keep: slots {dropped[self.held[dropped] > 0].tolist()} "
                             f"still hold pages")
        self.page_table, self.held = self.page_table[slots], self.held[slots]
        self.slots = len(slots)

    def owners(self) -> np.ndarray:
        """i32[num_pages]: the slot holding each page, -1 for a free page. Raises if a page is
        held twice or lost (neither free nor held): the pool's invariant."""
        owner = np.full(self.num_pages, -1, np.int64)
        seen = np.zeros(self.num_pages, np.int64)
        np.add.at(seen, self._free[:self._top], 1)
        for slot in np.flatnonzero(self.held):
            pages = self.page_table[slot, :self.held[slot]]
            np.add.at(seen, pages, 1)
            owner[pages] = slot
        if not (seen == 1).all():
            bad = np.flatnonzero(seen != 1)[:8]
            raise AssertionError(f"PagePool: pages {bad.tolist()} are held {seen[bad].tolist()} "
                                 f"times")
        return owner.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Admission:
    """How `PagedScheduler.admit` decides.

    watermark_pages: free pages an admission must leave, so that the rows in flight can still
    grow a while before one is preempted (0: admit while the prompt fits).
    """

    watermark_pages: int = 0


class PagedScheduler:
    """Rows of known prompt length through `pool.slots` decode slots backed by a `PagePool`.

    Rows are any distinct ints. `lengths[s]` is the tokens slot s's row has in the cache (prompt
    plus generated); `slot_row[s]` its row or -1. See the module docstring for the step."""

    def __init__(self, pool: PagePool, max_tokens: int, admission: Admission = Admission()):
        if pages_for(max_tokens, pool.page_size) > min(pool.pages_per_slot, pool.num_pages):
            raise ValueError(f"PagedScheduler: max_tokens={max_tokens} needs "
                             f"{int(pages_for(max_tokens, pool.page_size))} pages; a slot holds "
                             f"{pool.pages_per_slot} and the pool {pool.num_pages}")
        self.pool, self.max_tokens, self.admission = pool, max_tokens, admission
        self.lengths = np.zeros(pool.slots, np.int32)
        self.slot_row = np.full(pool.slots, -1, np.int64)
        self._admitted_at = np.zeros(pool.slots, np.int64)  # admission counter, for the victim
        self._clock = 0
        self._queue: collections.deque[int] = collections.deque()
        self._prompt_len: dict[int, int] = {}
        self.preemptions = 0

    # ------------------------------------------------------------------------------ queue
    def submit(self, rows: Iterable[int], prompt_lens: Iterable[int]) -> None:
        """Queues rows (at the tail) with their prompt lengths."""
        for row, n in zip(rows, prompt_lens, strict=True):
            row, n = int(row), int(n)
            if row in self._prompt_len:
                raise ValueError(f"PagedScheduler.submit: row {row} was already submitted")
            if not 0 < n < self.max_tokens:
                raise ValueError(f"PagedScheduler.submit: row {row}'s prompt of {n} tokens is "
                                 f"not in [1, max_tokens={self.max_tokens})")
            self._prompt_len[row] = n
            self._queue.append(row)

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def queue(self) -> collections.deque[int]:
        """The waiting rows, head first (read it; change it through `submit` only)."""
        return self._queue

    @property
    def active(self) -> np.ndarray:
        """bool[slots]: slots with a row."""
        return self.slot_row >= 0

    def admit(self) -> list[tuple[int, int]]:
        """Places queue heads into free slots while the pool has pages for their prompts and the
        watermark (an empty pool admits its first row whatever the watermark); returns the
        (slot, row) pairs placed, in order. Rows wait in queue order (a head that does not fit
        blocks those behind it)."""
        placed = []
        free_slots = np.flatnonzero(~self.active)
        for slot in free_slots:
            if not self._queue:
                break
            row = self._queue[0]
            n = self._prompt_len[row]
            need = int(pages_for(n, self.pool.page_size))
            if (self.pool.free_pages - need < self.admission.watermark_pages
                    and (self.active.any() or placed)):
                break
            self.pool.grow(np.array([slot]), np.array([n]))
            self._queue.popleft()
            self.slot_row[slot] = row
            self.lengths[slot] = n
            self._clock += 1
            self._admitted_at[slot] = self._clock
            placed.append((int(slot), row))
        return placed

    def reserve_step(self, ahead: int = 1) -> list[tuple[int, int]]:
        """Gives every active row room for `ahead` more tokens (capped at max_tokens; `ahead` > 1
        lets the device run that many steps between two host calls). When the pool is short,
        preempts rows (the most recently admitted first) until the others fit: their pages are
        freed, their slots emptied, their rows put back at the head of the queue (the earliest
        admitted in front). Returns the preempted (slot, row) pairs."""
        if ahead < 1:
            raise ValueError(f"PagedScheduler.reserve_step: ahead={ahead} must be >= 1")
        preempted = []
        while True:
            slots = np.flatnonzero(self.active)
            want = np.minimum(self.lengths[slots] + ahead, self.max_tokens)
            if self.pool.grow(slots, want):
                break
            victim = int(slots[np.argmax(self._admitted_at[slots])])
            preempted.append((victim, int(self.slot_row[victim])))
            self._vacate(victim)
        for _, row in preempted:  # latest admitted first, so the earliest ends up in front
            self._queue.appendleft(row)
        self.preemptions += len(preempted)
        return preempted

    @property
    def idle(self) -> bool:
        """No row waiting or in flight: every submitted row has finished."""
        return not self._queue and not self.active.any()

    def advance(self, finished: np.ndarray | None = None, steps: int = 1) -> list[int]:
        """Counts `steps` tokens (at most the `ahead` reserved) for every active row, then releases
        the slots of `finished` (bool[slots]: rows that sampled EOS or reached their limit during
        these steps; rows that reach max_tokens finish too). Returns the finished rows."""
        active = self.active
        self.lengths[active] = np.minimum(self.lengths[active] + steps, self.max_tokens)
        done = active & (self.lengths >= self.max_tokens)
        if finished is not None:
            done |= np.asarray(finished, bool) & active
        rows = [int(r) for r in self.slot_row[done]]
        for slot in np.flatnonzero(done):
            self._vacate(int(slot))
        for row in rows:
            del self._prompt_len[row]
        return rows

    def keep(self, slots: np.ndarray) -> None:
        """Keeps only these slots, renumbered 0 .. len(slots) - 1 in this order (the decode
        state shrunk to them); every slot with a row must be among them."""
        slots = np.asarray(slots, np.int64)
        self.pool.keep(slots)  # raises if a slot left out holds pages, as every active one does
        self.lengths, self.slot_row = self.lengths[slots], self.slot_row[slots]
        self._admitted_at = self._admitted_at[slots]

    def _vacate(self, slot: int) -> None:
        self.pool.release([slot])
        self.slot_row[slot] = -1
        self.lengths[slot] = 0


class ShardedScheduler:
    """A `PagedScheduler` per batch shard, in the global numbering a sharded decode state uses:
    shard d owns slots [d S, (d + 1) S) and pages [d P, (d + 1) P) of the pool (S slots and P
    pages per shard), and queues only the rows submitted to it."""

    def __init__(self, shards: int, slots_per_shard: int, pages_per_shard: int, page_size: int,
                 max_tokens: int, watermark_pages: int | None = None):
        per_row = int(pages_for(max_tokens, page_size))
        watermark = pages_per_shard // 16 if watermark_pages is None else watermark_pages
        self.pages_per_shard = pages_per_shard
        self.shards = [PagedScheduler(PagePool(pages_per_shard, page_size, slots_per_shard,
                                               per_row), max_tokens, Admission(watermark))
                       for _ in range(shards)]

    @property
    def queues(self) -> list[collections.deque[int]]:
        return [s.queue for s in self.shards]

    @property
    def active(self) -> np.ndarray:
        """bool[R]: slots with a row, global order."""
        return np.concatenate([s.active for s in self.shards])

    @property
    def preemptions(self) -> int:
        return sum(s.preemptions for s in self.shards)

    @property
    def pages_held(self) -> int:
        return sum(s.pool.num_pages - s.pool.free_pages for s in self.shards)

    def _global(self, d: int, pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        slots = self.shards[d].pool.slots
        return [(d * slots + slot, row) for slot, row in pairs]

    def admit(self) -> list[tuple[int, int]]:
        """Every shard's `PagedScheduler.admit`, as (global slot, row) pairs."""
        return [p for d, s in enumerate(self.shards) for p in self._global(d, s.admit())]

    def reserve(self, ahead: int) -> list[tuple[int, int]]:
        """Every shard's `PagedScheduler.reserve_step(ahead)`: the preempted (global slot, row)
        pairs."""
        return [p for d, s in enumerate(self.shards)
                for p in self._global(d, s.reserve_step(ahead))]

    def advance(self, live: np.ndarray, steps: int) -> None:
        """After `steps` decode steps: rows that were in flight and are no longer `live` (bool[R],
        global) finished and return their pages."""
        active = self.active
        finished = np.split(active & ~np.asarray(live, bool), len(self.shards))
        for s, done in zip(self.shards, finished, strict=True):
            s.advance(done, steps)

    def keep(self, slots: np.ndarray) -> None:
        """Every shard keeps its block of `slots` (global, len(slots) / shards per shard, in
        shard order), renumbered: the refilling sampler's shrink."""
        per_shard = len(slots) // len(self.shards)
        for d, s in enumerate(self.shards):
            block = np.asarray(slots[d * per_shard:(d + 1) * per_shard]) - d * s.pool.slots
            s.keep(block)

    def table(self, width: int | None = None) -> np.ndarray:
        """i32[R, width]: every slot's first `width` pages (default: all a row may hold), global
        ids (a slot without pages names its shard's first page)."""
        return np.concatenate([s.pool.page_table[:, :width] + d * self.pages_per_shard
                               for d, s in enumerate(self.shards)]).astype(np.int32)

    def held_width(self) -> int:
        """The smallest power of two (at most the page-table width) of pages that covers every
        slot's pages: a narrower table for a step that reads every page its table names."""
        most = max(int(s.pool.held.max(initial=0)) for s in self.shards)
        full = self.shards[0].pool.pages_per_slot
        return min(1 << max(most - 1, 0).bit_length(), full)
