"""Benchmark: what a paged KV cache buys, by simulation and by deviceless compiles.

`python -m qurl_jax.bench.paged simulate --config=configs/deepscaler_r1_1p5b_int8.py`
    Rows in flight, paged vs fixed slots, in the same KV memory. Response lengths are drawn as in
    `bench.sampler` (log-normal, median max_new_tokens / 4, sigma 1, clipped to [1, max]); every
    prompt is `--prompt_len` tokens (default: the config's max_prompt_len, the most a prompt takes;
    shorter prompts only favour paging). Today's cache gives each of `max_concurrent_rows` slots
    prompt + max_new_tokens tokens; the paged pool holds the same tokens in `--page_size` pages,
    behind up to `--slot_factor` x as many page-table rows, run by `sampling._page_pool`'s
    scheduler. One decode step = one token for every row in flight. Two cases:
    - `stream`: `--stream_rows` rows, measured while the queue is non-empty (the steady state of
      a long rollout); mean rows in flight and their ratio, beside the expectations
      (P + max) / (P + E[L]) (memory per row at admission's average) and
      (P + max) / (P + E[L^2] / 2E[L]) (the time-average a row in flight holds: long rows stay
      longer);
    - `batch`: one rollout of the config (prompts_per_step x n rows); decode steps to finish
      (makespan) and mean rows in flight over it.
    Admission leaves `--watermark_pages` free (default 1/16 of the pool) so that rows in flight can
    grow a while before one is preempted; preemptions and the tokens they regenerate are counted.

`kv_capacity(budget_bytes=..., peak_bytes=..., cache_bytes=..., token_bytes=..., ...)`
    The same comparison in a device's whole KV memory (what a budget leaves beside a decode
    program's non-KV buffers) rather than in today's slots' memory: pure, numbers in, numbers
    out. `python -m qurl_jax.bench.memory --kv_capacity` feeds it a compiled `rollout_decode`.

`python -m qurl_jax.bench.paged reads --config=... --actor_gib=2.09 [--slots=32,64,128]`
    One rollout of the config (its prompts_per_step x n rows, the same lengths) on one-device
    replicas of its mesh's devices, by rows decoded at once per device: decode steps (the
    slowest replica's: they decode in one program) and HBM bytes read per device (the replica
    every step, and the KV: every slot of every row with XLA's masked attention, or each busy
    row's live tokens with a ragged kernel; `rollout_reads`). Decode is memory-bound, so the
    bytes' ratio predicts the time's. A paged pool with a page-table row for every row never
    preempts and reads like fixed slots of that many rows.

`python -m qurl_jax.bench.paged compile --target=h100|v5p [--rows=64,256]`
    Compiles the decode attention of one layer at the 1.5B decode shape (12 query / 2 kv heads of
    128, bf16, 1024 + 8192 slots, 16-token pages; flags for others) without the device: JAX's
    Pallas kernels and XLA's path, for an H100 (Triton; run in a Python with jax[cuda],
    JAX_PLATFORMS=cpu) or one v5p chip of a compile-only v5p-8 (2x2x1) (Mosaic; a Python with
    jax[tpu]); prints each program's compiled memory (the compiler's figures).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import runpy
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

GIB = 1 << 30
# Most fixed slots `kv_capacity` simulates (its stream case runs 64 rows per slot, one decode step
# at a time).
MAX_SIMULATED_SLOTS = 16384


# -------------------------------------------------------------------------------- simulation
@dataclasses.dataclass(frozen=True)
class SimResult:
    steps: int                 # decode steps until every row finished
    mean_in_flight: float      # over all steps
    mean_in_flight_busy: float  # over the steps that began with rows waiting
    preemptions: int = 0
    regenerated_tokens: int = 0
    peak_pages: int = 0        # most pages held at once (paged only)


def host_devices_for(mesh: Any) -> int:
    """Devices a `cpu` plan of `mesh` (data, fsdp, tensor) runs on: their product, where an
    axis of -1 (the rest of a slice) stands for one 8-device host per unit of the others."""
    sizes = [int(mesh[a]) for a in ("data", "fsdp", "tensor")]
    fixed = int(np.prod([s for s in sizes if s != -1]))
    return fixed * 8 if -1 in sizes else fixed


def _fixed_segments(limits: np.ndarray, slots: int
                    ) -> Iterator[tuple[np.ndarray, np.ndarray, int, bool]]:
    """`slots` fixed slots refilled at once from the rows (response lengths `limits`, in order),
    as segments of decode steps in which nothing changes: (busy bool[slots], tokens each slot's
    row has made before the segment i64[slots], the segment's steps, whether rows were waiting
    when it began). Each segment runs to the next row's finish."""
    left = np.zeros(slots, np.int64)  # tokens each slot still generates; 0 = empty
    made = np.zeros(slots, np.int64)
    queue = list(np.asarray(limits, np.int64)[::-1])
    while queue or left.any():
        for s in np.flatnonzero(left == 0):
            if not queue:
                break
            left[s], made[s] = queue.pop(), 0
        busy = left > 0
        step = int(left[busy].min())
        yield busy, made.copy(), step, bool(queue)
        made[busy] += step
        left = np.maximum(left - step, 0)


