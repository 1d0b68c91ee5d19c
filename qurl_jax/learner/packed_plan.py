"""Shapes of the learner's packed programs, for planning them before any data exists.

With `train.packing` the learner's programs run on rows of `pack_length` tokens whose count
depends on the step's lengths (`qurl_jax.learner.packing`). A plan (`qurl_jax.plan.memory_plan`, the
trainer's preflight) has no lengths, so it takes the worst case the packer can produce: every
sequence longer than half a row, one sequence per row. Then

- a micro-batch slice of `s` sequences (`rl.num_micro_batches` micro-batches, or log-prob slices
  of `logprob_batch_size`) packs into `bucket_rows(s, devices)` rows of `pack_length`: as many
  rows as the padded layout's, each up to pack_length / (P + G) longer (pack_length is P + G
  rounded up to the attention block, so at most (P + G + 511) / (P + G)), and the row bucket's
  rounding on top;
- a token-budget micro-batch (`train.tokens_per_micro_batch`) has its fixed rows,
  tokens_per_micro_batch // pack_length on each process (rounded up to its devices), and the
  worst case is in their number: one row per sequence, `bucket_rows(ceil(sequences / rows))`
  micro-batches. The update gives each a slot for every sequence of its process (a micro-batch
  of short sequences can hold them all), micro-batches x sequences slots, quadratic in the
  minibatch's sequences; each slot's response index is 3 int32 (`packing.SLOT_KEYS`; with
  shared prompts one per response token). The log-prob pass without shared prompts reads one
  [sequences, G] index (`packing.TOKEN_KEYS`) instead of slots: linear in the rollout's
  sequences.

In a multi-process run (a TPU target of more than one host) every process packs its own block of
sequences into its own rows, as the learner does.

A micro-batch's memory is its rows' (the scan runs one at a time), so a plan of the worst case is
an upper bound of every step's. At the configs' lengths the packer needs far fewer rows or
micro-batches (`python -m qurl_jax.bench.learner`); the compiled FLOPs of those measured shapes
are `bench.learner --flops`.
"""

from __future__ import annotations

import dataclasses
import math

from qurl_jax.learner import packing


@dataclasses.dataclass(frozen=True)
class PackedShapes:
    """One packed learner program's array shapes (global, one process).

    rows: packed rows of the whole program (every micro-batch or slice), each `length` tokens;
    slices: micro-batches (update) or log-prob slices the rows split into (rows % slices == 0);
    sequences: leading size of the response index `index`: the batch's sequences, or with a
    token budget the sequence slots (slices x slots per slice); `seq_index`: whether the program
    gathers its sequences by slot (token budget); `index`: the response index's key,
    `resp_index` i32[sequences, G], or with a token budget and no shared prompts the update's
    `resp_span` i32[slots, 3] (`packing.SLOT_KEYS`) and the log-prob pass's `resp_flat`
    i32[sequences, G] (`packing.TOKEN_KEYS`: the batch's sequences, no slots)."""

    rows: int
    length: int
    slices: int
    sequences: int
    seq_index: bool
    index: str = "resp_index"

    @property
    def by_token(self) -> bool:
        """The token-budget log-prob pass gathering by sequence (`resp_flat`)."""
        return self.index == "resp_flat"

    @property
    def rows_per_slice(self) -> int:
        return self.rows // self.slices


def pack_length(pack_length_field: int, sequence_length: int) -> int:
    """`train.pack_length`, or its default for sequences of `sequence_length` (P + G) slots;
    ValueError naming the field when it is shorter than a sequence the config allows."""
    length = pack_length_field or packing.default_pack_length(sequence_length)
    if length < sequence_length:
        raise ValueError(f"train.pack_length={length} is shorter than the longest sequence the "
                         f"config allows (data.max_prompt_len + rollout.max_new_tokens = "
                         f"{sequence_length}); raise it or leave it 0")
    return length


def budget_rows(tokens_per_micro_batch: int, length: int, devices: int) -> int:
    """Packed rows of one token-budget micro-batch on a process of `devices` devices
    (`Learner._budget_rows`: the budget is each process's);
    ValueError naming both fields when the budget is less than one row."""
    rows = tokens_per_micro_batch // length
    if rows < 1:
        raise ValueError(f"train.tokens_per_micro_batch={tokens_per_micro_batch} is less than "
                         f"one packed row of train.pack_length={length} tokens; raise it to at "
                         f"least {length}")
    return -(-rows // devices) * devices


def worst_case(sequences: int, slices: int, length: int, devices: int,
               tokens_per_micro_batch: int = 0, processes: int = 1,
               buckets: int = packing.PER_DOUBLING, shared_prompts: bool = False,
               logprob_pass: bool = False) -> PackedShapes:
    """The largest packed program the learner can run on `sequences` sequences cut into `slices`
    micro-batch slices of sequences (or, with `tokens_per_micro_batch`, into token-budget
    micro-batches), its rows split over `devices` (data x fsdp) of `processes` processes, each
    packing its own block of sequences (`Learner.pack_batch`, `Learner.pack_budget_batch`): one
    sequence per row, counts rounded to `buckets` sizes per doubling (`train.pack_buckets`).
    Token-budget programs without `shared_prompts` index responses linearly: the log-prob pass
    (`logprob_pass`) by sequence, the update's slots by span (`PackedShapes.index`)."""
    local = devices // processes  # a process's devices: its rows are a multiple of them
    own = sequences // processes
    if tokens_per_micro_batch:
        rows = budget_rows(tokens_per_micro_batch, length, local)
        num = packing.bucket_rows(math.ceil(own / rows), 1, buckets)
        if logprob_pass and not shared_prompts:
            return PackedShapes(rows=num * rows * processes, length=length, slices=num,
                                sequences=sequences, seq_index=False, index="resp_flat")
        slots = packing.bucket_rows(own, local, buckets)
        return PackedShapes(rows=num * rows * processes, length=length, slices=num,
                            sequences=num * slots * processes, seq_index=True,
                            index="resp_index" if shared_prompts else "resp_span")
    rows = packing.bucket_rows(own // slices, local, buckets)
    return PackedShapes(rows=slices * rows * processes, length=length, slices=slices,
                        sequences=sequences, seq_index=False)
