"""Packed learner batches: the step's sequences without their padding, several to a row.

The rollout hands the learner sequences laid out as `[prompt (left-padded to P) | response (G
slots)]`: at the configs' length distribution about a third of those tokens are real. Packing puts
each sequence's real tokens (prompt, then response) one after another into rows of `pack_length`
tokens, first-fit decreasing, every token carrying its segment (its sequence's slot in the row)
and its position within its own sequence. The model runs on the packed rows with segment ids
(`Transformer(..., segment_ids=...)`: attention never crosses a segment, RoPE restarts at 0 per
sequence), the LM head gives every packed position the log-prob of the next token in its row, and
`resp_index` gathers the response tokens' log-probs back to the `[B, G]` layout, so objectives,
advantages, masks and metrics do not change.

Micro-batches stay sets of sequences (the strided `learner.split_rows` slices): `pack` packs each
slice on its own into `num_rows` rows and interleaves them like `split_rows` expects (packed row
j * n + i belongs to slice i), and `resp_index` indexes a slice's own rows. The number of rows is
rounded up to a bucket (`bucket_rows`: by default 8 sizes per doubling, so at most 1/8 of the rows
are empty padding and a run compiles few shapes; `train.pack_buckets` sets the sizes); the padding
rows are empty (no real token, no loss).

Everything here is host-side numpy on this process's own rows: in a multi-process run every
process packs its block and the row counts are agreed on (`qurl_jax.learner.learner.Learner`).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Keys of a packed learner batch beside the per-sequence ones (resp_mask, logp_*, advantages):
#   tokens, positions, segment_ids i32[n * R, L]; attn_mask bool[n * R, L] (real tokens);
#   resp_index i32[B, G]: flat index r * L + c, within its micro-batch slice's R rows, of the
#   position whose next-token log-prob is response token t's (0 for slots with no real token).
PACKED_KEYS = ("tokens", "positions", "segment_ids", "attn_mask", "resp_index")
# With shared prompts (`pack_budget(..., group=n)`) also: prefix_ids i32[n * R, L], the segment
# each token attends to beside its own; resp_target i32[B, G], the token of each response slot.
SHARED_KEYS = ("prefix_ids", "resp_target")
# Token-budget micro-batches (`pack_budget`, no shared prompts) also carry, for the log-prob pass,
#   resp_flat i32[B, G]: per sequence (not per slot), the flat index into the log-probs of every
#   packed row, all micro-batches merged back into row order ([n * R, L] over all processes), of
#   the position whose next-token log-prob is response token t's. Linear in the sequences, where
#   `resp_index` over `seq_index`'s slots is micro-batches x slots (quadratic in the worst case).
TOKEN_KEYS = ("resp_flat",)
# ... and, for the update, in place of `resp_index` over the slots:
#   resp_span i32[slots, 3]: (start, first, end): response slot t of the slot's sequence is at
#   flat index start + t of its micro-batch's rows for first <= t < end, 0 elsewhere (a
#   sequence's response is contiguous in its row), so the index is 3 int32 a slot, not G; the
#   learner widens it per micro-batch (`learner.span_index`).
SLOT_KEYS = ("resp_span",)
# Segment id of padding: never equal to a real sequence's (0, 1, ... within a row).
PAD_SEGMENT = -1


def default_pack_length(sequence_length: int, block: int = 512) -> int:
    """The longest sequence a layout of `sequence_length` (P + G) slots allows, rounded up to the
    attention block (`attention.BLOCK_Q`; a multiple of splash's 128) when longer than one."""
    if sequence_length <= block:
        return sequence_length
    return -(-sequence_length // block) * block


PER_DOUBLING = 8  # `bucket_rows`' default: `train.pack_buckets`


def check_per_doubling(per_doubling: int) -> None:
    """ValueError naming `train.pack_buckets` unless it is a power of two."""
    if per_doubling < 1 or per_doubling & (per_doubling - 1):
        raise ValueError(f"train.pack_buckets={per_doubling} must be a power of two (1, 2, 4, "
                         f"8, ...)")


def bucket_rows(rows: int, multiple: int = 1, per_doubling: int = PER_DOUBLING) -> int:
    """`rows` rounded up to the next of `per_doubling` sizes per doubling above `per_doubling`
    (8: 1, 2, ..., 8, 9, 10, ..., 15, 16, 18, ..., 30, 32, 36, ...; 2: 1, 2, 3, 4, 6, 8, 12, 16,
    24, 32, 48, ...), so at most 1/per_doubling of the rows are padding, then to a multiple of
    `multiple` (the devices the rows are split over). `per_doubling`: a power of two."""
    check_per_doubling(per_doubling)
    rows = max(int(rows), 1)
    if rows > per_doubling:
        # per_doubling steps between 2^(k-1) and 2^k
        step = 2 ** math.ceil(math.log2(rows)) // (2 * per_doubling)
        rows = -(-rows // step) * step
    return -(-rows // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Packed:
    """A packed batch (numpy) and what it cost: `arrays` has the `PACKED_KEYS`."""

    arrays: dict[str, np.ndarray]
    rows_used: int  # the most rows one slice needed (before the bucket)
    real_tokens: int

    @property
    def rows(self) -> int:
        return self.arrays["tokens"].shape[0]

    @property
    def real_share(self) -> float:
        return self.real_tokens / max(self.arrays["tokens"].size, 1)


def sequence_lengths(attn_mask: np.ndarray) -> np.ndarray:
    """i32[B] real tokens per row of the padded layout."""
    return np.asarray(attn_mask, bool).sum(axis=1).astype(np.int32)


def first_fit_decreasing(lengths: np.ndarray, pack_length: int) -> tuple[np.ndarray, np.ndarray]:
    """(row i32[B], offset i32[B]) of each sequence: longest first, each into the first row with
    room. Sequences of length 0 get row -1."""
    order = np.argsort(-lengths, kind="stable")
    row = np.full(lengths.shape, -1, np.int32)
    offset = np.zeros(lengths.shape, np.int32)
    fill: list[int] = []
    for b in order:
        n = int(lengths[b])
        if n == 0:
            continue
        if n > pack_length:
            raise ValueError(f"train.pack_length={pack_length} is shorter than a sequence of {n} "
                             f"tokens (prompt + response); raise it or leave it 0 (the longest "
                             f"sequence the config allows)")
        r = next((i for i, used in enumerate(fill) if used + n <= pack_length), len(fill))
        if r == len(fill):
            fill.append(0)
        row[b], offset[b] = r, fill[r]
        fill[r] += n
    return row, offset


def balance_blocks(index: np.ndarray, lengths: np.ndarray, count: int) -> np.ndarray:
    """`index` (sequences, in order) reordered so that its `count` equal contiguous blocks hold
    nearly equal real tokens: longest first, each to the block with the fewest tokens that still
    has room; within a block the sequences keep their order in `index`. In a multi-process run
    each process packs one block of a minibatch, and every process runs as many micro-batches as
    the fullest block needs, so unequal blocks leave the others' last micro-batches empty. The
    minibatch (the set of sequences) and so every objective's value are unchanged.
    `lengths[i]`: the real tokens of sequence `index[i]`."""
    index = np.asarray(index)
    if count <= 1:
        return index
    if index.shape[0] % count:
        raise ValueError(f"balance_blocks: {index.shape[0]} sequences do not split into {count} "
                         "equal blocks")
    size = index.shape[0] // count
    tokens = np.zeros(count, np.int64)
    members: list[list[int]] = [[] for _ in range(count)]
    for i in np.argsort(-np.asarray(lengths), kind="stable"):
        open_blocks = [b for b in range(count) if len(members[b]) < size]
        b = min(open_blocks, key=lambda j: (tokens[j], j))
        members[b].append(int(i))
        tokens[b] += int(lengths[i])
    return np.concatenate([index[np.sort(m)] for m in members])


def rows_needed(attn_mask: np.ndarray, pack_length: int, num_slices: int = 1) -> int:
    """The most packed rows one of `num_slices` strided slices of these sequences needs."""
    lengths = sequence_lengths(attn_mask)
    return max(int(first_fit_decreasing(lengths[i::num_slices], pack_length)[0].max(initial=-1))
               + 1 for i in range(num_slices))


def pack(tokens: np.ndarray, attn_mask: np.ndarray, response_len: int, pack_length: int, *,
         num_slices: int = 1, num_rows: int | None = None, resp_mask: np.ndarray | None = None,
         row_offset: int = 0) -> Packed:
    """Packs the padded sequences tokens i32[B, P + G] (real where attn_mask) into rows.

    The B sequences are cut into `num_slices` strided slices (`learner.split_rows`: slice i holds
    sequences i, i + n, ...); each slice is packed first-fit decreasing into `num_rows` rows of
    `pack_length` tokens (default: the most any slice needs), and packed row j * n + i is row j of
    slice i. A sequence's real tokens must be contiguous from its first real one (a left-padded
    prompt and its response, as the rollout lays them out). `resp_mask` f32[B, G], if given, is
    checked to mark only real response tokens that have a real token before them. `row_offset`
    shifts every `resp_index` by that many rows (a process's block of a slice's global rows).
    """
    tokens = np.asarray(tokens)
    mask = np.asarray(attn_mask, bool)
    b, t = tokens.shape
    g, n = response_len, num_slices
    if b % n:
        raise ValueError(f"packing: {b} sequences do not split into {n} micro-batches")
    lengths = sequence_lengths(mask)
    first = np.where(lengths > 0, np.argmax(mask, axis=1), 0)
    if not np.array_equal(mask, (np.arange(t)[None] >= first[:, None])
                          & (np.arange(t)[None] < (first + lengths)[:, None])):
        raise ValueError("packing: attn_mask has a gap inside a sequence (expected a left-padded "
                         "prompt followed by its response and right padding)")
    if resp_mask is not None:
        real_resp = mask[:, t - g:] & (np.arange(t - g, t)[None] > first[:, None])
        if np.any((np.asarray(resp_mask) != 0) & ~real_resp):
            raise ValueError("packing: resp_mask marks a response slot that is padding or has no "
                             "real token before it")
    places = [first_fit_decreasing(lengths[i::n], pack_length) for i in range(n)]
    used = max(int(row.max(initial=-1)) + 1 for row, _ in places)
    rows = used if num_rows is None else num_rows
    if used > rows:
        raise ValueError(f"packing: a micro-batch needs {used} rows of {pack_length} tokens, "
                         f"more than the {rows} planned")
    length = pack_length
    out_tokens = np.zeros((n * rows, length), np.int32)
    out_pos = np.zeros((n * rows, length), np.int32)
    out_seg = np.full((n * rows, length), PAD_SEGMENT, np.int32)
    out_mask = np.zeros((n * rows, length), bool)
    resp_index = np.zeros((b, g), np.int32)
    for i, (row, offset) in enumerate(places):
        seg_count = np.zeros(rows, np.int32)
        for k, seq in enumerate(range(i, b, n)):
            m = int(lengths[seq])
            if m == 0:
                continue
            r, o = int(row[k]), int(offset[k])
            dst = r * n + i
            f = int(first[seq])
            out_tokens[dst, o:o + m] = tokens[seq, f:f + m]
            out_pos[dst, o:o + m] = np.arange(m)
            out_seg[dst, o:o + m] = seg_count[r]
            seg_count[r] += 1
            out_mask[dst, o:o + m] = True
            # Response slot s sits at column t - g + s; its token is at packed column
            # o + (t - g + s - f), predicted by the column before.
            s = np.arange(g)
            col = o + (t - g + s - f) - 1
            ok = (t - g + s >= f + 1) & (t - g + s < f + m)
            resp_index[seq] = np.where(ok, (row_offset + r) * length + col, 0)
    return Packed({"tokens": out_tokens, "positions": out_pos, "segment_ids": out_seg,
                   "attn_mask": out_mask, "resp_index": resp_index},
                  rows_used=used, real_tokens=int(lengths.sum()))



# ------------------------------------------------------------------ token-budget micro-batches
def _prompt_lengths(attn_mask: np.ndarray, response_len: int) -> np.ndarray:
    """i32[B] real prompt tokens of each sequence (those before the G response columns)."""
    mask = np.asarray(attn_mask, bool)
    return mask[:, :mask.shape[1] - response_len].sum(axis=1).astype(np.int32)


def _units(attn_mask: np.ndarray, pack_length: int, group: int = 1, response_len: int = 0
           ) -> tuple[list[list[int]], np.ndarray]:
    """What token-budget packing places: (units, i32[U] their packed tokens). With `group` 1 a
    unit is one sequence (its prompt and response). With `group` > 1, sequences k * group ..
    (k + 1) * group - 1 share their prompt (GRPO's samples of one prompt) and a unit is that
    prompt once followed by as many of the group's responses, in order, as fit `pack_length`
    together (a group longer than that is cut into several units, each with the prompt). Empty
    sequences are in no unit."""
    lengths = sequence_lengths(attn_mask)
    if group <= 1:
        units = [[int(b)] for b in np.flatnonzero(lengths > 0)]
        return units, np.array([lengths[u[0]] for u in units], np.int32)
    prompts = _prompt_lengths(attn_mask, response_len)
    units, sizes = [], []
    for start in range(0, lengths.shape[0], group):
        unit, size = [], 0
        for b in range(start, start + group):
            if lengths[b] == 0:
                continue
            need = int(lengths[b] - prompts[b]) + (0 if unit else int(prompts[b]))
            if unit and size + need > pack_length:
                units.append(unit)
                sizes.append(size)
                unit, size, need = [], 0, int(lengths[b])
            if need > pack_length:
                raise ValueError(f"train.pack_length={pack_length} is shorter than a sequence "
                                 f"of {need} tokens (prompt + response); raise it or leave it 0")
            unit.append(b)
            size += need
        if unit:
            units.append(unit)
            sizes.append(size)
    return units, np.array(sizes, np.int32)


def budget_micro_batches(attn_mask: np.ndarray, pack_length: int, rows_per_micro: int, *,
                         group: int = 1, response_len: int = 0) -> int:
    """Micro-batches of `rows_per_micro` packed rows these sequences need (first-fit decreasing
    over all of them; `group`, `response_len`: prompts shared, `_units`), before the bucket."""
    row, _ = first_fit_decreasing(_units(attn_mask, pack_length, group, response_len)[1],
                                  pack_length)
    return max(-(-(int(row.max(initial=-1)) + 1) // rows_per_micro), 1)


def budget_assignment(attn_mask: np.ndarray, pack_length: int, num_micro: int, *,
                      group: int = 1, response_len: int = 0
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(micro i32[B], row_in_micro i32[B], offset i32[B], most sequences in one micro-batch):
    first-fit decreasing row r goes to micro-batch r % num_micro as its row r // num_micro, so
    the fullest rows spread over the micro-batches; `offset` is where its unit starts (`_units`:
    with shared prompts a sequence's unit holds its group's prompt). Empty sequences get micro
    -1."""
    units, sizes = _units(attn_mask, pack_length, group, response_len)
    unit_row, unit_offset = first_fit_decreasing(sizes, pack_length)
    b = np.asarray(attn_mask).shape[0]
    row, offset = np.full(b, -1, np.int32), np.zeros(b, np.int32)
    for unit, r, o in zip(units, unit_row, unit_offset, strict=True):
        row[unit], offset[unit] = r, o
    micro = np.where(row >= 0, row % num_micro, -1).astype(np.int32)
    counts = np.bincount(micro[micro >= 0], minlength=num_micro)
    return micro, (row // num_micro).astype(np.int32), offset, int(counts.max(initial=0))


def pack_budget(tokens: np.ndarray, attn_mask: np.ndarray, response_len: int, pack_length: int,
                *, num_micro: int, rows_per_micro: int, seqs_per_micro: int,
                resp_mask: np.ndarray | None = None, row_offset: int = 0,
                seq_offset: int = 0, group: int = 1) -> Packed:
    """Packs the sequences into `num_micro` token-budget micro-batches of `rows_per_micro` rows
    (`budget_assignment`), laid out for `learner.split_rows(x, num_micro)` (row j of micro-batch
    k at j * num_micro + k). Beside `PACKED_KEYS`, `seq_index` i32[num_micro * seqs_per_micro]
    names the sequence (+ `seq_offset`, a process's first global sequence; -1 for an empty slot)
    at slot s * num_micro + k: the learner gathers the per-sequence arrays with it, so a
    micro-batch's loss sees exactly the sequences its rows hold, and its response index is laid
    out the same way (slot, not sequence): `resp_span` (`SLOT_KEYS`), or with shared prompts
    `resp_index`. `row_offset`: see `pack`. Without shared prompts also `resp_flat` i32[B, G]
    (`TOKEN_KEYS`), what the log-prob pass gathers with.

    group > 1: the sequences of each group of `group` share their prompt (checked), and each
    unit (`_units`) packs it once, then its responses, each response a segment of its own whose
    positions continue the prompt's and which also sees the prompt's segment: `prefix_ids`
    i32[rows, L] names, per token, the one other segment it attends to (its own for a prompt's
    tokens; `models.attention.PackedSegments`). A response's first token is predicted at the
    prompt's last position, shared by the unit's responses, so `resp_target` i32[slots, G] gives
    every response slot's token (the learner reads log-probs at `resp_index` for those targets).
    The learner's tokens shrink by (group - 1) prompts per unit.
    """
    tokens = np.asarray(tokens)
    mask = np.asarray(attn_mask, bool)
    m = num_micro
    base = pack(tokens, mask, response_len, pack_length, resp_mask=resp_mask)  # checks the input
    t, g = tokens.shape[1], response_len
    if group > 1:
        if tokens.shape[0] % group:
            raise ValueError(f"packing: {tokens.shape[0]} sequences are not groups of {group}")
        prompt = np.where(mask[:, :t - g], tokens[:, :t - g], -1).reshape(-1, group, t - g)
        if np.any(prompt != prompt[:, :1]):
            raise ValueError(f"packing: the sequences of a group of {group} (train.share_prompts)"
                             " do not share their prompt")
    units, _ = _units(mask, pack_length, group, response_len)
    micro, row_in, offset, most = budget_assignment(mask, pack_length, m, group=group,
                                                    response_len=response_len)
    if int(row_in.max(initial=-1)) + 1 > rows_per_micro or most > seqs_per_micro:
        raise ValueError(f"packing: the sequences need more than {m} micro-batches of "
                         f"{rows_per_micro} rows and {seqs_per_micro} sequences")
    length = pack_length
    lengths = sequence_lengths(mask)
    first = np.where(lengths > 0, np.argmax(mask, axis=1), 0)
    prompts = _prompt_lengths(mask, g) if group > 1 else np.zeros_like(lengths)
    out = {k: np.zeros((m * rows_per_micro, length), np.int32)
           for k in ("tokens", "positions")}
    out["segment_ids"] = np.full((m * rows_per_micro, length), PAD_SEGMENT, np.int32)
    out["attn_mask"] = np.zeros((m * rows_per_micro, length), bool)
    out["seq_index"] = np.full((m * seqs_per_micro,), -1, np.int32)
    if group == 1:
        out["resp_span"] = np.zeros((m * seqs_per_micro, 3), np.int32)
        out["resp_flat"] = np.zeros((tokens.shape[0], response_len), np.int32)
    else:
        out["resp_index"] = np.zeros((m * seqs_per_micro, response_len), np.int32)
        out["prefix_ids"] = np.full((m * rows_per_micro, length), PAD_SEGMENT, np.int32)
        out["resp_target"] = np.zeros((m * seqs_per_micro, response_len), np.int32)
    seg_count = np.zeros(m * rows_per_micro, np.int32)
    slot_count = np.zeros(m, np.int32)
    s = np.arange(g)
    for unit in units:
        k, j, o = int(micro[unit[0]]), int(row_in[unit[0]]), int(offset[unit[0]])
        dst = j * m + k
        p, f = int(prompts[unit[0]]), int(first[unit[0]])
        prefix = int(seg_count[dst])
        if p:  # the shared prompt, once
            out["tokens"][dst, o:o + p] = tokens[unit[0], f:f + p]
            out["positions"][dst, o:o + p] = np.arange(p)
            out["segment_ids"][dst, o:o + p] = out["prefix_ids"][dst, o:o + p] = prefix
            out["attn_mask"][dst, o:o + p] = True
            seg_count[dst] += 1
        col = o + p  # where the next piece (a whole sequence, or a response) starts
        for seq in unit:
            n, f = int(lengths[seq] - p), int(first[seq] + p)  # the piece: tokens [f, f + n)
            out["tokens"][dst, col:col + n] = tokens[seq, f:f + n]
            out["positions"][dst, col:col + n] = np.arange(p, p + n)
            out["segment_ids"][dst, col:col + n] = seg_count[dst]
            out["attn_mask"][dst, col:col + n] = True
            seg_count[dst] += 1
            slot = int(slot_count[k]) * m + k
            slot_count[k] += 1
            out["seq_index"][slot] = seq + seq_offset
            # Response slot s sits at padded column t - g + s, at packed column
            # col + (t - g + s - f); the position before predicts it (with a shared prompt, the
            # prompt's last one for s = 0). Real for first <= s < end.
            at = col + (t - g + s - f)
            lo, hi = int(first[seq]) + 1 - (t - g), f + n - (t - g)
            ok = (s >= lo) & (s < hi)
            if group > 1:
                out["prefix_ids"][dst, col:col + n] = prefix
                at = np.where(t - g + s == f, o + p, at)
                out["resp_target"][slot] = np.where(ok, tokens[seq, t - g:], 0)
                out["resp_index"][slot] = np.where(ok, (row_offset + j) * length + at - 1, 0)
            else:  # row j of micro-batch k sits at merged row (row_offset + j) m + k
                out["resp_span"][slot] = ((row_offset + j) * length + at[0] - 1, lo, hi)
                out["resp_flat"][seq] = np.where(ok, ((row_offset + j) * m + k) * length
                                                 + at - 1, 0)
            col += n
    return Packed(out, rows_used=int(row_in.max(initial=-1)) + 1,
                  real_tokens=int(out["attn_mask"].sum()) if group > 1 else base.real_tokens)