def simulate_fixed(limits: np.ndarray, slots: int) -> SimResult:
    """Today's cache: `slots` rows at a time, a finished row's slot refilled at once."""
    in_flight, busy_runs = [], []
    for busy, _, step, waiting in _fixed_segments(limits, slots):
        in_flight.append((int(busy.sum()), step))
        if waiting:
            busy_runs.append(in_flight[-1])
    return SimResult(steps=sum(s for _, s in in_flight), mean_in_flight=_mean(in_flight),
                     mean_in_flight_busy=_mean(busy_runs))


def decode_reads(limits: np.ndarray, slots: int, *, prompt_len: int, cache_len: int,
                 live: bool) -> tuple[int, int]:
    """(decode steps, KV tokens read) of one device's rollout: rows of these response lengths
    through `slots` refilled slots (a paged pool that never preempts behaves the same: slots =
    its page-table rows). Each step reads, with `live` (a ragged attention kernel), each busy
    row's prompt and tokens so far, prompt_len + k + 1 at its k-th token; else every slot of
    every row, cache_len each (XLA's masked attention)."""
    steps = tokens = 0
    for busy, made, step, _ in _fixed_segments(limits, slots):
        n = int(busy.sum())
        if live:  # sum over the segment's steps j of sum_i (P + made_i + j + 1)
            tokens += step * int((prompt_len + made[busy] + 1).sum()) + n * step * (step - 1) // 2
        else:
            tokens += step * slots * cache_len
        steps += step
    return steps, tokens


def rollout_reads(limits: np.ndarray, devices: int, slots: int, *, prompt_len: int,
                  cache_len: int, token_bytes: int, actor_bytes: int, live: bool
                  ) -> tuple[int, int]:
    """(decode steps, HBM bytes read per device) of one rollout of these rows split over
    `devices` one-device replicas with `slots` each, which decode in one program: it steps until
    the slowest replica is done, and every step reads the replica's actor on every device; the
    KV read is the busiest device's (`decode_reads`)."""
    per = [decode_reads(part, slots, prompt_len=prompt_len, cache_len=cache_len, live=live)
           for part in np.array_split(np.asarray(limits), devices)]
    steps = max(s for s, _ in per)
    kv = max(t for _, t in per) if live else steps * slots * cache_len
    return steps, steps * actor_bytes + kv * token_bytes


def _mean(runs: list[tuple[int, int]]) -> float:
    w = sum(s for _, s in runs)
    return sum(n * s for n, s in runs) / w if w else 0.0


