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
                 finished, when every slot is idle, or after `max_steps_per_call` steps.
      harvest  - the host reads the slots' live flags (one small transfer per decode call) and
                 admits waiting rows into the finished slots. Tokens and log-probs are written by
                 the programs straight into row-indexed output buffers, so harvesting moves nothing.
      shrink   - once no row waits, the queue's end: each call also returns when every shard's
                 live rows fit half its slots, and a gather moves them into a state with that
                 many slots (R, R/2, R/4, ...), so the last long rows do not drag a full batch.
    The decode loop's loop-invariant work on the parameters (`Sampler._decode_params`) is done
    once per `sample` call, not once per decode call.

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
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.transformer import DotGeneral, KVCache
from qurl_jax.sampling._distributions import SamplingMode, sample_tokens
from qurl_jax.sampling._kv_policy import needs_compression
from qurl_jax.sampling._sampler import (
    _ROW_AXES,
    FinishReason,
    Params,
    SampleOutput,
    Sampler,
    _bucket,
    _from_global_host,
    _left_pad,
    _power_of_two_buckets,
)

_OUT_AXES = ("batch", "cache_length")  # row-indexed output buffers [N, G]: rows over the batch axes
# The held prefills (one per batch shard) are an insert's sources for any slot: whole on every
# batch shard, heads over 'tensor' as in the cache. Constrained, so every program takes and gives
# them alike (left to the compiler, the init program made them replicated and the insert
# heads-sharded, so an insert of a shape seen before compiled again).
_HELD_KV_AXES = (None, "kv_heads", "cache_length", "head_dim")
_HELD_POS_AXES = (None, "cache_length")
_HELD_ROW_AXES = (None,)


@flax.struct.dataclass
class RefillState:
    """The decode state of R row slots and the row-indexed outputs of N rows (G = gen bucket).

    cache: KVCache of R rows, S = `kv_policy.physical_slots(p_len, g_len)` slots each (p_len +
                       g_len for the dense policy).
    tok: i32[R]        each slot's last sampled token (the next step's input).
    step: i32[R]       tokens its occupant has generated (the output column of its next token).
    live: bool[R]      the slot holds a row that is still generating.
    row: i32[R]        its occupant's output row; N when never filled.
    stream: i32[R]     its occupant's random stream (its row in a one-process call).
    limit: i32[R]      its occupant's response length limit.
    tokens: i32[N, G]; logp, logp_untruncated: f32[N, G]; mask: bool[N, G] - `SampleOutput`'s
                       per-token fields, written in place as tokens are sampled.
    held: KVCache of H = batch shards rows, `prefill_slots(p_len)` slots; held_logits: f32[H, V]
                       - the prefill (cache and last-position logits) of a prompt with rows still
                       waiting, one per shard, so its later rows are admitted without prefilling
                       it again.
    win_q: tuple of f[R, heads, W, D]; win_valid: bool[R, W] - a compressed policy's observation
                       window per slot (`CompressedCache`); () and bool[R, 0] for the dense one.
    held_win_q, held_win_valid: the same for the held prefills.
    """

    cache: KVCache
    tok: jax.Array
    step: jax.Array
    live: jax.Array
    row: jax.Array
    stream: jax.Array
    limit: jax.Array
    tokens: jax.Array
    logp: jax.Array
    logp_untruncated: jax.Array
    mask: jax.Array
    held: KVCache
    held_logits: jax.Array
    win_q: tuple[jax.Array, ...]
    win_valid: jax.Array
    held_win_q: tuple[jax.Array, ...]
    held_win_valid: jax.Array


@dataclasses.dataclass
class RefillRun:
    """What the last `RefillSampler.sample` call did (for tests and benchmarks).

    decode_calls / inserts / shrinks: programs run; decode_steps: decode loop iterations, summed
    over calls; slot_steps: decode steps times the slots they ran, summed over calls; prefilled:
    prompts prefilled (each prompt once, whatever its rows' slots and times); slot_rows: per slot
    of the full set, the rows it held, in order (rows are only admitted before the first shrink);
    occupancy: generated tokens / slot_steps, the fraction of slot-steps that produced a token
    (first tokens come from the insert).
    """

    decode_calls: int = 0
    inserts: int = 0
    shrinks: int = 0
    decode_steps: int = 0
    slot_steps: int = 0
    prefilled: int = 0
    slot_rows: list[list[int]] = dataclasses.field(default_factory=list)
    occupancy: float = 0.0


