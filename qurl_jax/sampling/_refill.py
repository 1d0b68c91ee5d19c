"""Continuous batching for rollouts: a fixed set of row slots, each refilled with a waiting row as
soon as its occupant finishes, so long-tailed response lengths do not idle the decode loop.

The static `Sampler` decodes a chunk of rows until its longest row ends; with reasoning-style
length distributions (median around a quarter of the limit) most of the chunk computes padding for
most of the time. `RefillSampler` keeps R = `max_concurrent_rows` slots busy instead:

    host loop (no host round-trip per token):
      insert   - one jitted program per (rows K, new prompts P) bucket: prefills the P prompts of
                 the K rows admitted now that were not prefilled before, samples each row's first
                 token, and scatters the rows' caches and per-row state into the K freed slots
                 (padding entries target slot R: dropped). Each prompt is prefilled once: a
                 group's rows admitted together share a prefill, and the prefill of the prompt at
                 the head of each shard's queue (a group partly admitted) is held in the state
                 for its later rows.
      decode   - one jitted `lax.while_loop`: every step feeds each live slot's last token through
                 the model and samples its next one; it returns when `need` refillable slots have
                 finished, when every slot is idle, or after `max_steps_per_call` steps (on a GPU
                 checked every chunk of steps, `Engine.decode_while`: slots that finish inside a
                 chunk wait for its end, which changes when rows are refilled, not their tokens).
      harvest  - the host reads the slots' live flags (one small transfer per decode call) and
                 admits waiting rows into the finished slots. Tokens and log-probs are written by
                 the programs straight into row-indexed output buffers, so harvesting moves nothing.
      shrink   - once no row waits, the queue's end: each call also returns when every shard's
                 live rows fit half its slots, and a gather moves them into a state with that
                 many slots (R, R/2, R/4, ...), so the last long rows do not drag a full batch.
    The decode loop's loop-invariant work on the parameters (`Engine.prepare`) is done once per
    `sample` call, not once per decode call. The insert and the decode step are the engine's
    (`_engine.py`), the same the static `Sampler` runs.

Each slot's cache row is a per-row `KVCache` row (`models.transformer.KVCache`), which already
lets rows sit at different points of their sequences: attention reads only recorded logical
positions. A finished slot stops advancing (its n_used is frozen, its writes are masked as empty
slots), and an insert overwrites all of its S cache slots, positions and counters, so nothing of
the previous occupant is visible to the next one.

Compressed-KV policies (Sparse-RL, `kv_policy`): a slot holds `physical_slots` = budget +
interval cache slots and its observation window, both reset by the insert (a prompt longer than
the budget is compressed once at its prefill, as `Sampler` does). Each live slot is compressed on
its own schedule, when its occupant's generated-token count is a multiple of the interval (the
static sampler's decode step for that row) and it holds more than the budget; the scoring and
gathers run under `lax.cond` on the steps where some slot is due.

Results equal the static sampler's: row i (prompt-major, row b * n + j is sample j of prompt b)
draws its token t with `fold_in(fold_in(key, i), t)` whatever slot it lands in, the cache has the
same slots per row as the static sampler's, and the prefill and decode run the same model calls.
GRPO samples of one prompt may live in different slots and finish at different times; the outputs
are indexed by row, so they come back prompt-major.

A paged pool (`kv_pages`, `_cache.PagedKV`, `_page_pool`) replaces the S cache slots per row:
rows take pages as they grow, admission waits for pages, and a row is preempted (requeued and
regenerated with its own random stream, so its tokens do not change) when the pool runs short
before a decode call; see the class docstring and docs/paged_kv.md.

Under a mesh the slots are sharded over ('data', 'fsdp') like the static sampler's rows, and each
batch shard has its own queue: the rows of its block of prompts refill only its own slots. An
insert's new prompts are split over the batch shards (padded to a multiple of them), so each
device prefills its share; their caches, and the held prefills, are then whole on every device,
and each shard's scatter keeps its own slots. (When every device prefilled every new prompt, the
insert that fills all slots of the 1.5B paper config compiled to 59.5 GiB per device.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.transformer import DotGeneral
from qurl_jax.sampling._cache import Cache, CompressedCache, Paging, concat_rows, take_rows
from qurl_jax.sampling._distributions import SamplingMode
from qurl_jax.sampling._engine import DecodeState, Engine
from qurl_jax.sampling._host import (
    Params,
    ProgressFn,
    abstract_outputs,
    assemble,
    assemble_local,
    bucket,
    check_concurrent_rows,
    left_pad,
    power_of_two_buckets,
)
from qurl_jax.sampling._output import SampleOutput
from qurl_jax.sampling._page_pool import ShardedScheduler
from qurl_jax.sampling.settings import Decoding, SamplingParams


@flax.struct.dataclass
class RefillState:
    """The decode state of R row slots and the prefills held for rows still waiting.

    slots: `DecodeState` of R slots, S = `CacheLayout.slots(p_len, g_len)` cache slots each, and
      the row-indexed outputs of the call's N rows.
    held: cache of H = batch shards rows, `prefill_slots(p_len)` slots; held_logits: f32[H, V] -
      the prefill (cache and last-position logits) of a prompt with rows still waiting, one per
      shard, so its later rows are admitted without prefilling it again. They are an insert's
      sources for any slot: whole on every batch shard, heads over 'tensor' as in the cache.
      Constrained, so every program takes and gives them alike (left to the compiler, the init
      program made them replicated and the insert heads-sharded, so an insert of a shape seen
      before compiled again).
    """

    slots: DecodeState
    held: Cache
    held_logits: jax.Array


@dataclasses.dataclass
class RefillRun:
    """What the last `RefillSampler.sample` call did (for tests and benchmarks).

    decode_calls / inserts / shrinks: programs run; decode_steps: decode loop iterations, summed
    over calls; slot_steps: decode steps times the slots they ran, summed over calls; prefilled:
    prompts prefilled (each prompt once, whatever its rows' slots and times); slot_rows: per slot
    of the full set, the rows it held, in order (rows are only admitted before the first shrink);
    occupancy: generated tokens / slot_steps, the fraction of slot-steps that produced a token
    (first tokens come from the insert); preemptions: rows a paged pool preempted (each
    regenerated later); peak_pages: most pages held at once, summed over the batch shards.
    """

    decode_calls: int = 0
    inserts: int = 0
    shrinks: int = 0
    decode_steps: int = 0
    slot_steps: int = 0
    prefilled: int = 0
    slot_rows: list[list[int]] = dataclasses.field(default_factory=list)
    occupancy: float = 0.0
    preemptions: int = 0
    peak_pages: int = 0


class RefillSampler:
    """A sampler whose `max_concurrent_rows` slots are refilled with waiting rows as rows finish.

    Same `sample` interface as `Sampler` (they return the same tokens and log-probs for the same
    key), over the same `Engine`.

    Args:
      config, dot_general: the model and its matmul hook (`Engine`).
      max_concurrent_rows: the number of row slots R (a multiple of the batch shards under a mesh;
        0 = all rows of a call, which leaves nothing to refill). A call with fewer rows uses fewer.
      refill_min: a decode call returns to the host once this many slots that can be refilled
        have finished (default max(1, R // 8)): smaller keeps more slots busy, larger runs fewer
        inserts and host round-trips.
      max_steps_per_call: most decode steps per call (0 = the generation bucket).
      shrink: once no row waits, move the live rows into fewer slots as they finish (R, R // 2,
        R // 4, ... per batch shard), so the end of a call, where the last long rows finish
        alone, runs a smaller batch. It pays where a decode step costs less with fewer rows: on
        a CPU (measured: 98M model, 80 ms per step at 16 rows, 44 at 4) and with long caches.
        With a paged pool a moved row takes its page-table row along (its pages stay).
      kv_pages: 0 = every slot holds prompt + generation bucket tokens of KV (a dense cache);
        > 0 = a paged pool of this many pages (split evenly over the batch shards), from which a
        row takes pages as it grows and to which it returns them when it finishes. Slots
        (`max_concurrent_rows`) then only bound the rows in flight; the pool bounds their tokens.
        A row is admitted when its prompt's pages are free (leaving `kv_watermark_pages` free
        per shard while other rows run); when the pool runs short before a decode call, the most
        recently admitted rows are preempted (pages freed, row requeued at the head, regenerated
        later from its start with its own random stream: its tokens do not change). A decode
        call then runs at most `max_steps_per_call` (default: `kv_page_size`) steps, the room
        reserved ahead for every row. See `_page_pool`.
      kv_page_size: tokens per page.
      kv_watermark_pages: free pages per shard an admission leaves while rows run (default:
        1/16 of the shard's pages).
      **engine_kwargs: buckets, pad_id, mesh, platform, kv_policy, decode_attention (`Engine`).

    Compiled programs: one decode program per (slots, rows, buckets, sampling mode), the slots R
    and, with `shrink`, each smaller count it reaches (at most log2(R) more, each with a gather
    program); at most one insert per (K, P) pair of buckets, K a power of two <= R and P 0 or a
    power of two <= K, per prompt bucket and sampling mode; and one program per parameter
    structure that does the decode loop's loop-invariant work on the parameters once per call
    (`Engine.prepare`: the cast to the compute dtype; on a CPU the untied head copy), whose
    result lives until the call returns.
    """

    def __init__(self, config: ModelConfig, dot_general: DotGeneral = jax.lax.dot_general, *,
                 max_concurrent_rows: int = 0, refill_min: int = 0, max_steps_per_call: int = 0,
                 shrink: bool = True, kv_pages: int = 0, kv_page_size: int = 16,
                 kv_watermark_pages: int | None = None, **engine_kwargs: Any) -> None:
        if kv_pages < 0 or (kv_watermark_pages or 0) < 0:
            raise ValueError(f"RefillSampler: kv_pages={kv_pages} and kv_watermark_pages="
                             f"{kv_watermark_pages} must be >= 0")
        paging = Paging(kv_pages, kv_page_size) if kv_pages else None
        self.engine = Engine(config, dot_general, paging=paging, **engine_kwargs)
        self.kv_watermark_pages = kv_watermark_pages
        self.max_concurrent_rows = check_concurrent_rows(max_concurrent_rows)
        if refill_min < 0 or max_steps_per_call < 0:
            raise ValueError(f"RefillSampler: refill_min={refill_min} and max_steps_per_call="
                             f"{max_steps_per_call} must be >= 0 (0 = default)")
        shards = self.engine.sharding.batch_shards
        if self.max_concurrent_rows % shards:
            raise ValueError(f"RefillSampler: max_concurrent_rows={self.max_concurrent_rows} must "
                             f"be a multiple of the batch shards ({shards})")
        self.refill_min = int(refill_min)
        self.max_steps_per_call = int(max_steps_per_call)
        self.shrink = bool(shrink)
        self._refill_programs: dict[tuple, Any] = {}
        self.last_run = RefillRun()

    @property
    def num_insert_programs(self) -> int:
        """Insert (prefill + scatter) programs built so far."""
        return sum(1 for k in self._refill_programs if k[0] == "insert")

    @property
    def num_programs(self) -> int:
        return len(self._refill_programs)

    def sample(self, params: Params, prompts: Sequence[Sequence[int]], settings: SamplingParams,
               *, key: jax.Array, n: int = 1, length_limits: Sequence[int] | None = None,
               process_local: bool = False, progress: ProgressFn | None = None) -> SampleOutput:
        """`Sampler.sample`, with refilled slots. `length_limits` (optional, B * n ints in [1,
        max_new_tokens], prompt-major) caps each row's response length on its own (benchmarks and
        tests use it to make long-tailed lengths); `num_steps` is the longest response.
        `progress(rows finished, tokens generated)` is called after every decode call (the host
        reads both with the live flags it reads anyway), the last time with all B * n rows.

        process_local: as `Sampler.sample`'s: `prompts` (and `length_limits`) are this process's
        block of a global batch; every process passes as many and calls together, and gets its
        own rows back as host numpy arrays, the tokens of a one-process call with the whole
        batch. The processes exchange their prompts once (a small all-gather), then run the same
        host loop: each reads the slots' live flags, replicated, after every decode call.
        """
        e = self.engine
        settings = e.check(prompts, n, settings)
        b, max_new_tokens = len(prompts), settings.max_new_tokens
        limits = np.full((b * n,), max_new_tokens, np.int32)
        if length_limits is not None:
            limits = np.asarray(length_limits, np.int32).reshape(-1)
            if limits.shape != (b * n,) or limits.min() < 1 or limits.max() > max_new_tokens:
                raise ValueError(f"length_limits must be B * n = {b * n} ints in [1, "
                                 f"max_new_tokens={max_new_tokens}]")
        blocks, local_prompts = 1, prompts
        if process_local and e.mesh is not None and jax.process_count() > 1:
            from qurl_jax.parallel import distributed

            block, blocks = distributed.row_block(e.mesh)
            prompts, limits = _gather_blocks(prompts, limits, block, blocks)
        out, rows = self._run(params, prompts, limits, blocks, settings, key=key, n=n,
                              progress=progress)
        if blocks > 1:
            from qurl_jax.parallel import distributed

            host = {name: distributed.local_rows(x)[: b * n] for name, x in out.items()}
            tokens, mask = left_pad(local_prompts, rows["p_len"], b, e.pad_id)
            return assemble_local(host, tokens, mask, n, max_new_tokens,
                                  distributed.agree_max(int(host["lengths"].max())))
        put = e.sharding.put_batch
        return assemble(out, put(rows["tokens"]), put(rows["mask"]), b * n, n, max_new_tokens,
                        jnp.max(out["lengths"][: b * n]))

    def _run(self, params: Params, prompts: Sequence[Sequence[int]], limits: np.ndarray,
             blocks: int, settings: SamplingParams, *, key: jax.Array, n: int,
             progress: ProgressFn | None = None) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """The host loop over the whole batch: `prompts` (and `limits`, B * n) are `blocks`
        equal blocks, one per process block of the mesh (1 on one process). Each block is padded
        to whole batch shards; row i of block k's prompt j draws the stream of row (k * B / blocks
        + j) * n + i % n of a one-process call. Returns the finished output buffers (global,
        the padded rows included) and the padded prompts {'tokens', 'mask', 'p_len'}."""
        e = self.engine
        b, shards = len(prompts), e.sharding.batch_shards
        p_len, g_len = e.buckets(max(len(p) for p in prompts), settings.max_new_tokens)
        per_block = b // blocks  # real prompts per block
        block_pad = -(-per_block // (shards // blocks)) * (shards // blocks)
        b_pad = block_pad * blocks
        rows = b_pad * n
        # Per padded prompt: its block k and index j in the block; real when j < per_block.
        k_of, j_of = np.divmod(np.arange(b_pad), block_pad)
        real_prompt = j_of < per_block
        source = np.where(real_prompt, k_of * per_block + j_of, 0)  # index into `prompts`
        real = np.repeat(real_prompt, n)
        streams = (np.repeat(source, n) * n + np.tile(np.arange(n), b_pad)).astype(np.int32)
        row_limits = np.where(real, limits[streams], 1).astype(np.int32)
        padded = [left_pad(prompts[k * per_block:(k + 1) * per_block], p_len, block_pad,
                           e.pad_id) for k in range(blocks)]
        tokens = np.concatenate([t for t, _ in padded])
        mask = np.concatenate([m for _, m in padded])
        slots = min(self.max_concurrent_rows or rows, rows)
        per_shard = slots // shards
        mode, decoding = settings.mode(e.config.vocab_size), settings.decoding(key)
        num_eos = decoding.eos_ids.size
        cache_len = e.layout.slots(p_len, g_len)
        refill_min = self.refill_min or max(1, slots // 8)
        paging = e.paging
        # A paged pool reserves room for one call's steps ahead (the page size by default).
        steps_per_call = self.max_steps_per_call or (paging.page_size if paging else g_len)
        max_steps = jnp.int32(steps_per_call)

        # Shard d's queue: the real rows of its block of prompts, prompt-major.
        prompts_per_shard = b_pad // shards
        shard_rows = [[r for r in range(d * prompts_per_shard * n, (d + 1) * prompts_per_shard * n)
                       if real[r]] for d in range(shards)]
        pages = None
        if paging is None:
            queues = [collections.deque(rows_d) for rows_d in shard_rows]
        else:
            pages = self._scheduler(shards, per_shard, cache_len)
            prompt_lens = np.asarray(mask.sum(axis=1))
            for sched, rows_d in zip(pages.shards, shard_rows, strict=True):
                sched.submit(rows_d, prompt_lens[np.asarray(rows_d, np.int64) // n])
            queues = pages.queues
        free = [list(range(d * per_shard, (d + 1) * per_shard)) for d in range(shards)]
        run = RefillRun(slot_rows=[[] for _ in range(slots)])
        state = self._program("init", slots, rows, cache_len, g_len, shards,
                              e.prefill_slots(p_len))()
        held = [-1] * shards  # the prompt whose prefill each shard holds
        prepared = e.preparer(slots)(params)
        put = e.sharding.put_batch
        # Slots per shard the shrink moves the live rows into once no row waits: each a half.
        sizes = [per_shard]
        while self.shrink and sizes[-1] > 1:
            sizes.append(sizes[-1] // 2)
        live = np.zeros((slots,), np.bool_)
        admitted = generated = 0  # rows admitted and tokens made so far (`progress`)
        while True:
            if pages is not None:  # free slots and pages
                admit = pages.admit()
            else:
                admit = [(free[d].pop(0), queues[d].popleft()) for d in range(shards)
                         for _ in range(min(len(free[d]), len(queues[d])))]
            if admit:
                state, run.prefilled = self._insert(
                    params, state, admit, held, queues, tokens, mask, row_limits, streams, n,
                    mode, decoding, run.prefilled, pages)
                run.inserts += 1
            for slot, row in admit:
                run.slot_rows[slot].append(row)
                live[slot] = True
            if not live.any():
                break
            table = keep = None
            if pages is not None:
                for slot, _ in pages.reserve(steps_per_call):
                    live[slot] = False  # requeued: its slot stops now, its row starts again
                run.peak_pages = max(run.peak_pages, pages.pages_held)
                width = pages.held_width() if e.paged_gathers else None
                table, keep = put(pages.table(width)), put(live)
            waiting = [min(len(q), per_shard) for q in queues]
            refillable = np.repeat(np.asarray(waiting) > 0, per_shard)
            if pages is not None:  # a slot left empty for want of pages is not a finished one
                refillable &= live
            need = min(refill_min, sum(waiting))
            # need = 0 (nothing waiting): no slot is refillable, so the call runs to the end, or
            # until every shard's live rows fit the next smaller slot count.
            at = sizes.index(per_shard) + 1
            smaller = sizes[at] if need == 0 and at < len(sizes) else -1
            decode = self._program("decode", slots, rows, cache_len, g_len, mode, num_eos)
            state, live_dev, steps, made = decode(prepared, state, put(refillable),
                                            jnp.int32(max(need, 1)), jnp.int32(smaller),
                                            max_steps, decoding, table, keep)
            live, steps = _replicated_to_host(live_dev), int(_replicated_to_host(steps))
            # Each admitted row's first token comes from its insert, the others from decode calls.
            admitted += len(admit)
            generated += len(admit) + int(_replicated_to_host(made))
            if progress is not None:
                progress(admitted - int(live.sum()), generated)
            if pages is not None:
                pages.advance(live, steps)
            run.decode_calls += 1
            run.decode_steps += steps
            run.slot_steps += steps * slots
            if need == 0 and self.shrink and live.any():
                most = live.reshape(shards, per_shard).sum(1).max()
                target = min(size for size in sizes if size >= most)
                if target < per_shard:
                    state, live = self._shrink(state, live, shards, target, pages)
                    slots, per_shard = target * shards, target
                    run.shrinks += 1
            for d in range(shards):
                block = range(d * per_shard, (d + 1) * per_shard)
                free[d] = [s for s in block if not live[s]]

        if pages is not None:
            run.preemptions = pages.preemptions
        out = self._program("finish", 0, rows, cache_len, g_len, num_eos)(state,
                                                                           decoding.eos_ids)
        # Tokens the decode loop produced (each row's first token comes from its insert).
        decoded = int(_replicated_to_host(jnp.sum(out["lengths"]))) - b * n
        run.occupancy = decoded / max(run.slot_steps, 1)
        self.last_run = run
        return out, {"tokens": tokens, "mask": mask, "p_len": p_len}

    def _scheduler(self, shards: int, per_shard: int, cache_len: int) -> ShardedScheduler:
        """The host's page bookkeeping for a call: a pool of kv_pages / shards pages per shard
        behind its slots, rows of at most `cache_len` tokens."""
        paging = self.engine.paging
        per_pool = paging.num_pages // shards
        need = -(-cache_len // paging.page_size)
        if need > per_pool:
            raise ValueError(f"kv_pages={paging.num_pages}: a row of {cache_len} tokens needs "
                             f"{need} pages of {paging.page_size}, a shard's pool has "
                             f"{per_pool}")
        return ShardedScheduler(shards, per_shard, per_pool, paging.page_size, cache_len,
                                self.kv_watermark_pages)

    def rows_per_chunk(self, num_prompts: int, n: int) -> int:
        """Rows of a `sample` call of `num_prompts` prompts with `n` samples each, batch padding
        included: all of them pass through the slots in one call (the row-indexed outputs hold
        every row), so they are the rows `lower_programs` needs."""
        shards = self.engine.sharding.batch_shards
        return -(-num_prompts // shards) * shards * n

    def lower_programs(self, abstract_params: Params, rows: int, p_len: int, g_len: int, *,
                       n: int = 1, mode: SamplingMode | None = None,
                       lowering_platforms: tuple[str, ...] | None = None
                       ) -> dict[str, jax.stages.Lowered]:
        """The largest programs a `sample` call of `rows` rows (`rows_per_chunk`) runs, lowered
        but neither compiled nor run, for memory and cost analysis (`Sampler.lower_programs`):

          'prefill': the insert that fills every slot at once: K = R rows admitted, with as many
            new prompts prefilled as K rows of prompt-major per-shard queues can need (P, at
            most K), into a state of R slots holding the [rows, g_len] outputs;
          'decode': the decode loop over the R slots of that state;
          'prepare': the decode loop's parameters (`Engine.prepare`, once per call).

        R = min(`max_concurrent_rows` or rows, rows). The state's shardings and the prepared
        decode parameters' are read off the compiled init and preparation programs, so the
        lowered programs take exactly what `sample` hands them.
        """
        e = self.engine
        shards = e.sharding.batch_shards
        if rows < 1 or rows % (n * shards):
            raise ValueError(f"RefillSampler.lower_programs: rows={rows} must be a positive "
                             f"multiple of n * batch shards = {n} * {shards}")
        mode = mode or SamplingMode()
        slots = min(self.max_concurrent_rows or rows, rows)
        cache_len = e.layout.slots(p_len, g_len)
        eos = 8  # `SamplingParams.decoding` pads the EOS ids to a multiple of 8
        init = self._program("init", slots, rows, cache_len, g_len, shards,
                             e.prefill_slots(p_len))
        state = abstract_outputs(init)
        prepared = abstract_outputs(e.preparer(slots), abstract_params)
        k = bucket(slots, power_of_two_buckets(1, slots))
        # A shard's admitted rows are consecutive in its prompt-major queue, and the prompt at
        # its head is held when it was partly admitted before: m rows need ceil(m / n) new
        # prompts at most (exactly that many in the first insert).
        p = _new_prompts_bucket(min(k, rows // n, shards * -(-(slots // shards) // n)), k,
                                shards)
        i32, scalar = jnp.int32, functools.partial(jax.ShapeDtypeStruct, ())
        host, batch = e.sharding.abstract_replicated, e.sharding.abstract_batch
        insert = self._program("insert", slots, rows, cache_len, g_len, mode, eos, k, p, p_len)
        table = keep = None
        if e.paging is not None:  # the host's page table and preemptions
            table = batch((slots, e.layout.pages_per_row(cache_len)), i32)
            keep = batch((slots,), jnp.bool_)
        insert_args = (abstract_params, state, batch((p, p_len), i32), batch((p, p_len), jnp.bool_),
                       *(host((k,), i32) for _ in range(5)), host((shards,), i32),
                       Decoding.abstract(eos), table)
        decode = self._program("decode", slots, rows, cache_len, g_len, mode, eos)
        decode_args = (prepared, state, batch((slots,), jnp.bool_), scalar(i32), scalar(i32),
                       scalar(i32), Decoding.abstract(eos), table, keep)
        return {
            "prefill": insert.trace(*insert_args).lower(lowering_platforms=lowering_platforms),
            "decode": decode.trace(*decode_args).lower(lowering_platforms=lowering_platforms),
            "prepare": e.preparer(slots).trace(abstract_params).lower(
                lowering_platforms=lowering_platforms),
        }

    # ----------------------------------------------------------------------------------------------
    # Host side of an insert and a shrink.

    def _insert(self, params: Params, state: RefillState, admit: list[tuple[int, int]],
                held: list[int], queues: list[collections.deque], tokens: np.ndarray,
                mask: np.ndarray, limits: np.ndarray, streams: np.ndarray, n: int,
                mode: SamplingMode, decoding: Decoding, prefilled: int,
                pages: ShardedScheduler | None = None) -> tuple[RefillState, int]:
        """Admits rows into slots (`admit`: (slot, row) pairs, at most R) and updates `held` (each
        shard's held prompt) in place. Prompts neither held nor seen in this insert are
        prefilled, padded to buckets of rows K and new prompts P. Returns the state and the
        count of prompts prefilled so far."""
        e = self.engine
        slots, rows = state.slots.slots, state.slots.rows
        shards = len(held)
        k = bucket(len(admit), power_of_two_buckets(1, slots))
        new_ids = sorted({row // n for _, row in admit} - set(held))
        p = _new_prompts_bucket(len(new_ids), k, shards)
        # Sources: the H held prefills, then the P new ones.
        index = {pid: shards + i for i, pid in enumerate(new_ids)}
        index.update({pid: d for d, pid in enumerate(held) if pid >= 0})
        # Padding entries: slot R and row N are out of range, so their scatters are dropped.
        slot_arr = np.full((k,), slots, np.int32)
        row_arr = np.full((k,), rows, np.int32)
        src = np.zeros((k,), np.int32)
        lim = np.ones((k,), np.int32)
        stream = np.zeros((k,), np.int32)
        for i, (slot, row) in enumerate(admit):
            slot_arr[i], row_arr[i], src[i], lim[i] = slot, row, index[row // n], limits[row]
            stream[i] = streams[row]
        # Each shard now holds the prefill of its next waiting row's prompt, if it has one.
        hold_src = np.arange(shards, dtype=np.int32)
        for d, queue in enumerate(queues):
            nxt = queue[0] // n if queue else -1
            if nxt in index:
                hold_src[d], held[d] = index[nxt], nxt
            else:
                held[d] = -1
        new_tokens = np.full((p, tokens.shape[1]), e.pad_id, np.int32)
        new_mask = np.zeros((p, tokens.shape[1]), np.bool_)
        new_tokens[: len(new_ids)] = tokens[new_ids]
        new_mask[: len(new_ids)] = mask[new_ids]
        insert = self._program("insert", slots, rows, _cache_length(state),
                               state.slots.tokens.shape[1], mode,
                               decoding.eos_ids.size, k, p, tokens.shape[1])
        put = e.sharding.put_replicated
        # The new prompts over the batch shards: each device prefills its share, not all.
        table = None if pages is None else e.sharding.put_batch(pages.table())
        state = insert(params, state, e.sharding.put_batch(new_tokens),
                       e.sharding.put_batch(new_mask), put(src), put(slot_arr), put(row_arr),
                       put(stream), put(lim), put(hold_src), decoding, table)
        return state, prefilled + len(new_ids)

    def _shrink(self, state: RefillState, live: np.ndarray, shards: int, per_shard: int,
                pages: ShardedScheduler | None = None) -> tuple[RefillState, np.ndarray]:
        """Moves each shard's live slots (at most `per_shard`) to the front of a state of
        `per_shard` slots per shard; returns it and its live flags. Nothing else changes: a
        row's cache, window, step and stream move with it, so its tokens do not."""
        old = live.size // shards
        keep = []
        for d in range(shards):
            block = np.arange(d * old, (d + 1) * old)
            order = np.concatenate([block[live[block]], block[~live[block]]])
            keep.append(order[:per_shard])
        index = np.concatenate(keep).astype(np.int32)
        if pages is not None:
            pages.keep(index)
        gather = self._program("shrink", live.size, state.slots.rows, _cache_length(state),
                               state.slots.tokens.shape[1], index.size)
        return gather(state, self.engine.sharding.put_replicated(index)), live[index]

    # ----------------------------------------------------------------------------------------------
    # The programs: the engine's pieces over a `RefillState`.

    def _program(self, kind: str, slots: int, rows: int, cache_len: int, g_len: int,
                 *static: Any) -> Any:
        """The jitted program of this kind for these shapes and static settings (built once)."""
        key = (kind, slots, rows, cache_len, g_len, *static)
        if key not in self._refill_programs:
            if kind == "init":
                fn = jax.jit(functools.partial(self._init_state, slots=slots, rows=rows,
                                               cache_len=cache_len, g_len=g_len,
                                               held=static[0], held_len=static[1]))
            elif kind == "decode":
                fn = jax.jit(functools.partial(self._decode_steps, mode=static[0]),
                             donate_argnums=(1,),
                             compiler_options=self.engine.compiler_options() or None)
            elif kind == "insert":
                fn = jax.jit(functools.partial(self._insert_rows, mode=static[0]),
                             donate_argnums=(1,))
            elif kind == "shrink":
                fn = jax.jit(self._gather_slots)
            else:
                fn = jax.jit(lambda state, eos_ids: self.engine.finish(state.slots, eos_ids))
            self._refill_programs[key] = fn
        return self._refill_programs[key]

    def _constrain(self, state: RefillState) -> RefillState:
        e = self.engine
        if e.mesh is None:
            return state
        return RefillState(slots=e.constrain(state.slots),
                           held=e.layout.constrain(state.held, batch=None),
                           held_logits=e.sharding.constrain(state.held_logits, (None, "vocab")))

    def _init_state(self, *, slots: int, rows: int, cache_len: int, g_len: int, held: int,
                    held_len: int) -> RefillState:
        """Every slot idle (row N: out of range), outputs empty, nothing held."""
        e = self.engine
        return self._constrain(RefillState(
            slots=e.empty_state(slots, rows, e.layout.empty(slots, cache_len), g_len),
            held=e.layout.empty_prompts(held, held_len),
            held_logits=jnp.zeros((held, e.config.vocab_size), jnp.float32)))

    def _gather_slots(self, state: RefillState, index: jax.Array) -> RefillState:
        """The state of slots `index` (i32[R']) in that order; outputs and held prefills as
        they are."""
        return self._constrain(state.replace(slots=self.engine.take(state.slots, index)))

    def _insert_rows(
        self,
        params: Params,
        state: RefillState,
        prompt_tokens: jax.Array,
        prompt_mask: jax.Array,
        src: jax.Array,
        slots: jax.Array,
        rows: jax.Array,
        streams: jax.Array,
        limits: jax.Array,
        hold_src: jax.Array,
        decoding: Decoding,
        table: jax.Array | None,
        *,
        mode: SamplingMode,
    ) -> RefillState:
        """Prefills P new prompts (prompt_tokens i32[P, p_len], prompt_mask bool[P, p_len]; P may
        be 0) and admits K rows: row rows[i] (random stream streams[i], limit limits[i]) goes to
        slot slots[i] with its first token sampled, its prompt's prefill taken from source src[i]
        of the H held prefills followed by the P new ones. Every field of an admitted slot is
        overwritten (its positions: the prompt's, then -1; its counters; the token state) except
        the keys and values after its prompt's slots, which keep what they held: those slots are
        empty by position. The held prefills become sources hold_src i32[H]. A paged cache
        takes the host's page table i32[R, n] (`table`, None otherwise) before the rows go in."""
        e = self.engine
        held, held_logits = state.held, state.held_logits
        if prompt_tokens.shape[0]:
            # Pinned to the batch shards (`Engine.prefill`): the concatenation with the
            # (batch-replicated) held prefills would otherwise pull the whole prefill onto every
            # device.
            logits, new = e.prefill(params, prompt_tokens, prompt_mask)
            held = concat_rows(held, new)
            held_logits = jnp.concatenate([held_logits, logits])
        # The admitted rows' prompt caches over the batch shards (left to the compiler, all K
        # rows were built on every device: 164 GiB per device for the 1.5B paper config when
        # they still spanned all S slots).
        prompt = e.layout.constrain(take_rows(held, src))
        cache = e.layout.with_table(state.slots.cache, table)
        s = state.slots.replace(cache=e.layout.admit(cache, slots, prompt))
        s = e.admit(s, slots, rows, streams, limits, jnp.take(held_logits, src, axis=0),
                    decoding, mode)
        return self._constrain(RefillState(slots=s, held=take_rows(held, hold_src),
                                           held_logits=jnp.take(held_logits, hold_src, axis=0)))

    def _decode_steps(self, prepared: Params, state: RefillState, refillable: jax.Array,
                      need: jax.Array, stop_live: jax.Array, max_steps: jax.Array,
                      decoding: Decoding, table: jax.Array | None, keep: jax.Array | None, *,
                      mode: SamplingMode
                      ) -> tuple[RefillState, jax.Array, jax.Array, jax.Array]:
        """Decodes every live slot (`Engine.step`) until `need` slots with refillable[s] have
        finished, every batch shard has at most `stop_live` live slots (-1: never), no slot is
        live, or `max_steps` steps ran. Returns (state, live bool[R], steps run, tokens made:
        i32, summed over the slots), every process reading the last three. `prepared`
        are `Engine.prepare`'s output. A compressed cache records every step's queries and
        compresses each slot due at its own step. A paged cache takes the host's page table
        (`table`, possibly only as wide as the pages held) for the loop and stops the slots whose
        rows the host preempted (keep bool[R] False)."""
        e = self.engine
        model = e.decode_model(prepared)
        shards = e.sharding.batch_shards
        compresses = e.layout.compresses

        def cond(carry: tuple[jax.Array, DecodeState]) -> jax.Array:
            i, s = carry
            finished = jnp.sum(~s.live & refillable, dtype=jnp.int32)
            most_live = jnp.max(jnp.sum(s.live.reshape(shards, -1), axis=1, dtype=jnp.int32))
            return (i < max_steps) & (most_live > jnp.maximum(stop_live, 0)) & (finished < need)

        def body(carry: tuple[jax.Array, DecodeState]) -> tuple[jax.Array, DecodeState]:
            i, s = carry
            s = e.step(model, prepared, s, decoding, mode, observe=compresses,
                       compress=compresses)
            return i + 1, e.constrain(s)

        start = state.slots
        if table is not None:
            start = start.replace(cache=e.layout.with_table(start.cache, table),
                                  live=start.live & keep)
        steps, slots = e.decode_while(cond, body, (jnp.int32(0), start), limit=max_steps)
        if table is not None:  # the state leaves with the table it came with (its shape: a
            # narrower `table` must not make the next insert compile again)
            slots = slots.replace(cache=e.layout.with_table(slots.cache,
                                                            state.slots.cache.page_table))
        # Every process reads all the live flags. The state leaves as it came (its live flags
        # too, which the compiler would otherwise give the replicated copy's sharding: the next
        # insert of a seen shape compiled again).
        live = e.sharding.replicated(slots.live)
        made = jnp.sum(slots.step - state.slots.step, dtype=jnp.int32)
        return self._constrain(state.replace(slots=slots)), live, steps, made


def _cache_length(state: RefillState) -> int:
    """S, the slots' cache slots per row (logical slots, for a paged cache)."""
    cache = state.slots.cache
    return (cache.cache if isinstance(cache, CompressedCache) else cache).length


def _new_prompts_bucket(count: int, k: int, shards: int) -> int:
    """Prompts an insert of `k` rows prefills for `count` new ones: 0, or a power of two up to k
    rounded up to a multiple of the batch shards (the prompts are split over them)."""
    if not count:
        return 0
    return -(-bucket(count, power_of_two_buckets(1, k)) // shards) * shards


def _replicated_to_host(x: jax.Array) -> np.ndarray:
    """A replicated (or single-device) array as numpy, from this process's first copy."""
    return np.array(x.addressable_data(0))  # a writable copy


def _gather_blocks(prompts: Sequence[Sequence[int]], limits: np.ndarray, block: int,
                   blocks: int) -> tuple[list[list[int]], np.ndarray]:
    """Every process's prompts and length limits (a collective), ordered by the block of rows
    each process owns (`distributed.row_block`; processes sharing a block pass the same
    prompts): the global batch of a one-process call."""
    from jax.experimental import multihost_utils

    from qurl_jax.parallel import distributed

    b = len(prompts)
    if distributed.agree_max(b) != b or distributed.agree_max(-b) != -b:
        raise ValueError(f"RefillSampler.sample(process_local=True): every process must pass as "
                         f"many prompts (this one passed {b})")
    longest = distributed.agree_max(max(len(p) for p in prompts))
    tokens = np.zeros((b, longest), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    mine = {"tokens": tokens, "lengths": np.array([len(p) for p in prompts], np.int32),
            "limits": limits.astype(np.int32), "block": np.array(block, np.int32)}
    every = jax.tree.map(np.asarray, multihost_utils.process_allgather(mine))  # [processes, ...]
    first = {int(k): i for i, k in reversed(list(enumerate(every["block"])))}
    if sorted(first) != list(range(blocks)):
        raise ValueError(f"RefillSampler.sample: process blocks {sorted(first)} do not cover "
                         f"0..{blocks - 1}")
    order = [first[k] for k in range(blocks)]
    out = [list(every["tokens"][i, j, :every["lengths"][i, j]]) for i in order for j in range(b)]
    return [[int(t) for t in p] for p in out], np.concatenate([every["limits"][i] for i in order])