def simulate_paged(limits: np.ndarray, prompt_len: int, max_tokens: int, num_pages: int,
                   page_size: int, slots: int, watermark_pages: int = 0) -> SimResult:
    """The paged pool through `PagedScheduler`: row i has a `prompt_len`-token prompt and
    generates limits[i] tokens; a preempted row starts again from its prompt."""
    from qurl_jax.sampling._page_pool import Admission, PagedScheduler, PagePool, pages_for

    pool = PagePool(num_pages, page_size, slots, int(pages_for(max_tokens, page_size)))
    sched = PagedScheduler(pool, max_tokens, Admission(watermark_pages))
    sched.submit(range(len(limits)), [prompt_len] * len(limits))
    target = np.zeros(slots, np.int64)
    generated = np.zeros(slots, np.int64)
    in_flight, busy = [], []
    regenerated = peak = 0
    while not sched.idle:
        for slot, row in sched.admit():
            target[slot], generated[slot] = limits[row], 0
        for slot, _ in sched.reserve_step():
            regenerated += int(generated[slot])
        active = sched.active
        n = int(active.sum())
        in_flight.append((n, 1))
        if sched.waiting:
            busy.append((n, 1))
        peak = max(peak, num_pages - pool.free_pages)
        generated[active] += 1
        sched.advance(active & (generated >= target))
    return SimResult(steps=len(in_flight), mean_in_flight=_mean(in_flight),
                     mean_in_flight_busy=_mean(busy), preemptions=sched.preemptions,
                     regenerated_tokens=regenerated, peak_pages=peak)


def expectations(limits: np.ndarray, prompt_len: int, max_new: int) -> dict[str, float]:
    """Analytic rows-in-flight ratios (paged / fixed) for these lengths, page rounding ignored."""
    lengths = limits.astype(np.float64)
    full = prompt_len + max_new
    return {"mean_len": float(lengths.mean()),
            "admission": full / (prompt_len + lengths.mean()),
            "time_average": full / (prompt_len + (lengths ** 2).mean() / (2 * lengths.mean()))}


def compare(limits: np.ndarray, *, prompt_len: int, max_new: int, max_tokens: int,
            fixed_slots: int, num_pages: int, page_size: int, paged_slots: int,
            watermark_pages: int, stream: bool) -> dict[str, Any]:
    """Fixed slots vs the paged pool on one set of response lengths: both schedules
    (`simulate_fixed`; `simulate_paged` with prompts of `prompt_len` and at most `max_tokens`
    per row), the ratio of rows in flight paged / fixed (`stream`: over the steps that began with
    rows waiting, the steady state; else over the whole run), of decode steps, and
    `expectations` for responses of at most `max_new`."""
    fixed = simulate_fixed(limits, fixed_slots)
    paged = simulate_paged(limits, prompt_len, max_tokens, num_pages, page_size, paged_slots,
                           watermark_pages)
    key = "mean_in_flight_busy" if stream else "mean_in_flight"
    return {"rows": len(limits), "fixed": dataclasses.asdict(fixed),
            "paged": dataclasses.asdict(paged),
            "ratio_in_flight": getattr(paged, key) / getattr(fixed, key),
            "ratio_steps": fixed.steps / paged.steps,
            "expected": expectations(limits, prompt_len, max_new)}