class RefillSampler(Sampler):
    """`Sampler` whose `max_concurrent_rows` slots are refilled with waiting rows as rows finish.

    Same constructor and `sample` interface as `Sampler` (they return the same tokens and log-probs
    for the same key), plus:

    Args:
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
      **kwargs: the rest of `Sampler`'s arguments.

    Compiled programs: one decode program per (slots, rows, buckets, sampling mode), the slots R
    and, with `shrink`, each smaller count it reaches (at most log2(R) more, each with a gather
    program); at most one insert per (K, P) pair of buckets, K a power of two <= R and P 0 or a
    power of two <= K, per prompt bucket and sampling mode; and one program per parameter
    structure that does the decode loop's loop-invariant work on the parameters once per call
    (`Sampler._decode_params`: the cast to the compute dtype; on a CPU the untied head copy),
    whose result lives until the call returns.
    """

    def __init__(self, config: ModelConfig, dot_general: DotGeneral = jax.lax.dot_general, *,
                 refill_min: int = 0, max_steps_per_call: int = 0, shrink: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(config, dot_general, **kwargs)
        if refill_min < 0 or max_steps_per_call < 0:
            raise ValueError(f"RefillSampler: refill_min={refill_min} and max_steps_per_call="
                             f"{max_steps_per_call} must be >= 0 (0 = default)")
        shards = self._batch_shards()
        if self.max_concurrent_rows % shards:
            raise ValueError(f"RefillSampler: max_concurrent_rows={self.max_concurrent_rows} must "
                             f"be a multiple of the batch shards ({shards})")
        self.refill_min = int(refill_min)
        self.max_steps_per_call = int(max_steps_per_call)
        self.shrink = bool(shrink)
        self._prepare = jax.jit(self._decode_params)
        self._refill_programs: dict[tuple, Any] = {}
        self.last_run = RefillRun()

    @property
    def num_insert_programs(self) -> int:
        """Insert (prefill + scatter) programs built so far."""
        return sum(1 for k in self._refill_programs if k[0] == "insert")

    @property
    def num_programs(self) -> int:
        return len(self._refill_programs)

    def sample(
        self,
        params: Params,
        prompts: Sequence[Sequence[int]],
        *,
        key: jax.Array,
        n: int = 1,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        greedy: bool = False,
        eos_ids: Sequence[int] = (),
        length_limits: Sequence[int] | None = None,
        process_local: bool = False,
    ) -> SampleOutput:
        """`Sampler.sample`, with refilled slots. `length_limits` (optional, B * n ints in [1,
        max_new_tokens], prompt-major) caps each row's response length on its own (benchmarks and
        tests use it to make long-tailed lengths); `num_steps` is the longest response.

        process_local: as `Sampler.sample`'s: `prompts` (and `length_limits`) are this process's
        block of a global batch; every process passes as many and calls together, and gets its
        own rows back as host numpy arrays, the tokens of a one-process call with the whole
        batch. The processes exchange their prompts once (a small all-gather), then run the same
        host loop: each reads the slots' live flags, replicated, after every decode call.
        """
        eos = self._check_inputs(prompts, n, max_new_tokens, temperature, top_k, top_p, greedy,
                                 eos_ids)
        b = len(prompts)
        limits = np.full((b * n,), max_new_tokens, np.int32)
        if length_limits is not None:
            limits = np.asarray(length_limits, np.int32).reshape(-1)
            if limits.shape != (b * n,) or limits.min() < 1 or limits.max() > max_new_tokens:
                raise ValueError(f"length_limits must be B * n = {b * n} ints in [1, "
                                 f"max_new_tokens={max_new_tokens}]")
        blocks, local_prompts = 1, prompts
        if process_local and self.mesh is not None and jax.process_count() > 1:
            from qurl_jax import distributed

            block, blocks = distributed.row_block(self.mesh)
            prompts, limits = _gather_blocks(prompts, limits, block, blocks)
        out, rows = self._run(params, prompts, limits, blocks, key=key, n=n,
                              max_new_tokens=max_new_tokens, temperature=temperature,
                              top_k=top_k, top_p=top_p, greedy=greedy, eos=eos)
        per_token = ("tokens", "logp", "logp_untruncated", "mask")
        if blocks > 1:
            from qurl_jax import distributed

            host = {name: distributed.local_rows(x)[: b * n] for name, x in out.items()}
            tokens, mask = _left_pad(local_prompts, rows["p_len"], b, self.pad_id)
            return SampleOutput(
                **{name: host[name][:, :max_new_tokens] for name in per_token},
                lengths=host["lengths"], finish_reason=host["finish_reason"],
                prompt_tokens=np.repeat(tokens, n, axis=0), prompt_mask=np.repeat(mask, n, axis=0),
                num_steps=np.int32(distributed.agree_max(int(host["lengths"].max()))))

        def crop(x: jax.Array, columns: int | None = None) -> jax.Array:
            if x.shape[0] != b * n:
                x = x[: b * n]
            if columns is not None and x.shape[1] != columns:
                x = x[:, :columns]
            return x

        prompt_tokens = self._put_batch(rows["tokens"])
        prompt_mask = self._put_batch(rows["mask"])
        if n > 1:
            prompt_tokens = jnp.repeat(prompt_tokens, n, axis=0)
            prompt_mask = jnp.repeat(prompt_mask, n, axis=0)
        lengths = crop(out["lengths"])
        return SampleOutput(
            **{name: crop(out[name], max_new_tokens) for name in per_token},
            lengths=lengths, finish_reason=crop(out["finish_reason"]),
            prompt_tokens=crop(prompt_tokens), prompt_mask=crop(prompt_mask),
            num_steps=jnp.max(lengths),
        )

    def _run(self, params: Params, prompts: Sequence[Sequence[int]], limits: np.ndarray,
             blocks: int, *, key: jax.Array, n: int, max_new_tokens: int, temperature: float,
             top_k: int, top_p: float, greedy: bool, eos: Sequence[int]
             ) -> tuple[dict[str, jax.Array], dict[str, Any]]:
        """The host loop over the whole batch: `prompts` (and `limits`, B * n) are `blocks`
        equal blocks, one per process block of the mesh (1 on one process). Each block is padded
        to whole batch shards; row i of block k's prompt j draws the stream of row (k * B / blocks
        + j) * n + i % n of a one-process call. Returns the finished output buffers (global,
        the padded rows included) and the padded prompts {'tokens', 'mask', 'p_len'}."""
        b, shards = len(prompts), self._batch_shards()
        p_len = _bucket(max(len(p) for p in prompts), self.prompt_buckets)
        g_len = _bucket(max_new_tokens, self.gen_buckets)
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
        padded = [_left_pad(prompts[k * per_block:(k + 1) * per_block], p_len, block_pad,
                            self.pad_id) for k in range(blocks)]
        tokens = np.concatenate([t for t, _ in padded])
        mask = np.concatenate([m for _, m in padded])
        slots = min(self.max_concurrent_rows or rows, rows)
        per_shard = slots // shards
        mode, temp, eos_arr = self._sampling_settings(temperature, top_k, top_p, greedy, eos)
        settings = (key, temp, jnp.float32(top_p), jnp.asarray(eos_arr))
        cache_len = self.kv_policy.physical_slots(p_len, g_len)
        refill_min = self.refill_min or max(1, slots // 8)
        max_steps = jnp.int32(self.max_steps_per_call or g_len)

        # Shard d's queue: the real rows of its block of prompts, prompt-major.
        prompts_per_shard = b_pad // shards
        queues = [collections.deque(r for r in range(d * prompts_per_shard * n,
                                                     (d + 1) * prompts_per_shard * n)
                                    if real[r])
                  for d in range(shards)]
        free = [list(range(d * per_shard, (d + 1) * per_shard)) for d in range(shards)]
        run = RefillRun(slot_rows=[[] for _ in range(slots)])
        state = self._program("init", slots, rows, cache_len, g_len, shards,
                              self.prefill_slots(p_len))()
        held = [-1] * shards  # the prompt whose prefill each shard holds
        decode_params = self._prepare(params)
        # Slots per shard the shrink moves the live rows into once no row waits: each a half.
        sizes = [per_shard]
        while self.shrink and sizes[-1] > 1:
            sizes.append(sizes[-1] // 2)
        live = np.zeros((slots,), np.bool_)
        while True:
            admit = []
            for d in range(shards):
                while free[d] and queues[d]:
                    admit.append((free[d].pop(0), queues[d].popleft()))
            if admit:
                state, run.prefilled = self._insert(
                    params, state, admit, held, queues, tokens, mask, row_limits, streams, n,
                    mode, settings, run.prefilled)
                run.inserts += 1
            for slot, row in admit:
                run.slot_rows[slot].append(row)
                live[slot] = True
            if not live.any():
                break
            waiting = [min(len(q), per_shard) for q in queues]
            refillable = np.repeat(np.asarray(waiting) > 0, per_shard)
            need = min(refill_min, sum(waiting))
            # need = 0 (nothing waiting): no slot is refillable, so the call runs to the end, or
            # until every shard's live rows fit the next smaller slot count.
            at = sizes.index(per_shard) + 1
            smaller = sizes[at] if need == 0 and at < len(sizes) else -1
            decode = self._program("decode", slots, rows, cache_len, g_len, mode, eos_arr.size)
            state, live_dev, steps = decode(decode_params, state, self._put_batch(refillable),
                                            jnp.int32(max(need, 1)), jnp.int32(smaller),
                                            max_steps, *settings)
            live, steps = _replicated_to_host(live_dev), int(_replicated_to_host(steps))
            run.decode_calls += 1
            run.decode_steps += steps
            run.slot_steps += steps * slots
            if need == 0 and self.shrink and live.any():
                most = live.reshape(shards, per_shard).sum(1).max()
                target = min(size for size in sizes if size >= most)
                if target < per_shard:
                    state, live = self._shrink(state, live, shards, target)
                    slots, per_shard = target * shards, target
                    run.shrinks += 1
            for d in range(shards):
                block = range(d * per_shard, (d + 1) * per_shard)
                free[d] = [s for s in block if not live[s]]

        out = self._program("finish", 0, rows, cache_len, g_len, eos_arr.size)(
            state, settings[-1])
        # Tokens the decode loop produced (each row's first token comes from its insert).
        decoded = int(_replicated_to_host(jnp.sum(out["lengths"]))) - b * n
        run.occupancy = decoded / max(run.slot_steps, 1)
        self.last_run = run
        return out, {"tokens": tokens, "mask": mask, "p_len": p_len}

    def rows_per_chunk(self, num_prompts: int, n: int) -> int:
        """Rows of a `sample` call of `num_prompts` prompts with `n` samples each, batch padding
        included: all of them pass through the slots in one call (the row-indexed outputs hold
        every row), so they are the rows `lower_programs` needs."""
        shards = self._batch_shards()
        return -(-num_prompts // shards) * shards * n

    def lower_programs(
        self,
        abstract_params: Params,
        rows: int,
        p_len: int,
        g_len: int,
        *,
        n: int = 1,
        mode: SamplingMode | None = None,
        lowering_platforms: tuple[str, ...] | None = None,
    ) -> dict[str, jax.stages.Lowered]:
        """The largest programs a `sample` call of `rows` rows (`rows_per_chunk`) runs, lowered
        but neither compiled nor run, for memory and cost analysis (`Sampler.lower_programs`):

          'prefill': the insert that fills every slot at once: K = R rows admitted, with as many
            new prompts prefilled as K rows of prompt-major per-shard queues can need (P, at
            most K), into a state of R slots holding the [rows, g_len] outputs;
          'decode': the decode loop over the R slots of that state.

        R = min(`max_concurrent_rows` or rows, rows). The state's shardings and the prepared
        decode parameters' are read off the compiled init and preparation programs, so the
        lowered programs take exactly what `sample` hands them.
        """
        shards = self._batch_shards()
        if rows < 1 or rows % (n * shards):
            raise ValueError(f"RefillSampler.lower_programs: rows={rows} must be a positive "
                             f"multiple of n * batch shards = {n} * {shards}")
        mode = mode or SamplingMode()
        slots = min(self.max_concurrent_rows or rows, rows)
        cache_len = self.kv_policy.physical_slots(p_len, g_len)
        eos = 8  # `_sampling_settings` pads the EOS ids to a multiple of 8
        init = self._program("init", slots, rows, cache_len, g_len, shards,
                             self.prefill_slots(p_len))
        state = _abstract_outputs(init)
        decode_params = _abstract_outputs(self._prepare, abstract_params)
        k = _bucket(slots, _power_of_two_buckets(1, slots))
        # A shard's admitted rows are consecutive in its prompt-major queue, and the prompt at
        # its head is held when it was partly admitted before: m rows need ceil(m / n) new
        # prompts at most (exactly that many in the first insert).
        p = _new_prompts_bucket(min(k, rows // n, shards * -(-(slots // shards) // n)), k,
                                shards)
        i32 = jnp.int32
        repl = None if self.mesh is None else NamedSharding(self.mesh, PartitionSpec())

        def host(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(shape, dtype, sharding=repl)  # `_put_replicated`

        scalar = functools.partial(jax.ShapeDtypeStruct, ())
        settings = (jax.eval_shape(lambda: jax.random.key(0)), scalar(jnp.float32),
                    scalar(jnp.float32), jax.ShapeDtypeStruct((eos,), i32))
        insert = self._program("insert", slots, rows, cache_len, g_len, mode, eos, k, p, p_len)
        insert_args = (abstract_params, state, self._abstract_batch((p, p_len), i32),
                       self._abstract_batch((p, p_len), jnp.bool_),
                       *(host((k,), i32) for _ in range(5)), host((shards,), i32), *settings)
        decode = self._program("decode", slots, rows, cache_len, g_len, mode, eos)
        decode_args = (decode_params, state, self._abstract_batch((slots,), jnp.bool_),
                       scalar(i32), scalar(i32), scalar(i32), *settings)
        return {
            "prefill": insert.trace(*insert_args).lower(lowering_platforms=lowering_platforms),
            "decode": decode.trace(*decode_args).lower(lowering_platforms=lowering_platforms),
        }

    # ----------------------------------------------------------------------------------------------
    # Host side of an insert.

    def _insert(self, params: Params, state: RefillState, admit: list[tuple[int, int]],
                held: list[int], queues: list[collections.deque], tokens: np.ndarray,
                mask: np.ndarray, limits: np.ndarray, streams: np.ndarray, n: int,
                mode: SamplingMode, settings: tuple, prefilled: int) -> tuple[RefillState, int]:
        """Admits rows into slots (`admit`: (slot, row) pairs, at most R) and updates `held` (each
        shard's held prompt) in place. Prompts neither held nor seen in this insert are
        prefilled, padded to buckets of rows K and new prompts P. Returns the state and the
        count of prompts prefilled so far."""
        slots, rows = state.live.shape[0], state.tokens.shape[0]
        shards = len(held)
        k = _bucket(len(admit), _power_of_two_buckets(1, slots))
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
        new_tokens = np.full((p, tokens.shape[1]), self.pad_id, np.int32)
        new_mask = np.zeros((p, tokens.shape[1]), np.bool_)
        new_tokens[: len(new_ids)] = tokens[new_ids]
        new_mask[: len(new_ids)] = mask[new_ids]
        insert = self._program("insert", slots, rows, state.cache.length, state.tokens.shape[1],
                               mode, settings[-1].size, k, p, tokens.shape[1])
        put = self._put_replicated
        # The new prompts over the batch shards: each device prefills its share, not all.
        state = insert(params, state, self._put_batch(new_tokens), self._put_batch(new_mask),
                       put(src), put(slot_arr), put(row_arr), put(stream), put(lim),
                       put(hold_src), *settings)
        return state, prefilled + len(new_ids)

    def _shrink(self, state: RefillState, live: np.ndarray, shards: int, per_shard: int
                ) -> tuple[RefillState, np.ndarray]:
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
        gather = self._program("shrink", live.size, state.tokens.shape[0], state.cache.length,
                               state.tokens.shape[1], index.size)
        return gather(state, self._put_replicated(index)), live[index]

    def _put_replicated(self, x: np.ndarray) -> jax.Array:
        """A host array every process holds whole, replicated over the mesh."""
        if self.mesh is None:
            return jnp.asarray(x)
        return _from_global_host(x, NamedSharding(self.mesh, PartitionSpec()))

    # ----------------------------------------------------------------------------------------------
    # The programs.

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
                             donate_argnums=(1,))
            elif kind == "insert":
                fn = jax.jit(functools.partial(self._insert_rows, mode=static[0]),
                             donate_argnums=(1,))
            elif kind == "shrink":
                fn = jax.jit(self._gather_slots)
            else:
                fn = jax.jit(self._finish)
            self._refill_programs[key] = fn
        return self._refill_programs[key]

    def _constrain_state(self, state: RefillState) -> RefillState:
        if self.mesh is None:
            return state
        c = self._constrain
        return RefillState(
            cache=self._constrain_cache(state.cache), tok=c(state.tok, _ROW_AXES),
            step=c(state.step, _ROW_AXES), live=c(state.live, _ROW_AXES),
            row=c(state.row, _ROW_AXES), stream=c(state.stream, _ROW_AXES),
            limit=c(state.limit, _ROW_AXES),
            tokens=c(state.tokens, _OUT_AXES), logp=c(state.logp, _OUT_AXES),
            logp_untruncated=c(state.logp_untruncated, _OUT_AXES), mask=c(state.mask, _OUT_AXES),
            held=KVCache(k=tuple(c(x, _HELD_KV_AXES) for x in state.held.k),
                         v=tuple(c(x, _HELD_KV_AXES) for x in state.held.v),
                         pos=c(state.held.pos, _HELD_POS_AXES),
                         n_used=c(state.held.n_used, _HELD_ROW_AXES),
                         next_pos=c(state.held.next_pos, _HELD_ROW_AXES)),
            held_logits=c(state.held_logits, (None, "vocab")),
            win_q=tuple(map(self._constrain_rows, state.win_q)),
            win_valid=self._constrain_rows(state.win_valid),
            held_win_q=tuple(c(x, (None, "heads", None, "head_dim")) for x in state.held_win_q),
            held_win_valid=c(state.held_win_valid, (None, None)),
        )

    def _init_state(self, *, slots: int, rows: int, cache_len: int, g_len: int, held: int,
                    held_len: int) -> RefillState:
        """Every slot idle (row N: out of range), outputs empty, nothing held."""
        i32 = jnp.int32
        cfg, kv = self.config, self.kv_policy
        w = kv.window if kv.compresses else 0
        layers = len(self._scored_layers()) if kv.compresses else 0

        def window(r: int) -> tuple[tuple[jax.Array, ...], jax.Array]:
            q = jnp.zeros((r, cfg.num_heads, w, cfg.head_dim), cfg.compute_dtype)
            return (q,) * layers, jnp.zeros((r, w), jnp.bool_)

        (win_q, win_valid), (held_win_q, held_win_valid) = window(slots), window(held)

        return self._constrain_state(RefillState(
            cache=KVCache.zeros(self.config, slots, cache_len),
            tok=jnp.full((slots,), self.pad_id, i32), step=jnp.zeros((slots,), i32),
            live=jnp.zeros((slots,), jnp.bool_), row=jnp.full((slots,), rows, i32),
            stream=jnp.zeros((slots,), i32), limit=jnp.ones((slots,), i32),
            tokens=jnp.full((rows, g_len), self.pad_id, i32),
            logp=jnp.zeros((rows, g_len), jnp.float32),
            logp_untruncated=jnp.zeros((rows, g_len), jnp.float32),
            mask=jnp.zeros((rows, g_len), jnp.bool_),
            held=KVCache.zeros(self.config, held, held_len),
            held_logits=jnp.zeros((held, self.config.vocab_size), jnp.float32),
            win_q=win_q, win_valid=win_valid, held_win_q=held_win_q, held_win_valid=held_win_valid,
        ))

    def _gather_slots(self, state: RefillState, index: jax.Array) -> RefillState:
        """The state of slots `index` (i32[R']) in that order; outputs and held prefills as
        they are."""
        take = lambda x: jnp.take(x, index, axis=0)  # noqa: E731
        return self._constrain_state(state.replace(
            cache=jax.tree.map(take, state.cache), tok=take(state.tok), step=take(state.step),
            live=take(state.live), row=take(state.row), stream=take(state.stream),
            limit=take(state.limit),
            win_q=tuple(map(take, state.win_q)), win_valid=take(state.win_valid)))

    @staticmethod
    def _record(state: RefillState, rows: jax.Array, cols: jax.Array, tok: jax.Array,
                lp: jax.Array, lp_full: jax.Array) -> RefillState:
        """Writes one token per entry at (rows, cols); entries with row N are dropped."""
        def put(buf: jax.Array, x: jax.Array) -> jax.Array:
            return buf.at[rows, cols].set(x.astype(buf.dtype), mode="drop")

        return state.replace(tokens=put(state.tokens, tok), logp=put(state.logp, lp),
                             logp_untruncated=put(state.logp_untruncated, lp_full),
                             mask=put(state.mask, jnp.ones_like(tok, jnp.bool_)))

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
        key: jax.Array,
        temperature: jax.Array,
        top_p: jax.Array,
        eos_ids: jax.Array,
        *,
        mode: SamplingMode,
    ) -> RefillState:
        """Prefills P new prompts (prompt_tokens i32[P, p_len], prompt_mask bool[P, p_len]; P may
        be 0) and admits K rows: row rows[i] (random stream streams[i], limit limits[i]) goes to
        slot slots[i] with its first token sampled, its prompt's prefill taken from source src[i]
        of the H held prefills followed by the P new ones. Every field of an admitted slot is
        overwritten (its positions: the prompt's, then -1; its counters; the token state) except
        the keys and values after its prompt's slots, which keep what they held: those slots are
        empty by position. The held prefills become sources hold_src i32[H]."""
        p, p_len = prompt_tokens.shape
        cache_len = state.cache.length
        held, held_logits = state.held, state.held_logits
        held_win = (state.held_win_q, state.held_win_valid)
        if p:
            logits, new, win_q, win_valid = self._prefill_prompts(
                params, prompt_tokens, prompt_mask,
                self._constrain_cache(KVCache.zeros(self.config, p, p_len)))
            # Pinned to the batch shards: the concatenation with the (batch-replicated) held
            # prefills would otherwise pull the whole prefill onto every device.
            new, logits = self._constrain_cache(new), self._constrain_rows(logits)
            win_q = tuple(map(self._constrain_rows, win_q))
            concat = lambda a, b: jnp.concatenate([a, b.astype(a.dtype)])  # noqa: E731
            held = jax.tree.map(concat, held, new)
            held_logits = concat(held_logits, logits)
            held_win = jax.tree.map(concat, held_win, (win_q, win_valid))
        take = lambda x: jnp.take(x, src, axis=0)  # noqa: E731
        # The admitted rows' prompt caches over the batch shards (left to the compiler, all K
        # rows were built on every device: 164 GiB per device for the 1.5B paper config when
        # they still spanned all S slots).
        prompt = self._constrain_cache(jax.tree.map(take, held))
        n = prompt.length

        def admit(buf: jax.Array, new: jax.Array) -> jax.Array:
            return buf.at[slots].set(new.astype(buf.dtype), mode="drop")

        def admit_prompt(buf: jax.Array, new: jax.Array) -> jax.Array:
            # Keys / values of the prompt's n slots only: the slots after them are empty by
            # their positions, and an empty slot's stale keys and values are never read
            # (KVCache). Writing all S slots made the partitioner gather K rows x S slots.
            return buf.at[slots, :, :n].set(new.astype(buf.dtype), mode="drop")

        new_cache = KVCache(
            k=tuple(map(admit_prompt, state.cache.k, prompt.k)),
            v=tuple(map(admit_prompt, state.cache.v, prompt.v)),
            pos=admit(state.cache.pos, jnp.pad(prompt.pos, ((0, 0), (0, cache_len - n)),
                                               constant_values=-1)),
            n_used=admit(state.cache.n_used, prompt.n_used),
            next_pos=admit(state.cache.next_pos, prompt.next_pos),
        )
        # The first token, from the prefill logits: column 0 of each row's stream.
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, streams)
        step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, 0)
        tok, lp, lp_full = sample_tokens(jnp.take(held_logits, src, axis=0), step_keys,
                                         temperature, top_p, mode)
        state = self._record(state, rows, jnp.zeros_like(rows), tok, lp, lp_full)
        ended = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1) | (limits <= 1)

        def put(buf: jax.Array, x: jax.Array) -> jax.Array:
            return buf.at[slots].set(x.astype(buf.dtype), mode="drop")

        hold = lambda x: jnp.take(x, hold_src, axis=0)  # noqa: E731
        return self._constrain_state(state.replace(
            cache=new_cache, tok=put(state.tok, tok), step=put(state.step, jnp.ones_like(rows)),
            live=put(state.live, ~ended), row=put(state.row, rows),
            stream=put(state.stream, streams), limit=put(state.limit, limits),
            held=jax.tree.map(hold, held), held_logits=hold(held_logits),
            win_q=tuple(map(admit, state.win_q, map(take, held_win[0]))),
            win_valid=admit(state.win_valid, take(held_win[1])),
            held_win_q=tuple(map(hold, held_win[0])), held_win_valid=hold(held_win[1]),
        ))

    def _decode_steps(
        self,
        params: Params,
        state: RefillState,
        refillable: jax.Array,
        need: jax.Array,
        stop_live: jax.Array,
        max_steps: jax.Array,
        key: jax.Array,
        temperature: jax.Array,
        top_p: jax.Array,
        eos_ids: jax.Array,
        *,
        mode: SamplingMode,
    ) -> tuple[RefillState, jax.Array, jax.Array]:
        """Decodes every live slot until `need` slots with refillable[s] have finished, every
        batch shard has at most `stop_live` live slots (-1: never), no slot is live, or
        `max_steps` steps ran. Returns (state, live bool[R], steps run). `params` are
        `_decode_params`' output.

        A slot that is not live still runs through the model (the batch has a static shape), but
        its token is masked as an empty cache slot and its n_used does not move, so its cache
        stays within its S slots and nothing it computes is recorded."""
        model = self._decode_transformer(params)
        num_rows = state.tokens.shape[0]
        shards = self._batch_shards()

        def cond(carry: tuple[jax.Array, RefillState]) -> jax.Array:
            i, s = carry
            finished = jnp.sum(~s.live & refillable, dtype=jnp.int32)
            most_live = jnp.max(jnp.sum(s.live.reshape(shards, -1), axis=1, dtype=jnp.int32))
            return (i < max_steps) & (most_live > jnp.maximum(stop_live, 0)) & (finished < need)

        def forward(s: RefillState) -> tuple[jax.Array, KVCache, RefillState]:
            """The live slots' tokens through the model; a compressed policy then pushes the
            window of the live slots and compresses those due at their own step (the static
            sampler's decode step of the same row: tokens generated so far)."""
            live = s.live
            apply = functools.partial(model.apply, {"params": params}, s.tok[:, None],
                                      s.cache.next_pos[:, None], live[:, None], cache=s.cache)
            compresses = self.kv_policy.compresses
            (logits, cache), inter = (apply(mutable=["intermediates"]) if compresses
                                      else (apply(), None))
            cache = cache.replace(n_used=jnp.where(live, cache.n_used, s.cache.n_used))
            if not compresses:
                return logits, cache, s
            win_q, win_valid = self._observe(inter, s.win_q, s.win_valid, live)
            cache = self._compress_due(cache, win_q, win_valid, needs_compression(
                self.kv_policy, s.step, cache.n_used) & live)
            return logits, cache, s.replace(win_q=win_q, win_valid=win_valid)

        def body(carry: tuple[jax.Array, RefillState]) -> tuple[jax.Array, RefillState]:
            i, s = carry
            live = s.live
            logits, cache, s = forward(s)
            row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, s.stream)
            step_keys = jax.vmap(jax.random.fold_in)(row_keys, s.step)
            tok, lp, lp_full = sample_tokens(logits[:, 0], step_keys, temperature, top_p, mode)
            s = self._record(s, jnp.where(live, s.row, num_rows), s.step, tok, lp, lp_full)
            step = s.step + live.astype(jnp.int32)
            ended = jnp.any(tok[:, None] == eos_ids[None, :], axis=-1) | (step >= s.limit)
            s = s.replace(cache=cache, tok=jnp.where(live, tok, s.tok), step=step,
                          live=live & ~ended)
            return i + 1, self._constrain_state(s)

        steps, state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))
        live = state.live
        if self.mesh is not None:  # every process reads all of them
            live = jax.lax.with_sharding_constraint(live, NamedSharding(self.mesh,
                                                                        PartitionSpec()))
        # The state leaves as it came (its live flags too, which the compiler would otherwise
        # give the replicated copy's sharding: the next insert of a seen shape compiled again).
        return self._constrain_state(state), live, steps

    def _finish(self, state: RefillState, eos_ids: jax.Array) -> dict[str, jax.Array]:
        """Per-row lengths and finish reasons, as the static sampler computes them."""
        lengths = jnp.sum(state.mask, axis=1, dtype=jnp.int32)
        last = jnp.take_along_axis(state.tokens, jnp.maximum(lengths - 1, 0)[:, None],
                                   axis=1)[:, 0]
        ended_on_eos = (lengths > 0) & jnp.any(last[:, None] == eos_ids[None, :], axis=-1)
        finish = jnp.where(ended_on_eos, FinishReason.EOS, FinishReason.LENGTH).astype(jnp.int32)
        return dict(tokens=state.tokens, logp=state.logp, logp_untruncated=state.logp_untruncated,
                    mask=state.mask, lengths=lengths, finish_reason=finish)


