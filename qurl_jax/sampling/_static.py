"""The static sampler: chunks of rows, each prefilled once and decoded until its longest row ends.

`Sampler.sample` left-pads a batch of token-id prompts to a prompt-length bucket and streams the
B * n rollout rows through at most `max_concurrent_rows` rows at a time, in chunks of whole prompts
(GRPO groups share a prefill). Per chunk it runs two jitted programs over the engine
(`_engine.py`):

    prefill  the chunk's distinct prompts once (logits of the last position only), each prompt's
             cache rows copied n times into a cache of the decode length;
    decode   the rows admitted into that cache (first token from the prefill logits), then a
             `lax.while_loop` of `Engine.step` until every row has emitted an EOS id or
             `max_new_tokens` tokens (on a GPU in chunks of steps, `Engine.decode_while`). The
             cache is donated, so it is updated in place.

The decode loop's parameters are prepared once per `sample` call (`Engine.prepare`, a program of
its own) and shared by every chunk's decode program.

Only one chunk's KV cache is allocated at a time; the chunks' outputs are concatenated on device.
Prompt and generation lengths are rounded up to buckets and the two programs are cached per
bucket, so a training run compiles a handful of programs rather than one per batch, and every
chunk of a call runs the same two programs.

A compressed cache (`kv_policy`) decodes in blocks that end at the next multiple of the
interval: first the steps whose queries cannot reach the observation window by then (the same
program as a dense step), then the last `window` steps, which record their queries, then one
`lax.cond` that compresses the rows due. So on a compression step the token's own query still
sees the uncompressed cache and the next one sees the compressed set (Sparse-RL compresses before
that step's attention; the kept set is the same).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.models.config import ModelConfig
from qurl_jax.models.transformer import DotGeneral
from qurl_jax.sampling._cache import Cache
from qurl_jax.sampling._distributions import SamplingMode
from qurl_jax.sampling._engine import DecodeState, Engine
from qurl_jax.sampling._host import (
    Params,
    ProgressFn,
    abstract_outputs,
    assemble,
    assemble_local,
    check_concurrent_rows,
    left_pad,
)
from qurl_jax.sampling._output import SampleOutput
from qurl_jax.sampling.settings import Decoding, SamplingParams


class Sampler:
    """Chunked batched sampler for one model configuration and one `dot_general` hook.

    Args:
      config, dot_general: the model and its matmul hook (`Engine`).
      max_concurrent_rows: most rollout rows decoded at once, which bounds the KV cache; 0 decodes
        all B * n rows at once. A chunk holds whole prompts (their n samples share one prefill)
        and the same number of prompts on every batch shard: max_concurrent_rows // (n * shards)
        * shards prompts, or all of them if fewer (`sample` raises ValueError when that is none).
      **engine_kwargs: buckets, pad_id, mesh, platform, kv_policy (`Engine`).
    """

    def __init__(self, config: ModelConfig, dot_general: DotGeneral = jax.lax.dot_general, *,
                 max_concurrent_rows: int = 0, **engine_kwargs: Any) -> None:
        self.engine = Engine(config, dot_general, **engine_kwargs)
        self.max_concurrent_rows = check_concurrent_rows(max_concurrent_rows)
        self._programs: dict[tuple, tuple[Any, Any]] = {}

    @property
    def num_programs(self) -> int:
        """Number of (prefill, decode) program pairs built so far, one per bucket/setting key."""
        return len(self._programs)

    def sample(self, params: Params, prompts: Sequence[Sequence[int]], settings: SamplingParams,
               *, key: jax.Array, n: int = 1, process_local: bool = False,
               progress: ProgressFn | None = None) -> SampleOutput:
        """Samples `n` responses for each prompt.

        Args:
          params: model parameters (full precision or quantized for this sampler's hook).
          prompts: B lists of token ids (different lengths allowed; none empty).
          settings: what to draw (`SamplingParams`).
          key: PRNG key; the same key and inputs give the same tokens, whatever
            `max_concurrent_rows` is.
          n: samples per prompt (rows b*n .. b*n+n-1 belong to prompt b).
          process_local: `prompts` are this process's block of a global batch spread over the
            processes of a multi-process run (`qurl_jax.parallel.distributed.row_block`; every
            process passes as many prompts and calls `sample` together); the output holds this
            process's rows as host numpy arrays. Rows draw the same tokens as in a one-process call
            with the whole batch (the prompt bucket is agreed over the processes and row i of the
            global batch keeps its key). Without a mesh spanning several processes it is a plain
            call.
          progress: called as `progress(rows finished, tokens generated)` after each chunk has
            finished (this process's rows), the last time with all of them.
        """
        e = self.engine
        block, blocks = 0, 1
        if process_local and e.mesh is not None and jax.process_count() > 1:
            from qurl_jax.parallel import distributed

            block, blocks = distributed.row_block(e.mesh)
        settings = e.check(prompts, n, settings)
        b = len(prompts)
        longest = max(len(p) for p in prompts)
        if blocks > 1:
            longest = distributed.agree_max(longest)
        p_len, g_len = e.buckets(longest, settings.max_new_tokens)
        group = self._prompts_per_chunk(b * blocks, n)  # global prompts per chunk
        local_group = group // blocks
        num_chunks = -(-(b * blocks) // group)
        tokens, mask = left_pad(prompts, p_len, num_chunks * local_group, e.pad_id)
        # Row ids of the one-process call: real prompt j of this block is global prompt
        # block * b + j; padding prompts get ids past the real rows, distinct per block.
        pad_per_block = num_chunks * local_group - b
        prompt_ids = np.concatenate([block * b + np.arange(b),
                                     blocks * b + block * pad_per_block + np.arange(pad_per_block)])
        row_ids = (prompt_ids[:, None] * n + np.arange(n)).reshape(-1).astype(np.int32)
        decoding = settings.decoding(key)
        prefill, decode = self._programs_for(group, n, p_len, g_len,
                                             settings.mode(e.config.vocab_size),
                                             decoding.eos_ids.size)
        limit = jnp.int32(settings.max_new_tokens)
        put = e.sharding.put_batch if blocks == 1 else functools.partial(
            e.sharding.put_local, blocks=blocks)
        rows = local_group * n
        prepared = e.preparer(rows)(params)
        chunks = []
        done = [0, 0]  # rows and tokens of the chunks known to have finished (`progress`)

        def finished(chunk: dict[str, jax.Array]) -> None:
            if progress is not None:
                done[0] = min(done[0] + rows, b * n)
                done[1] += int(np.asarray(jnp.sum(chunk["lengths"])))
                progress(*done)

        # Dispatched one chunk ahead: chunk c goes out once chunk c - 2 has finished, so one chunk
        # runs while the next is dispatched. Unbounded run-ahead hung every two-process CPU run
        # with 32 chunks (docs/scaling.md, "Failures"): XLA's CPU client admits 32 programs in
        # flight per device, and a launch held back on one device left the program's other
        # devices, in both processes, waiting in its first all-gather.
        for c in range(num_chunks):
            if c >= 2:
                jax.block_until_ready(chunks[c - 2])
                finished(chunks[c - 2])
            prompt_rows = slice(c * local_group, (c + 1) * local_group)
            logits, cache = prefill(params, put(tokens[prompt_rows]), put(mask[prompt_rows]))
            response, _ = decode(prepared, cache, logits,
                                 put(row_ids[c * rows:(c + 1) * rows]), decoding, limit)
            chunks.append(response)
        for chunk in chunks[max(num_chunks - 2, 0):]:
            finished(chunk)
        if blocks > 1:
            return self._local_output(chunks, tokens[:b], mask[:b], b * n, n, settings)
        out = {name: _concat_rows([r[name] for r in chunks]) for name in SampleOutput.PER_ROW}
        num_steps = chunks[0]["num_steps"]
        if num_chunks > 1:
            num_steps = jnp.max(jnp.stack([r["num_steps"] for r in chunks]))
        return assemble(out, e.sharding.put_batch(tokens), e.sharding.put_batch(mask), b * n, n,
                        settings.max_new_tokens, num_steps)

    @staticmethod
    def _local_output(chunks: list[dict[str, jax.Array]], tokens: np.ndarray, mask: np.ndarray,
                      real: int, n: int, settings: SamplingParams) -> SampleOutput:
        """A process-local call's output: its rows, read back from this process's devices."""
        from qurl_jax.parallel.distributed import local_rows

        host = {name: np.concatenate([local_rows(r[name]) for r in chunks])[:real]
                for name in SampleOutput.PER_ROW}
        num_steps = max(int(np.asarray(r["num_steps"].addressable_data(0))) for r in chunks)
        return assemble_local(host, tokens, mask, n, settings.max_new_tokens, num_steps)

    def lower_programs(self, abstract_params: Params, rows: int, p_len: int, g_len: int, *,
                       n: int = 1, mode: SamplingMode | None = None,
                       lowering_platforms: tuple[str, ...] | None = None
                       ) -> dict[str, jax.stages.Lowered]:
        """The prefill and decode programs of one rollout chunk, lowered but neither compiled nor
        run, for memory and cost analysis (`lowered.compile().memory_analysis()`).

        Args:
          abstract_params: the parameters' pytree as `jax.ShapeDtypeStruct`s (e.g. from
            `jax.eval_shape`), carrying their shardings under a mesh.
          rows: the chunk's decode rows (prompts * n), a multiple of n * batch shards.
          p_len / g_len: prompt and generation buckets (the cache holds p_len + g_len slots).
          n: samples per prompt (the prefill runs rows / n prompts).
          mode: the static sampling settings (default: plain sampling).
          lowering_platforms: passed to `jax.stages.Traced.lower` (default: this process's
            devices); the programs themselves follow this sampler's `platform`.

        Returns {'prefill': ..., 'decode': ..., 'prepare': ...}, the same programs `sample`
        runs for a chunk of these shapes: 'prepare' is the decode loop's parameters
        (`Engine.prepare`, once per call), which the decode program takes (their shardings read
        off the compiled preparation program).
        """
        e = self.engine
        shards = e.sharding.batch_shards
        if rows < 1 or rows % (n * shards):
            raise ValueError(f"Sampler.lower_programs: rows={rows} must be a positive multiple "
                             f"of n * batch shards = {n} * {shards}")
        group = rows // n
        prefill, decode = self._programs_for(group, n, p_len, g_len, mode or SamplingMode(), 8)
        i32, batch = jnp.int32, e.sharding.abstract_batch
        prefill_args = (abstract_params, batch((group, p_len), i32), batch((group, p_len),
                                                                            jnp.bool_))
        decode_args = (abstract_outputs(e.preparer(rows), abstract_params),
                       e.layout.abstract(rows, e.layout.slots(p_len, g_len)),
                       batch((rows, e.config.vocab_size), jnp.float32), batch((rows,), i32),
                       Decoding.abstract(8), jax.ShapeDtypeStruct((), i32))
        return {
            "prefill": prefill.trace(*prefill_args).lower(lowering_platforms=lowering_platforms),
            "decode": decode.trace(*decode_args).lower(lowering_platforms=lowering_platforms),
            "prepare": e.preparer(rows).trace(abstract_params).lower(
                lowering_platforms=lowering_platforms),
        }

    def rows_per_chunk(self, num_prompts: int, n: int) -> int:
        """Rows one rollout chunk of `num_prompts` prompts with `n` samples each decodes at once
        (batch padding included): the rows `lower_programs` needs for the program `sample` runs."""
        return self._prompts_per_chunk(num_prompts, n) * n

    def _prompts_per_chunk(self, num_prompts: int, n: int) -> int:
        """Prompts per chunk: a multiple of the batch shards, as many as `max_concurrent_rows`
        allows (but no more than the padded batch)."""
        shards = self.engine.sharding.batch_shards
        whole = -(-num_prompts // shards) * shards
        if self.max_concurrent_rows == 0:
            return whole
        fit = self.max_concurrent_rows // (n * shards) * shards
        if fit == 0:
            raise ValueError(
                f"Sampler.max_concurrent_rows={self.max_concurrent_rows} holds no whole group: a "
                f"chunk needs at least n * batch shards = {n} * {shards} rows (n={n})")
        return min(fit, whole)

    # ----------------------------------------------------------------------------------------------
    # The two programs.

    def _programs_for(self, group: int, n: int, p_len: int, g_len: int, mode: SamplingMode,
                  num_eos: int) -> tuple[Any, Any]:
        """The jitted (prefill, decode) pair for chunks of `group` prompts x n samples."""
        key = (group, n, p_len, g_len, mode, num_eos)
        if key not in self._programs:
            prefill = jax.jit(functools.partial(
                self._prefill, n=n, cache_len=self.engine.layout.slots(p_len, g_len)))
            decode = jax.jit(functools.partial(self._decode, mode=mode, g_len=g_len),
                             donate_argnums=(1,),
                             compiler_options=self.engine.compiler_options() or None)
            self._programs[key] = (prefill, decode)
        return self._programs[key]

    def _prefill(self, params: Params, tokens: jax.Array, mask: jax.Array, *, n: int,
                 cache_len: int) -> tuple[jax.Array, Cache]:
        """Runs a chunk's P distinct prompts (tokens i32[P, p_len], mask bool[P, p_len]) once and
        returns (last-position logits f32[P*n, V], cache of P*n rows and `cache_len` slots)."""
        logits, cache = self.engine.prefill(params, tokens, mask)
        return jnp.repeat(logits, n, axis=0), self.engine.layout.repeat(cache, n, cache_len)

    def _decode(self, prepared: Params, cache: Cache, logits: jax.Array, row_ids: jax.Array,
                decoding: Decoding, max_new_tokens: jax.Array, *, mode: SamplingMode,
                g_len: int) -> tuple[dict[str, jax.Array], Cache]:
        """Samples up to `max_new_tokens` (<= g_len) tokens per row with an early-exit while loop.

        prepared: `Engine.prepare`'s parameters;
        cache: the prefilled cache of the chunk's N rows (room for g_len - 1 more tokens);
        logits: f32[N, V] next-token logits after the prompt; row_ids: i32[N] each row's index
        in the whole batch (its random stream). A row whose prompt is empty (batch padding:
        next_pos 0) counts as finished from the start.
        Returns the `SampleOutput.PER_ROW` fields (g_len columns) and `num_steps`, and the cache.
        """
        e = self.engine
        num_rows = logits.shape[0]
        model = e.decode_model(prepared)
        kv = cache.cache if e.layout.compresses else cache
        real = kv.next_pos > 0
        index = jnp.where(real, jnp.arange(num_rows), num_rows)
        state = e.empty_state(num_rows, num_rows, cache, g_len)
        # The first token comes from the prefill logits; each loop iteration then feeds the
        # previous token through the model and samples the next one.
        state = e.admit(state, index, index, row_ids, jnp.full((num_rows,), max_new_tokens),
                        logits, decoding, mode)

        def running(carry: tuple[jax.Array, DecodeState], last: jax.Array | None = None
                    ) -> jax.Array:
            """The loop goes on to decode step i + 1 (up to `last`, when given)."""
            i, s = carry
            go = jnp.any(s.live)
            return go if last is None else go & (i + 1 <= last)

        def step(carry: tuple[jax.Array, DecodeState], observe: bool = False
                 ) -> tuple[jax.Array, DecodeState]:
            i, s = carry
            return i + 1, e.constrain(e.step(model, prepared, s, decoding, mode, observe=observe))

        def block(carry: tuple[jax.Array, DecodeState]) -> tuple[jax.Array, DecodeState]:
            """Steps up to the next multiple of the interval, then the rows due compressed (see
            the module's doc): the result of compressing inside every step, without a
            conditional on every step."""
            interval, window = e.kv_policy.interval, e.kv_policy.window
            boundary = (carry[0] + interval) // interval * interval
            carry = jax.lax.while_loop(functools.partial(running, last=boundary - window), step,
                                       carry)
            carry = jax.lax.while_loop(functools.partial(running, last=boundary),
                                       functools.partial(step, observe=True), carry)
            i, s = carry
            return i, s.replace(cache=e.layout.compress(s.cache, e.layout.due(s.cache, i)))

        steps, state = e.decode_while(running, block if e.layout.compresses else step,
                                      (jnp.int32(0), e.constrain(state)))
        if e.decode_chunk > 1:  # a chunk's steps after the last row finished count nothing
            steps = jnp.maximum(jnp.max(state.step), 1) - 1
        return dict(e.finish(state, decoding.eos_ids), num_steps=steps + 1), state.cache


def _concat_rows(chunks: list[jax.Array]) -> jax.Array:
    return chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=0)