def kv_capacity(*, budget_bytes: int, peak_bytes: int, cache_bytes: int, token_bytes: int,
                prompt_len: int, max_new_tokens: int, page_size: int = 16, slot_factor: int = 4,
                watermark_fraction: float = 1 / 16, row_overhead_bytes: int = 0,
                planned_rows: int = 0, stream_rows_per_slot: int = 64, batch_rows: int = 0,
                seed: int = 0, lengths: Callable[[int, int], np.ndarray] | None = None
                ) -> dict[str, Any]:
    """Rollout rows one device's KV memory keeps decoding at once: fixed slots vs a paged pool.

    Pure (numbers in, numbers out; nothing compiled), per device. The decode program's planned
    peak `peak_bytes` holds `cache_bytes` of KV cache; the rest, non_kv = peak - cache
    (parameters, row outputs, logits, ...), stays, so the KV memory is kv_bytes =
    `budget_bytes` - non_kv. In it:

    - fixed slots, today's cache: each reserves prompt + max_new tokens of `token_bytes` (keys
      and values of every layer that this device holds), fixed_slots = kv_bytes // row_bytes;
    - a paged pool of num_pages = kv_bytes // (page_size * token_bytes) pages, behind
      `slot_factor` x fixed_slots page-table rows (the paged decode batch), admission leaving
      `watermark_fraction` of the pool free, run by `sampling._page_pool`'s scheduler
      (`compare`).

    `row_overhead_bytes` > 0 says that non_kv grows by that much per row decoded at once (the
    decode batch's logits and sampling buffers), of which the program planned `planned_rows`:
    then the memory for rows is room = budget - (non_kv - planned_rows * overhead), fixed_slots =
    room // (row_bytes + overhead), and the pool gets room - paged rows * overhead
    (`pool_bytes`). With 0 (the default) both are as above.

    Rows in flight come from simulating both schedules on response lengths `lengths(rows, seed)`
    (default: `bench.sampler.tail_limits` for `max_new_tokens`, the configs' long-tailed
    distribution), every prompt `prompt_len` tokens:
    - 'stream': stream_rows_per_slot x fixed_slots rows, measured while rows wait (the steady
      state of a long rollout);
    - 'batch' (when `batch_rows` > 0): one rollout of `batch_rows` rows per device, over the
      whole run (when they all fit in the fixed slots, both hold them all at once).
    Each with the analytic `expectations` (which assume memory, not the rows, is the bound).

    No room: when the memory holds no whole row (prompt + max_new tokens), neither cache can
    decode: fixed_slots and paged_slots are 0, 'fits_one_row' is False, and no case is
    simulated. Returns a JSON-able dict; bytes are per device. Raises ValueError on a
    non-positive size, a negative overhead, cache_bytes outside [0, peak_bytes], or more than
    `MAX_SIMULATED_SLOTS` fixed slots.
    """
    if min(token_bytes, prompt_len, max_new_tokens, page_size, slot_factor) < 1:
        raise ValueError(f"kv_capacity: token_bytes={token_bytes}, prompt_len={prompt_len}, "
                         f"max_new_tokens={max_new_tokens}, page_size={page_size}, "
                         f"slot_factor={slot_factor} must all be >= 1")
    if min(row_overhead_bytes, planned_rows) < 0:
        raise ValueError(f"kv_capacity: row_overhead_bytes={row_overhead_bytes}, "
                         f"planned_rows={planned_rows} must be >= 0")
    if not 0 <= cache_bytes <= peak_bytes:
        raise ValueError(f"kv_capacity: cache_bytes={cache_bytes} must be within "
                         f"[0, peak_bytes={peak_bytes}]")
    from qurl_jax.sampling._page_pool import pages_for

    max_tokens = prompt_len + max_new_tokens
    non_kv = peak_bytes - cache_bytes
    kv_bytes = max(budget_bytes - non_kv, 0)
    row_bytes = max_tokens * token_bytes
    room = max(budget_bytes - max(non_kv - planned_rows * row_overhead_bytes, 0), 0)
    fixed_slots = room // (row_bytes + row_overhead_bytes)
    paged_slots = slot_factor * fixed_slots
    pool_bytes = max(room - paged_slots * row_overhead_bytes, 0)
    num_pages = pool_bytes // (page_size * token_bytes)
    # A paged row may grow to max_tokens: the pool must hold one such row.
    fits = fixed_slots >= 1 and num_pages >= int(pages_for(max_tokens, page_size))
    out: dict[str, Any] = {
        "budget_bytes": budget_bytes, "peak_bytes": peak_bytes, "cache_bytes": cache_bytes,
        "non_kv_bytes": non_kv, "kv_bytes": kv_bytes, "token_bytes": token_bytes,
        "row_bytes": row_bytes, "row_overhead_bytes": row_overhead_bytes,
        "planned_rows": planned_rows, "prompt_len": prompt_len,
        "max_new_tokens": max_new_tokens, "fits_one_row": bool(fits),
        "fixed_slots": int(fixed_slots) if fits else 0, "page_size": page_size,
        "pool_bytes": int(pool_bytes), "num_pages": int(num_pages),
        "paged_slots": int(paged_slots) if fits else 0,
        "watermark_pages": int(num_pages * watermark_fraction), "cases": {}}
    if not fits:
        return out
    if fixed_slots > MAX_SIMULATED_SLOTS:
        raise ValueError(f"kv_capacity: {fixed_slots} fixed slots per device ({room} bytes "
                         f"for rows of {row_bytes}); the simulation takes at most "
                         f"{MAX_SIMULATED_SLOTS}")
    if lengths is None:
        from qurl_jax.bench.sampler import tail_limits

        def lengths(rows: int, seed: int) -> np.ndarray:
            return tail_limits(rows, max_new_tokens, seed)

    cases = {"stream": lengths(stream_rows_per_slot * int(fixed_slots), seed)}
    if batch_rows > 0:
        cases["batch"] = lengths(batch_rows, seed + 1)
    for name, limits in cases.items():
        out["cases"][name] = compare(
            np.asarray(limits), prompt_len=prompt_len, max_new=max_new_tokens,
            max_tokens=max_tokens, fixed_slots=int(fixed_slots), num_pages=int(num_pages),
            page_size=page_size, paged_slots=out["paged_slots"],
            watermark_pages=out["watermark_pages"], stream=name == "stream")
    return out


