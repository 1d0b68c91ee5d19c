"""Benchmark: rollout decode throughput of our sampler (fp32, int8 actors) vs transformers, on CPU.

Run `python -m qurl_jax.bench.sampler`. One ~98M-parameter Qwen2-shaped model (random weights),
batch 16, prompts of 128 tokens, 256 new tokens with EOS disabled so every row has the same length,
full vocabulary sampling at temperature 1. Engines, timed in one run and interleaved round by round
so that load from other processes hits them alike:

- `ours fp32`: `Sampler` with the float32 parameters;
- `ours int8`: `Sampler` with `requantize(params, 'int8')` and the quantized `dot_general` hook;
- `ours int8_vocab`: the same with the embedding and LM head as int8 codes too (`Recipe.
  quantize_vocab`, the trainer's default rollout actor: `rollout.quantize_vocab`);
- `ours X kv int8` / `kv fp8` (`--kv-precisions`): engine X over an 8-bit KV cache
  (`rollout.kv_precision`; on CPU an int8 cache is read by the decode-attention kernel's int8
  variant, an fp8 one dequantized by XLA);
- `hf torch xN`: `Qwen2ForCausalLM.generate(do_sample=True, top_k=0)` in torch on the CPU with N
  threads, same weights (ratios are taken against the faster thread count).

Decode time is the time of a 256-token call minus the time of a 1-token call (prefill plus the first
token), each the fastest of a few rounds, so decode tokens/s = batch * 255 / difference. The decode
step's achieved memory bandwidth is the bytes it must read per step (every parameter once, plus the
KV cache: the slots written so far with the CPU decode attention kernel, the whole cache with XLA's
attention, which masks the unused slots but reads them) divided by the step time, compared with
the bandwidth of a large numpy copy measured in the same run.

`--cases long_tail` (in the default) adds the continuous batching case: `--tail-prompts`
prompts x `--tail-n` samples through `--tail-slots` concurrent rows, with per-row response
length limits drawn from a log-normal with median `--new-tokens` / 4 (sigma 1, clipped to
[1, --new-tokens]; about 8% of the rows reach the maximum), EOS disabled.
Per precision (fp32, int8) it times, as whole `sample` calls (prefill included):
- `static equal`: `Sampler`, every row `--new-tokens` long (the equal-length throughput);
- `static tail`: `Sampler` on the long-tailed rows. It has no per-row limit, but its decode loop
  stops when the longest row of a chunk does, so it is run chunk by chunk (`--tail-slots` rows,
  prompt-major) with max_new_tokens = that chunk's longest limit: the cost it would have, the
  same programs; its useful tokens are the sum of the limits;
- `refill tail`: `RefillSampler` (same slots) with the limits;
- `refill equal`: `RefillSampler`, every row `--new-tokens` long (its overhead over static).
tokens/s = useful response tokens / seconds; the goals are refill tail / static tail >= 1.8 and
refill tail / static equal >= 0.85.

`--cases paged` (in the default) adds the paged KV pool to the long-tailed case (alone, it times
only `refill tail` beside it):
- `paged tail`: `RefillSampler` with the same slots, the same limits and a pool of `kv_pages` =
  slots x ceil((prompt + generation bucket) / `--page-size`) pages: exactly the fixed slots' KV
  memory. Its decode calls run at most `--max-steps-per-call` steps (0 = the page size);
- `paged tail Nx` (`--paged-scales`, default 1,2): N times the slots in that same memory (the
  pool's point: more rows in flight, admitted as pages are free, preempted when they run short).
Each is checked against refill tail run with XLA's attention (same key, one untimed call): the
same tokens, or rows that part only after a prefix whose log-probs agree within `--logp-tol`
(rounding: the programs fuse and sum differently, and a near tie or an int8 activation code turns a
last-bit difference into another token); an error otherwise. It says how many rows part from it
and from refill tail's own tokens (the CPU attention kernel rounds differently again). The floor
on a CPU, where the paged attention is XLA's over every row's pages gathered, per layer per step:
paged tail / refill tail >= 0.90.

`--cases layout` (not in the default; needs several devices, e.g. `XLA_FLAGS=
--xla_force_host_platform_device_count=8`) times the int8 actor's `refill tail` in the learner's
layout (the actor requantized on an FSDP mesh over every device, the sampler on that mesh, as
before the rollout layout) and in the rollout layout (`qurl_jax.parallel.rollout_layout`: the codes
resharded to one-device replicas, `--rollout-tensor` devices each), interleaved round by round,
and the reshard's seconds. Host devices copy instead of crossing links and share the same cores,
so this checks the mechanism, not an accelerator's speed-up.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from qurl_jax.cpu_kernels import decode_attention
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.kv_quant import KVPrecision, kv_precision
from qurl_jax.models.params import init_params
from qurl_jax.runtime.sizes import tree_bytes
from qurl_jax.sampling import RefillSampler, Sampler, SamplingParams

# ~98M parameters: 73M in 12 decoder layers, 24.6M in the tied 32k x 768 embedding / LM head.
BENCH_CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=12,
    num_heads=12, num_kv_heads=2, head_dim=64, attention_bias=True, tie_word_embeddings=True,
    max_position_embeddings=4096, rope_theta=1e6,
)


def copy_bandwidth(nbytes: int = 1 << 30, repeats: int = 3) -> float:
    """Bytes moved per second (read + write) by numpy copying a `nbytes` float32 array; best of
    `repeats`."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def sampler_timer(config: ModelConfig, params: Any, dot_general: Any,
                  prompts: list[list[int]], max_new: int, max_concurrent_rows: int = 0,
                  kv_precision: str = "bf16", page_size: int = 0, steps_per_call: int = 0,
                  fused_products: str = "auto") -> Callable[[int], float]:
    """run(new_tokens) -> seconds of one `Sampler.sample` call at temperature 1 (checked to run
    exactly new_tokens steps); one generation bucket, so the 1-token and the full call run the same
    two programs. `kv_precision`: the cache's (`Engine`). `page_size` > 0: a `RefillSampler`
    over a paged pool of pages of that many tokens, a page for every token of every row (it never
    preempts), read by the paged decode attention (JAX's paged kernels on GPU and TPU), at most
    `steps_per_call` decode steps between two host calls (0: the sampler's default, a page).
    `fused_products`: the engine's (`Engine.fused_products`)."""
    buckets = dict(prompt_buckets=(len(prompts[0]),), gen_buckets=(max_new,),
                   max_concurrent_rows=max_concurrent_rows, kv_precision=kv_precision,
                   fused_products=fused_products)
    if page_size:
        rows = max_concurrent_rows or len(prompts)
        pages = paged_pool_pages(rows, len(prompts[0]), max_new, page_size)
        sampler: Any = RefillSampler(config, dot_general, kv_pages=pages, kv_page_size=page_size,
                                     kv_watermark_pages=0, max_steps_per_call=steps_per_call,
                                     **buckets)
    else:
        sampler = Sampler(config, dot_general, **buckets)

    def run(new_tokens: int) -> float:
        t0 = time.perf_counter()
        out = sampler.sample(params, prompts,
                             SamplingParams(max_new_tokens=new_tokens, temperature=1.0),
                             key=jax.random.key(0))
        out.tokens.block_until_ready()
        elapsed = time.perf_counter() - t0
        if int(out.num_steps) != new_tokens:
            raise RuntimeError(f"sampler ran {int(out.num_steps)} steps, expected {new_tokens}")
        return elapsed

    return run