def _new_prompts_bucket(count: int, k: int, shards: int) -> int:
    """Prompts an insert of `k` rows prefills for `count` new ones: 0, or a power of two up to k
    rounded up to a multiple of the batch shards (the prompts are split over them)."""
    if not count:
        return 0
    return -(-_bucket(count, _power_of_two_buckets(1, k)) // shards) * shards


def _abstract_outputs(fn: Any, *args: Any) -> Any:
    """The outputs of jitted `fn` on `args` as `jax.ShapeDtypeStruct`s with the shardings its
    compiled program gives them."""
    shardings = fn.lower(*args).compile().output_shardings
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        jax.eval_shape(fn, *args), shardings)


def _replicated_to_host(x: jax.Array) -> np.ndarray:
    """A replicated (or single-device) array as numpy, from this process's first copy."""
    return np.array(x.addressable_data(0))  # a writable copy


def _gather_blocks(prompts: Sequence[Sequence[int]], limits: np.ndarray, block: int,
                   blocks: int) -> tuple[list[list[int]], np.ndarray]:
    """Every process's prompts and length limits (a collective), ordered by the block of rows
    each process owns (`distributed.row_block`; processes sharing a block pass the same
    prompts): the global batch of a one-process call."""
    from jax.experimental import multihost_utils

    from qurl_jax import distributed

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