def describe_capacity(capacity: dict[str, Any]) -> list[str]:
    """The human lines of a `kv_capacity` result."""
    c = capacity
    lines = [f"KV capacity per device: budget {c['budget_bytes'] / GIB:.2f} GiB - non-KV "
             f"{c['non_kv_bytes'] / GIB:.2f} (decode peak {c['peak_bytes'] / GIB:.2f} - its "
             f"cache {c['cache_bytes'] / GIB:.2f}) = {c['kv_bytes'] / GIB:.2f} GiB of KV, "
             f"{c['row_bytes'] / GIB:.3f} GiB per row of {c['prompt_len']} + "
             f"{c['max_new_tokens']} tokens"]
    if c["row_overhead_bytes"]:
        lines.append(f"  non-KV per row decoded at once: {c['row_overhead_bytes'] / (1 << 20):.2f}"
                     f" MiB ({c['planned_rows']} rows planned)")
    if not c["fits_one_row"]:
        return lines + ["  no room for one row: 0 fixed slots, 0 paged rows"]
    lines.append(f"  fixed slots {c['fixed_slots']}; paged pool {c['pool_bytes'] / GIB:.2f} GiB ="
                 f" {c['num_pages']} pages of {c['page_size']} behind {c['paged_slots']} rows, "
                 f"admission leaves {c['watermark_pages']} free")
    for name, case in c["cases"].items():
        key = "mean_in_flight_busy" if name == "stream" else "mean_in_flight"
        exp, paged = case["expected"], case["paged"]
        lines.append(
            f"  {name} ({case['rows']} rows, simulated): rows in flight fixed "
            f"{case['fixed'][key]:.1f}, paged {paged[key]:.1f} -> {case['ratio_in_flight']:.2f}x"
            f" (expected {exp['admission']:.2f}x-{exp['time_average']:.2f}x), preemptions "
            f"{paged['preemptions']}")
    return lines