def _transformers(config: ModelConfig, params: Any, prompts: list[list[int]], threads: int
                  ) -> Callable[[int], float]:
    import torch

    from qurl_jax.models.hf import to_transformers

    model = to_transformers(config, params, attn_implementation="sdpa", bos_token_id=None,
                            eos_token_id=None, pad_token_id=0)
    ids = torch.tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)

    def run(new_tokens: int) -> float:
        torch.manual_seed(0)
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
                eos_token_id=None,
            )
        elapsed = time.perf_counter() - t0
        if out.shape[1] != ids.shape[1] + new_tokens:
            raise RuntimeError(f"transformers generated {out.shape[1] - ids.shape[1]} tokens")
        return elapsed

    return run


def tail_limits(rows: int, max_new: int, seed: int = 0) -> np.ndarray:
    """i32[rows] long-tailed length limits: log-normal, median max_new / 4, clipped to
    [1, max_new]."""
    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(max_new / 4), 1.0, rows)
    return np.clip(np.round(draws), 1, max_new).astype(np.int32)


def paged_pool_pages(slots: int, prompt_len: int, max_new: int, page_size: int) -> int:
    """Pages of `page_size` tokens that hold exactly the KV memory of `slots` fixed slots of
    prompt_len + max_new tokens each (a row's last page may be partly unused)."""
    return slots * -(-(prompt_len + max_new) // page_size)


def paged_case(scale: int) -> str:
    """The name of the paged case with `scale` times the fixed slots in their memory."""
    return "paged tail" if scale == 1 else f"paged tail {scale}x"


def token_check(paged: tuple[np.ndarray, np.ndarray], reference: tuple[np.ndarray, np.ndarray],
                logp_tol: float) -> str:
    """Checks a paged case's (tokens, log-probs) against the dense refill's (`reference`, same
    key, the same attention kernel): identical tokens, or rows that part only after a common
    prefix whose log-probs agree within `logp_tol` (rounding: the paged row's slots sit at other
    offsets, so the kernel sums them in other groups, and an int8 activation code or a near tie
    amplifies a last-bit difference into another token; a wrong page or position would move the
    log-probs by far more, from its first token). Raises otherwise; says how many rows differ."""
    (tokens, logp), (ref_tokens, ref_logp) = paged, reference
    differs = tokens != ref_tokens
    # Per row: the positions before its first differing token (all of a row that agrees).
    first = np.where(differs.any(axis=1), differs.argmax(axis=1), tokens.shape[1])
    prefix = np.arange(tokens.shape[1])[None, :] < first[:, None]
    gap = float(np.abs(np.where(prefix, logp - ref_logp, 0.0)).max())
    rows, total = int(differs.any(axis=1).sum()), len(tokens)
    if gap > logp_tol:
        raise RuntimeError(f"paged pool: log-probs differ by {gap:.3g} (> --logp-tol {logp_tol}) "
                           f"from the dense refill's before any token does (same key)")
    return (f"{rows} of {total} rows' tokens differ from refill tail's (log-probs before: "
            f"within {gap:.1e})")


def _quantized_engines(engines: list[str]) -> list[tuple[str, Any]]:
    """(engine name, quant recipe) of the quantized engines among `engines`: 'int8', and
    'int8_vocab' (its vocabulary tables int8 too, as the trainer's rollout runs it)."""
    from qurl_jax.quant import get_recipe

    recipes = {"int8": get_recipe("int8"), "int8_vocab": get_recipe("int8", quantize_vocab=True)}
    return [(e, recipes[e]) for e in engines if e in recipes]


def _long_tail(config: ModelConfig, engines: dict[str, tuple[Any, Any]], args: argparse.Namespace,
               static_cases: bool = True, paged_scales: tuple[int, ...] = ()) -> None:
    """Times static vs refilling sampler on long-tailed and equal lengths (`static_cases`; refill
    tail always) and the paged pool at `paged_scales` times the slots in the fixed slots' memory;
    prints tokens/s and the ratios (see the module docstring)."""
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, config.vocab_size, (args.tail_prompts, args.prompt_len)).tolist()
    n, slots, max_new = args.tail_n, args.tail_slots, args.new_tokens
    rows = len(prompts) * n
    limits = tail_limits(rows, max_new)
    equal = np.full(rows, max_new, np.int32)
    group = slots // n  # prompts per static chunk
    kw = dict(key=jax.random.key(0), n=n)
    settings = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    buckets = dict(prompt_buckets=(args.prompt_len,), gen_buckets=(max_new,))

    cases: dict[str, Callable[[], float]] = {}
    # Compile / warm up: the timed runs reuse these programs. One chunk builds the static
    # sampler's two; the refilling sampler's long tail builds its inserts, decodes and shrinks,
    # a superset of what its equal-length run needs.
    warm_ups: list[Callable[[], float]] = []
    refill_runs: dict[str, Any] = {}  # case name -> RefillRun of its last call
    outputs: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # case -> tokens, log-probs (last call)
    kv_pages = paged_pool_pages(slots, args.prompt_len, max_new, args.page_size)
    for name, (params, dot_general) in engines.items():
        static = Sampler(config, dot_general, max_concurrent_rows=slots, **buckets)
        refill = RefillSampler(config, dot_general, max_concurrent_rows=slots,
                               refill_min=args.refill_min, **buckets)
        paged = {scale: RefillSampler(config, dot_general, max_concurrent_rows=scale * slots,
                                      refill_min=args.refill_min, kv_pages=kv_pages,
                                      kv_page_size=args.page_size,
                                      max_steps_per_call=args.max_steps_per_call, **buckets)
                 for scale in paged_scales}

        def static_run(lim: np.ndarray, static=static, params=params, chunks: int = 0) -> float:
            t0 = time.perf_counter()
            for c in range(0, group * chunks or len(prompts), group):
                chunk_limit = int(lim[c * n: (c + group) * n].max())
                out = static.sample(params, prompts[c: c + group],
                                    settings.replace(max_new_tokens=chunk_limit), **kw)
            out.tokens.block_until_ready()
            return time.perf_counter() - t0

        def refill_run(lim: np.ndarray, case: str, refill=refill, params=params) -> float:
            t0 = time.perf_counter()
            out = refill.sample(params, prompts, settings, length_limits=lim, **kw)
            out.tokens.block_until_ready()
            elapsed = time.perf_counter() - t0
            if int(np.asarray(out.lengths).sum()) != int(lim.sum()):
                raise RuntimeError(f"{case}: the wrong number of tokens")
            refill_runs[case] = refill.last_run
            outputs[case] = np.asarray(out.tokens), np.asarray(out.logp)
            return elapsed

        if static_cases:
            cases[f"{name} static equal"] = functools.partial(static_run, equal)
            cases[f"{name} static tail"] = functools.partial(static_run, limits)
            warm_ups.append(functools.partial(static_run, equal, chunks=1))
        for kind, lim in (("tail", limits), ("equal", equal))[:1 + static_cases]:
            case = f"{name} refill {kind}"
            cases[case] = functools.partial(refill_run, lim, case)
        warm_ups.append(cases[f"{name} refill tail"])
        for scale, sampler in paged.items():
            case = f"{name} {paged_case(scale)}"
            cases[case] = functools.partial(refill_run, limits, case, sampler)
            warm_ups.append(cases[case])

    for warm_up in warm_ups:
        warm_up()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, run in cases.items():
            times[name].append(run())
    print(f"long-tailed case: {len(prompts)} prompts x n={n} = {rows} rows through {slots} "
          f"concurrent rows, prompt {args.prompt_len}, limits median {int(np.median(limits))} "
          f"mean {limits.mean():.1f} max {limits.max()} (equal: {max_new}); refill_min "
          f"{args.refill_min or 'default'}; best of {args.rounds} rounds, whole sample calls")
    if paged_scales:
        print(f"paged pool: {kv_pages} pages of {args.page_size} tokens (= {slots} fixed slots of "
              f"{args.prompt_len} + {max_new} tokens), at most "
              f"{args.max_steps_per_call or args.page_size} steps per decode call")
    print(f"{'case':<24}{'seconds':>9}{'tokens':>8}{'tok/s':>9}")
    rate = {}
    for name in cases:
        tokens = int((equal if name.endswith("equal") else limits).sum())
        best = min(times[name])
        rate[name] = tokens / best
        print(f"{name:<24}{best:>9.2f}{tokens:>8}{rate[name]:>9.0f}")
    for name in engines:
        tail = rate[f"{name} refill tail"]
        for case in [f"{name} refill tail"] + [f"{name} {paged_case(s)}" for s in paged_scales]:
            run = refill_runs[case]
            paging = (f", {run.preemptions} preemptions, peak {run.peak_pages} of {kv_pages} pages"
                      if case != f"{name} refill tail" else f", {run.shrinks} shrinks")
            print(f"{case}: occupancy {run.occupancy:.2f}, {run.decode_calls} decode calls, "
                  f"{run.inserts} inserts, {run.decode_steps} decode steps ({run.slot_steps} "
                  f"slot-steps), {run.prefilled} prompts prefilled{paging}")
        if static_cases:
            equal_rate = rate[f"{name} static equal"]
            print(f"{name}: refill tail / static tail {tail / rate[f'{name} static tail']:.2f}x "
                  f"(goal >= 1.8); refill tail / static equal {tail / equal_rate:.2f} (goal >= "
                  f"0.85); refill equal / static equal "
                  f"{rate[f'{name} refill equal'] / equal_rate:.2f}")
        for scale in paged_scales:
            case = f"{name} {paged_case(scale)}"
            print(f"{name}: {paged_case(scale)} / refill tail {rate[case] / tail:.2f}"
                  + (" (floor >= 0.90)" if scale == 1 else "") + "; "
                  + token_check(outputs[case], outputs[f"{name} refill tail"], args.logp_tol))