def simulate(config: Any, *, page_size: int, slot_factor: int, prompt_len: int | None,
             stream_rows: int, seed: int, watermark_pages: int | None,
             log=print) -> dict[str, Any]:
    from qurl_jax.bench.sampler import tail_limits

    c = config
    max_new, prompt = c.rollout.max_new_tokens, c.data.max_prompt_len
    prompt_len = prompt if prompt_len is None else prompt_len
    # The batch shards of the config's mesh on its hosts: rows split over data x fsdp (tensor
    # parallelism splits a row's heads, not the rows).
    devices = host_devices_for(c.mesh) // max(int(c.mesh.tensor), 1)
    fixed_slots = c.rollout.max_concurrent_rows // devices  # rows per device, as the mesh splits
    max_tokens = prompt + max_new
    num_pages = fixed_slots * max_tokens // page_size
    slots = slot_factor * fixed_slots
    watermark_pages = num_pages // 16 if watermark_pages is None else watermark_pages
    log(f"per device: {fixed_slots} fixed slots of {prompt} + {max_new} tokens = "
        f"{num_pages} pages of {page_size}; paged: up to {slots} rows, prompts of {prompt_len}, "
        f"admission leaves {watermark_pages} pages free")
    out: dict[str, Any] = {"fixed_slots": fixed_slots, "num_pages": num_pages,
                           "watermark_pages": watermark_pages,
                           "page_size": page_size, "paged_slots": slots,
                           "prompt_len": prompt_len, "max_new_tokens": max_new}
    cases = {"stream": tail_limits(stream_rows, max_new, seed),
             "batch": tail_limits(c.data.prompts_per_step * c.rollout.n // devices, max_new,
                                  seed + 1)}
    for name, limits in cases.items():
        t0 = time.perf_counter()
        out[name] = case = compare(
            limits, prompt_len=prompt_len, max_new=max_new, max_tokens=max_tokens,
            fixed_slots=fixed_slots, num_pages=num_pages, page_size=page_size, paged_slots=slots,
            watermark_pages=watermark_pages, stream=name == "stream")
        fixed, paged = (SimResult(**case[k]) for k in ("fixed", "paged"))
        exp, ratio = case["expected"], case["ratio_in_flight"]
        key = "mean_in_flight_busy" if name == "stream" else "mean_in_flight"
        log(f"\n{name}: {len(limits)} rows, mean response {exp['mean_len']:.0f} of {max_new} "
            f"({time.perf_counter() - t0:.0f} s to simulate)")
        log(f"  rows in flight ({'while rows wait' if name == 'stream' else 'mean over the run'}):"
            f" fixed {getattr(fixed, key):.1f}, paged {getattr(paged, key):.1f} -> {ratio:.2f}x"
            f"  (expected {exp['admission']:.2f}x by mean length, {exp['time_average']:.2f}x by "
            f"the time-average)")
        log(f"  decode steps to finish: fixed {fixed.steps}, paged {paged.steps} -> "
            f"{fixed.steps / paged.steps:.2f}x fewer")
        total = int(limits.sum())
        log(f"  preemptions {paged.preemptions}: regenerated response tokens "
            f"{paged.regenerated_tokens} ({100 * paged.regenerated_tokens / total:.2f}% of "
            f"{total}), prompts prefilled again {paged.preemptions} x {prompt_len} tokens")
        log(f"  most pages held at once: {paged.peak_pages} of {num_pages} "
            f"({100 * paged.peak_pages / num_pages:.0f}%)")
    return out


def reads_table(config_path: str, slots_list: list[int], actor_bytes: int, seed: int = 0,
                log=print) -> dict[str, Any]:
    """`rollout_reads` of one rollout of the config (prompts_per_step x n rows, the configs'
    long-tailed lengths, every prompt max_prompt_len) on one-device replicas of its mesh's
    devices, for each of `slots_list` rows per device, with every-slot and live KV reads; the
    bytes relative to the config's own slots with every slot read."""
    from qurl_jax.bench.sampler import tail_limits
    from qurl_jax.config.base import load_config_file
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.plan import memory_plan

    c = load_config_file(config_path)
    settings = RunSettings.from_config(c)
    shapes = os.path.join(os.path.dirname(os.path.abspath(config_path)), "shapes")
    m = memory_plan.model_shape(settings.model, shapes)
    token = m.num_layers * settings.rollout.sampler.kv_precision.bytes_per_token(
        m.num_kv_heads, m.head_dim, m.compute_dtype)
    devices = host_devices_for(c.mesh)
    p, g = c.data.max_prompt_len, c.rollout.max_new_tokens
    limits = tail_limits(c.data.prompts_per_step * c.rollout.n, g, seed)
    own = max(c.rollout.max_concurrent_rows // devices, 1) if c.rollout.max_concurrent_rows \
        else len(limits) // devices
    kw = dict(prompt_len=p, cache_len=p + g, token_bytes=token, actor_bytes=actor_bytes)
    base = rollout_reads(limits, devices, own, live=False, **kw)[1]
    out: dict[str, Any] = {"config": config_path, "devices": devices, "rows": len(limits),
                           "config_slots": own, "token_bytes": token,
                           "actor_bytes": actor_bytes, "cases": []}
    log(f"{config_path}: {len(limits)} rows of {p} + up to {g} tokens over {devices} replicas, "
        f"{token / 1024:.0f} KiB of KV a token, a {actor_bytes / GIB:.2f} GiB replica; bytes "
        f"relative to the config's {own} slots per device with every slot read")
    for slots in slots_list:
        for live in (False, True):
            steps, nbytes = rollout_reads(limits, devices, slots, live=live, **kw)
            out["cases"].append({"slots": slots, "live": live, "steps": steps,
                                 "bytes_per_device": nbytes, "speedup": base / nbytes})
            log(f"  {slots:>5} rows per device, {'live' if live else 'every'} KV slot"
                f"{'s' if live else ''}: {steps} decode steps, {nbytes / GIB:,.0f} GiB read per "
                f"device -> {base / nbytes:.2f}x (an HBM-bound prediction)")
    return out


# ---------------------------------------------------------------------------------- compiles
def _devices(target: str) -> list[Any]:
    """One compile-only device of `target` ('h100' or 'v5p'), through `parallel.targets`."""
    from qurl_jax.parallel import targets

    names = {"h100": "gpu:h100-1", "v5p": "tpu:v5p-8"}
    if target not in names:
        raise ValueError(f"--target={target!r}: expected h100 or v5p")
    return targets.parse(names[target]).devices()


def compile_programs(target: str, rows_list: list[int], *, heads: int = 12, kv_heads: int = 2,
                     head_dim: int = 128, slots: int = 9216, page_size: int = 16,
                     log=print) -> dict[str, Any]:
    """Compiles one layer's decode attention per implementation for `target`; the memory figures
    of each compiled program (a compiler's prediction, no device ran)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from qurl_jax.models import decode_attention as da
    from qurl_jax.plan.memory_plan import compiled_memory

    device = _devices(target)[0]
    platform = "gpu" if target == "h100" else "tpu"
    sh = SingleDeviceSharding(device)
    bf16 = jnp.bfloat16
    spec = lambda shape, dtype=bf16: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)  # noqa: E731
    out: dict[str, Any] = {"target": target, "device": str(device.device_kind), "programs": {}}
    for rows in rows_list:
        n = slots // page_size
        q = spec((rows, heads, head_dim))
        dense = (spec((rows, kv_heads, slots, head_dim)),) * 2
        lengths = spec((rows,), jnp.int32)
        paged = (spec((kv_heads, rows * n, page_size, head_dim)),) * 2
        table = spec((rows, n), jnp.int32)
        programs = {
            "dense xla": (lambda q, k, v, n_: da.decode_attention(
                q, k, v, n_, impl="xla", platform=platform), (q, *dense, lengths)),
            "paged xla": (lambda q, k, v, t, n_: da.paged_decode_attention(
                q, k, v, t, n_, impl="xla", platform=platform), (q, *paged, table, lengths)),
            "paged pallas": (lambda q, k, v, t, n_: da.paged_decode_attention(
                q, k, v, t, n_, impl="pallas", platform=platform), (q, *paged, table, lengths)),
        }
        if platform == "gpu":
            programs["dense pallas"] = (lambda q, k, v, n_: da.decode_attention(
                q, k, v, n_, impl="pallas", platform=platform), (q, *dense, lengths))
        for name, (fn, args) in programs.items():
            t0 = time.perf_counter()
            lowered = jax.jit(fn).lower(*args)
            compiled = lowered.compile()
            text = compiled.as_text() or ""
            kernels = sorted({k for k in ("__gpu$xla.gpu.triton", "tpu_custom_call")
                              if k in text})
            figures = compiled_memory(compiled)
            out["programs"][f"{name} rows={rows}"] = {**figures, "kernels": kernels}
            log(f"compiled {name:13s} rows={rows:4d} for {device.device_kind} in "
                f"{time.perf_counter() - t0:5.1f} s: "
                + "  ".join(f"{k.removesuffix('_bytes')} {v / GIB:.3f}" for k, v in
                            figures.items()) + f" GiB  custom calls {kernels}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sim = sub.add_parser("simulate", help="rows in flight, paged vs fixed slots")
    sim.add_argument("--config", default="configs/deepscaler_r1_1p5b_int8.py")
    sim.add_argument("--page_size", type=int, default=16)
    sim.add_argument("--slot_factor", type=int, default=4,
                     help="page-table rows per fixed slot (the decode batch's upper bound)")
    sim.add_argument("--prompt_len", type=int, default=None)
    sim.add_argument("--stream_rows", type=int, default=4096)
    sim.add_argument("--watermark_pages", type=int, default=None,
                     help="free pages an admission must leave; default: 1/16 of the pool")
    sim.add_argument("--seed", type=int, default=0)
    reads = sub.add_parser("reads", help="decode steps and HBM bytes of one rollout, by "
                                         "slots and attention")
    reads.add_argument("--config", default="configs/deepscaler_r1_1p5b_int8.py")
    reads.add_argument("--slots", default="32,64,128",
                       help="rows decoded at once per device (fixed slots or a pool's rows)")
    reads.add_argument("--actor_gib", type=float, required=True,
                       help="the replica per device (bench.memory's 'actor parameters')")
    reads.add_argument("--seed", type=int, default=0)
    comp = sub.add_parser("compile", help="deviceless compiles of the decode attention kernels")
    comp.add_argument("--target", choices=("h100", "v5p"), required=True)
    comp.add_argument("--rows", default="64,256")
    comp.add_argument("--heads", type=int, default=12)
    comp.add_argument("--kv_heads", type=int, default=2)
    comp.add_argument("--head_dim", type=int, default=128)
    comp.add_argument("--slots", type=int, default=9216, help="tokens per row (prompt + new)")
    comp.add_argument("--page_size", type=int, default=16)
    for p in (sim, reads, comp):
        p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    if args.command == "simulate":
        if not os.path.exists(args.config):
            parser.error(f"--config={args.config}: no such file")
        config = runpy.run_path(args.config)["get_config"]()
        figures = simulate(config, page_size=args.page_size, slot_factor=args.slot_factor,
                           prompt_len=args.prompt_len, stream_rows=args.stream_rows,
                           seed=args.seed, watermark_pages=args.watermark_pages)
    elif args.command == "reads":
        if not os.path.exists(args.config):
            parser.error(f"--config={args.config}: no such file")
        figures = reads_table(args.config, [int(x) for x in args.slots.split(",")],
                              int(args.actor_gib * GIB), args.seed)
    else:
        figures = compile_programs(args.target, [int(r) for r in args.rows.split(",")],
                                   heads=args.heads, kv_heads=args.kv_heads,
                                   head_dim=args.head_dim, slots=args.slots,
                                   page_size=args.page_size)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