def layouts(config: ModelConfig, params: Any, args: argparse.Namespace) -> dict[str, float]:
    """The `layout` case (module docstring): tokens/s of the int8 actor's long tail in the
    learner's and the rollout's layout, and the reshard's seconds; prints and returns them."""
    from qurl_jax import quant
    from qurl_jax.models import param_logical_axes
    from qurl_jax.parallel import rollout_layout as rl
    from qurl_jax.parallel.sharding import make_mesh, shard_params

    if jax.device_count() < 2:
        raise SystemExit("--cases layout: needs several devices (XLA_FLAGS="
                         "--xla_force_host_platform_device_count=8 on a CPU)")
    learner = make_mesh(fsdp=-1)
    master = shard_params(params, param_logical_axes(config), learner)
    actor = jax.block_until_ready(quant.requantize(master, "int8"))
    reshard = rl.Reshard(param_logical_axes(config), rl.rollout_mesh(learner, args.rollout_tensor))
    hook = quant.make_dot_general("int8")
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, config.vocab_size, (args.tail_prompts, args.prompt_len)).tolist()
    n, max_new = args.tail_n, args.new_tokens
    limits = tail_limits(len(prompts) * n, max_new)
    settings = SamplingParams(max_new_tokens=max_new, temperature=1.0)
    buckets = dict(prompt_buckets=(args.prompt_len,), gen_buckets=(max_new,))
    samplers = {name: RefillSampler(config, hook, max_concurrent_rows=args.tail_slots,
                                    refill_min=args.refill_min, mesh=mesh, **buckets)
                for name, mesh in (("learner layout", learner), ("rollout layout", reshard.mesh))}

    def resharded() -> tuple[Any, float]:
        t0 = time.perf_counter()
        out = jax.block_until_ready(reshard(actor))
        return out, time.perf_counter() - t0

    def run(name: str, weights: Any) -> float:
        t0 = time.perf_counter()
        out = samplers[name].sample(weights, prompts, settings, length_limits=limits,
                                    key=jax.random.key(0), n=n)
        out.tokens.block_until_ready()
        return time.perf_counter() - t0

    replica, _ = resharded()  # compiles the reshard
    run("learner layout", actor)  # compile / warm up
    run("rollout layout", replica)
    times: dict[str, list[float]] = {"learner layout": [], "rollout layout": [], "reshard": []}
    for _ in range(args.rounds):
        times["learner layout"].append(run("learner layout", actor))
        replica, seconds = resharded()
        times["reshard"].append(seconds)
        times["rollout layout"].append(run("rollout layout", replica))
    moved = reshard.bytes(actor)
    tokens = int(limits.sum())
    rate = {k: tokens / min(times[k]) for k in ("learner layout", "rollout layout")}
    print(f"layouts: {len(prompts)} prompts x n={n} through {args.tail_slots} slots, "
          f"{jax.device_count()} {jax.devices()[0].platform} devices; learner FSDP "
          f"{dict(learner.shape)}, rollout {dict(reshard.mesh.shape)}; int8 refill tail, "
          f"{tokens} tokens; best of {args.rounds} interleaved rounds")
    for name in rate:
        print(f"  {name:<16}{min(times[name]):>8.2f} s{rate[name]:>9.0f} tok/s")
    print(f"  reshard         {min(times['reshard']) * 1e3:>8.1f} ms (best; median "
          f"{np.median(times['reshard']) * 1e3:.1f}), {moved.received / 2**20:.1f} MiB received "
          f"per device, {moved.per_quantized_parameter:.2f} bytes per quantized parameter")
    print(f"rollout layout / learner layout tokens/s: "
          f"{rate['rollout layout'] / rate['learner layout']:.2f}x")
    return {**{f"{k} tok/s": v for k, v in rate.items()},
            "reshard s": min(times["reshard"])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds per engine; the fastest counts (least disturbed by "
                             "other processes on the shared cores)")
    parser.add_argument("--max-concurrent-rows", type=int, default=0,
                        help="our sampler decodes at most this many rows at once (0 = all)")
    parser.add_argument("--engines", default="fp32,int8,transformers",
                        help="comma-separated subset of fp32,int8,int8_vocab,transformers")
    parser.add_argument("--torch-threads", default="2,1",
                        help="torch thread counts to time transformers with (each is a row; "
                             "with other processes on the cores, 2 threads can be far slower)")
    parser.add_argument("--cases", default="decode,long_tail,paged",
                        help="decode (equal lengths, vs transformers), long_tail (static vs "
                             "refilling sampler, fp32 and int8 among --engines) and/or paged "
                             "(the paged KV pool beside refill tail); layout (the learner's vs "
                             "the rollout's layout, several devices)")
    parser.add_argument("--tail-prompts", type=int, default=16)
    parser.add_argument("--tail-n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--tail-slots", type=int, default=16,
                        help="concurrent rows of both samplers (a multiple of --tail-n)")
    parser.add_argument("--refill-min", type=int, default=0,
                        help="RefillSampler refill_min (0 = its default)")
    parser.add_argument("--page-size", type=int, default=16, help="paged pool: tokens per page")
    parser.add_argument("--paged-scales", default="1,2",
                        help="paged cases: multiples of --tail-slots run in the fixed slots' "
                             "KV memory")
    parser.add_argument("--max-steps-per-call", type=int, default=0,
                        help="paged cases: most decode steps per call (0 = the page size)")
    parser.add_argument("--logp-tol", type=float, default=0.02,
                        help="paged cases: most log-prob difference from the dense refill with "
                             "XLA attention before a row's tokens part")
    parser.add_argument("--rollout-tensor", type=int, default=1,
                        help="layout case: devices per rollout replica")
    parser.add_argument("--kv-precisions", default="bf16",
                        help="decode case: our engines' KV caches, comma-separated subset of "
                             "bf16 (the compute dtype), int8, fp8 (rollout.kv_precision); each "
                             "one a row, interleaved with the others")
    parser.add_argument("--layers", type=int, default=BENCH_CONFIG.num_layers,
                        help="decoder layers (smaller = a smaller, faster model)")
    args = parser.parse_args(argv)
    try:
        scales = tuple(int(x) for x in args.paged_scales.split(",") if x)
    except ValueError:
        scales = ()
    if not scales or min(scales) < 1:
        parser.error(f"--paged-scales={args.paged_scales!r} must be positive integers")
    if args.page_size < 1 or args.max_steps_per_call < 0:
        parser.error(f"--page-size={args.page_size} must be >= 1 and --max-steps-per-call="
                     f"{args.max_steps_per_call} >= 0")
    engines = [e for e in args.engines.split(",") if e]
    cfg = BENCH_CONFIG.replace(num_layers=args.layers)
    load_before = os.getloadavg()[0]
    params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
    cases = args.cases.split(",")
    if "long_tail" in cases or "paged" in cases:
        from qurl_jax.quant import make_dot_general, requantize

        tail_engines = {}
        if "fp32" in engines:
            tail_engines["fp32"] = (params, jax.lax.dot_general)
        for name, recipe in _quantized_engines(engines):
            tail_engines[name] = (jax.block_until_ready(requantize(params, recipe)),
                                  make_dot_general(recipe))
        print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; "
              f"model {cfg.num_params / 1e6:.1f}M params ({cfg.num_layers} layers)")
        _long_tail(cfg, tail_engines, args, "long_tail" in cases,
                   scales if "paged" in cases else ())
    if "layout" in cases:
        layouts(cfg, params, args)
    if "decode" not in cases:
        return
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, cfg.vocab_size, (args.batch, args.prompt_len)).tolist()

    runners: dict[str, Callable[[int], float]] = {}
    weight_bytes: dict[str, int] = {}
    kv_of: dict[str, KVPrecision] = {}  # engine row -> its cache's precision
    kv_precisions = [kv_precision(p) for p in args.kv_precisions.split(",") if p]

    def ours(name: str, params: Any, dot_general: Any) -> None:
        for p in kv_precisions:
            row = name if p is KVPrecision.BF16 else f"{name} kv {p.value}"
            runners[row] = sampler_timer(cfg, params, dot_general, prompts, args.new_tokens,
                                         args.max_concurrent_rows, p)
            weight_bytes[row], kv_of[row] = tree_bytes(params), p

    if "fp32" in engines:
        ours("ours fp32", params, jax.lax.dot_general)
    for name, recipe in _quantized_engines(engines):
        from qurl_jax.quant import make_dot_general, requantize

        ours(f"ours {name}", jax.block_until_ready(requantize(params, recipe)),
             make_dot_general(recipe))
    if "transformers" in engines:
        for threads in (int(t) for t in args.torch_threads.split(",")):
            runners[f"hf torch x{threads}"] = _transformers(cfg, params, prompts, threads)

    for run in runners.values():  # compile / warm up
        run(1)
        run(2)
    lengths = (1, args.new_tokens)
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in runners for n in lengths}
    for _ in range(args.rounds):
        for name, run in runners.items():
            for n in lengths:
                times[(name, n)].append(run(n))
    bandwidth = copy_bandwidth()

    # Bytes one decode step of ours reads: all weights, plus k and v of every layer. The CPU decode
    # attention kernel reads the slots written so far (prompt + tokens generated: on average
    # prompt + new / 2); XLA's attention reads the whole cache (prompt + generation slots).
    if decode_attention.usable(cfg.compute_dtype, cfg.head_dim):
        slots = args.prompt_len + args.new_tokens / 2
    else:
        slots = args.prompt_len + args.new_tokens
    # With --max-concurrent-rows our sampler runs the decode loop once per chunk of rows.
    rows = min(args.batch, args.max_concurrent_rows or args.batch)
    chunks = -(-args.batch // rows)
    kv_bytes = {row: int(cfg.num_layers * rows * slots * p.bytes_per_token(
        cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype)) for row, p in kv_of.items()}
    steps = args.new_tokens - 1
    decode_s = {name: min(times[(name, args.new_tokens)]) - min(times[(name, 1)])
                for name in runners}
    rates = {name: args.batch * steps / d for name, d in decode_s.items()}
    hf_rows = [name for name in rates if name.startswith("hf")]
    hf_best = max(rates[name] for name in hf_rows) if hf_rows else float("nan")

    print(f"model: {cfg.num_params / 1e6:.1f}M params (Qwen2-shaped, tied 32k vocab), batch "
          f"{args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, EOS disabled, "
          f"full-vocabulary sampling at temperature 1; best of {args.rounds} rounds"
          + (f"; ours in {chunks} chunks of {rows} rows" if chunks > 1 else ""))
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}, {os.cpu_count()} CPUs; load "
          f"average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after; numpy copy "
          f"{bandwidth / 1e9:.1f} GB/s (read + write)")
    print(f"{'engine':<20}{'prefill s':>10}{'decode s':>10}{'tok/s':>8}{'ms/step':>9}"
          f"{'GB/step':>9}{'GB/s':>7}{'vs best hf':>12}{'vs fp32':>9}")
    for name in runners:
        step_s = decode_s[name] / (steps * (chunks if name.startswith("ours") else 1))
        if name in weight_bytes:
            step_bytes = weight_bytes[name] + kv_bytes[name]
            traffic = f"{step_bytes / 1e9:>9.3f}{step_bytes / step_s / 1e9:>7.1f}"
        else:
            traffic = f"{'-':>9}{'-':>7}"
        vs_fp = rates[name] / rates["ours fp32"] if "ours fp32" in rates else float("nan")
        print(f"{name:<20}{min(times[(name, 1)]):>10.2f}{decode_s[name]:>10.2f}"
              f"{rates[name]:>8.0f}{step_s * 1e3:>9.1f}{traffic}{rates[name] / hf_best:>12.2f}"
              f"{vs_fp:>9.2f}")
    for name in ("ours fp32", "ours int8"):
        if name in rates and hf_rows:
            print(f"{name} / best transformers decode tokens/s: {rates[name] / hf_best:.2f}x "
                  f"(goal: fp32 >= 2x)")
    if "ours int8" in rates and "ours fp32" in rates:
        print(f"ours int8 / ours fp32 decode tokens/s: "
              f"{rates['ours int8'] / rates['ours fp32']:.2f}x (goal: >= 1.5x)")
    for row, p in kv_of.items():
        base = row.removesuffix(f" kv {p.value}")
        if p is not KVPrecision.BF16 and base in rates:
            print(f"{row} / {base} decode tokens/s: {rates[row] / rates[base]:.2f}x (the cache "
                  f"{kv_bytes[row] / kv_bytes[base]:.2f}x the bytes; goal at a 1,024-token "
                  f"context: >= 1.0x)")
    if "ours int8_vocab" in rates and "ours int8" in rates:
        print(f"ours int8_vocab / ours int8 decode tokens/s: "
              f"{rates['ours int8_vocab'] / rates['ours int8']:.2f}x (the int8 vocabulary "
              "tables: the actor "
              f"{weight_bytes['ours int8_vocab'] / weight_bytes['ours int8']:.2f}x the bytes; on "
              "CPU the decode loop reads the head as a compute-dtype copy, so GB/step over-"
              "states int8_vocab's reads)")


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    main()
