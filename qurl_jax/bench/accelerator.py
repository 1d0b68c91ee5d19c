"""Benchmark on one accelerator: quantized rollout speed, what the quantized products lower to, one
learner step, and real peak memory beside the compile-time figure.

Run on a GPU (or TPU) machine, one part or several in one process:

    python -m qurl_jax.bench.accelerator --parts=rollout,lowering \
        --models=DeepSeek-R1-Distill-Qwen-1.5B --batches=64,256 --json=out.json
    python -m qurl_jax.bench.accelerator --parts=learner --train_precisions=fp,fp8_block

Parts:
- `rollout`: decode tokens/s of the bf16, int8 (W8A8) and fp8 (E4M3 W8A8) actors on a random-weight
  model of a paper model's shape (`configs/shapes/<name>.json`), compute dtype bfloat16, B rows of
  `--prompt_len` random prompt tokens, `--new_tokens` new tokens with EOS disabled (every row runs
  to the limit). Decode time = time of the full call - time of a 1-token call (prefill and first
  token), each the fastest of `--rounds`; tokens/s = B * (new_tokens - 1) / difference. Each
  actor runs over each KV cache precision of `--kv_precisions` (bf16, int8, fp8: keys and values
  quantized as written, per-token scales) and each cache of `--page_sizes`: 0, a dense per-row
  cache (the static sampler, JAX's ragged Pallas kernel on GPU), or P > 0, a paged pool of
  P-token pages with a page for every token (the refilling sampler, JAX's paged kernels reading
  8-bit pages and their scales natively; a host call every page of steps, or every
  `--steps_per_call`). Beside it, the bytes one decode step reads on
  average: the actor's parameters once and the rows' live keys and values (prompt + half the
  new tokens, at the cache's precision, scales included; the kernels read live slots only), over
  the step time.
- `attention`: one layer's decode attention alone, at the model's heads and B rows whose live
  context is prompt + half the new tokens: the dense per-row cache through XLA's masked softmax
  and through JAX's ragged GPU kernel, and a paged pool of `--attention_page_size`-token pages (a
  shuffled page table, as a pool looks after refills) through JAX's paged kernel in each KV
  precision. Each is one jitted loop of `--attention_calls` dependent calls (the next query
  depends on the last output, so nothing is hoisted); time per call, fastest of `--rounds`, and
  live K/V bytes per call (scales included) over it. `--paged_tiles` adds the GPU paged kernel
  at other tilings than `decode_attention`'s choice (a sweep for the next default). It isolates
  the kernel from the sampler's loop (the refilling sampler's host round-trip every chunk of
  steps, its bookkeeping).
- `lowering`: the compiled decode program's matrix products, by custom-call target and operand
  element types: an int8 actor whose products run as `s8 x s8 -> s32` GEMMs (or f8e4m3fn for fp8)
  is native; a bf16 GEMM fed by converted codes is emulated.
- `learner`: one learner update of the 1.5B GRPO config (`configs/deepscaler_r1_1p5b_int8.py`) on
  one device: one minibatch of `--learner_rows` sequences of the config's full length, one
  sequence per micro-batch, remat and attention as the config sets them; steps/s and tokens/s per
  training precision, and per program the compiled memory analysis beside the device's measured
  peak (`memory_stats()['peak_bytes_in_use']`, which includes the state the step runs on).

Only figures measured in this run are printed; `--json` writes them all.

`--suite`: the device run that fits one lease (one GPU, `--budget_s`, default 420 s of the 8
minutes), written to `--json` after every case: `SUITE`'s rollouts (the 1.5B shape's bf16, int8 and
fp8 actors, bf16 and 8-bit KV, dense and paged caches, 64 and 256 rows, and the 7B shape at one
setting), each with the HBM bound of the bytes its step reads (`hbm_bound_ms`, at the chip's
bandwidth from `plan.kernels.CHIPS`) and the step model's prediction for it (`predicted_step_ms`,
from the committed deviceless readings `docs/targets/suite_readings.json`, `bench.explain`), then
`rl_step`: one whole RL step of the 1.5B GRPO config's shape on one device (rollout, log-probs,
update; random weights, random rewards) with the bf16 and the int8 rollout, A B B A, and one
layer's attention at 256 rows over bf16 and int8 pages at the paged kernel's tilings
`SUITE_TILES` (`attention`, `--paged_tiles`), and `products`: the fused W8A8 products of a GPU
decode step against XLA's, A B B A (`Engine.fused_products`). In priority
order; a case whose turn comes after the budget is listed under `skipped` with the reason. With
`--tiny` it is the CPU dry run (every field written; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import json
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import quant
from qurl_jax.bench.sampler import sampler_timer
from qurl_jax.config.base import load_config_file
from qurl_jax.config.settings import ModelSettings, RunSettings
from qurl_jax.models import cast_floats
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.hf import config_from_hf
from qurl_jax.models.params import init_params
from qurl_jax.plan.memory_plan import GIB, build_setup, compiled_memory, model_shape
from qurl_jax.runtime.sizes import tree_bytes
from qurl_jax.sampling import Sampler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    csv = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--parts", type=csv, default=["rollout", "lowering"],
                   help="rollout, lowering, learner")
    p.add_argument("--models", type=csv, default=["DeepSeek-R1-Distill-Qwen-1.5B"],
                   help="model shapes from configs/shapes/ (file names without .json)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in csv(s)], default=[64],
                   help="rollout rows")
    p.add_argument("--precisions", type=csv, default=["fp", "int8", "fp8"],
                   help="rollout actors of `rollout` and `lowering` (fp = bf16)")
    p.add_argument("--kv_precisions", type=csv, default=["bf16"],
                   help="KV cache precisions of `rollout` (bf16, int8, fp8)")
    p.add_argument("--page_sizes", type=lambda s: [int(x) for x in csv(s)], default=[0],
                   help="rollout caches: 0, a dense per-row cache; P > 0, a paged pool of P-token "
                        "pages")
    p.add_argument("--attention_page_size", type=int, default=16, help="pages of `attention`")
    p.add_argument("--steps_per_call", type=int, default=0,
                   help="paged rollout: most decode steps between two host calls (0: a page's)")
    p.add_argument("--attention_calls", type=int, default=200,
                   help="dependent calls per timed loop of `attention`")
    p.add_argument("--paged_tiles", type=csv, default=[],
                   help="`attention` on a GPU: also time the paged kernel at these tilings, "
                        "SPLITSxPAGES (k_splits x pages per compute block), e.g. 16x2,12x8,4x8")
    p.add_argument("--train_precisions", type=csv, default=["fp", "fp8_block"],
                   help="training precisions of `learner` (config.train.precision values)")
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=1024, help="EOS disabled")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds; the fastest counts")
    p.add_argument("--learner_config", default="configs/deepscaler_r1_1p5b_int8.py")
    p.add_argument("--learner_rows", type=int, default=2, help="sequences in the minibatch")
    p.add_argument("--tiny", action="store_true", help="shrink every model to 2 layers of width "
                   "256: a smoke test of this script on any machine; its figures mean nothing")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    p.add_argument("--suite", action="store_true",
                   help="the one-lease device suite (module docstring); overrides --parts")
    p.add_argument("--budget_s", type=float, default=420.0,
                   help="--suite: start no case after this many seconds")
    p.add_argument("--suite_only", type=lambda s: [int(x) for x in csv(s)], default=None,
                   help="--suite: only these entries of SUITE (0-based; the dry run's test)")
    p.add_argument("--rl_prompts", type=int, default=16, help="--suite: the RL step's prompts")
    p.add_argument("--rl_n", type=int, default=4, help="--suite: the RL step's samples a prompt")
    return p.parse_args(argv)


ARGS = argparse.Namespace()
SHAPES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes")


def _maybe_tiny(config: ModelConfig) -> ModelConfig:
    """`--tiny`: the same family shrunk to 2 layers of width 256."""
    if not ARGS.tiny:
        return config
    return config.replace(num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4,
                          num_kv_heads=2, head_dim=64, vocab_size=4096)


def model_config(name: str) -> ModelConfig:
    with open(os.path.join(SHAPES_DIR, name + ".json"), encoding="utf-8") as f:
        return _maybe_tiny(config_from_hf(json.load(f)).replace(dtype="bfloat16"))


def random_params(config: ModelConfig, dtype: Any) -> Any:
    """Random weights made on the device in `dtype` (no float32 copy of a 7B model)."""
    return jax.jit(lambda k: cast_floats(init_params(config, k), dtype))(jax.random.key(0))


def actor(config: ModelConfig, precision: str) -> tuple[Any, Any]:
    """(rollout parameters, dot_general) of a precision: 'fp' is the bf16 model itself. The bf16
    weights a quantized actor is made from are freed before it runs (a 7B model's bf16 copy beside
    its int8 copy and a batch-256 KV cache does not fit in 80 GB)."""
    params = random_params(config, config.compute_dtype)
    if precision == "fp":
        return params, jax.lax.dot_general
    recipe = quant.get_recipe(precision)
    quantized = jax.block_until_ready(quant.requantize(params, recipe, config.compute_dtype))
    jax.tree.map(lambda x: x.delete(), params)
    return quantized, quant.make_dot_general(recipe)


def rollout(config: ModelConfig, precision: str, batch: int, kv_precision: str, page_size: int
            ) -> dict[str, Any]:
    p_len, new = ARGS.prompt_len, ARGS.new_tokens
    t_actor = time.perf_counter()
    rollout_params, dot_general = actor(config, precision)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (batch, p_len)).tolist()
    t_setup = time.perf_counter()
    run = sampler_timer(config, rollout_params, dot_general, prompts, new,
                        kv_precision=kv_precision, page_size=page_size,
                        steps_per_call=ARGS.steps_per_call)
    t0 = time.perf_counter()
    run(1)
    run(new)  # compiles and warms both programs
    warmup = time.perf_counter() - t0
    full = min(run(new) for _ in range(ARGS.rounds))
    first = min(run(1) for _ in range(ARGS.rounds))
    timed = time.perf_counter() - t0 - warmup
    decode = full - first
    step = decode / (new - 1)
    weight_bytes = tree_bytes(rollout_params)
    # The buckets sampler_timer's sampler uses: exactly p_len + new slots per row.
    engine = Sampler(config, prompt_buckets=(p_len,), gen_buckets=(new,),
                     kv_precision=kv_precision).engine
    kv_bytes = batch * engine.kv_bytes_per_row(p_len, new)
    live_kv_bytes = kv_bytes * (p_len + new / 2) / (p_len + new)
    del rollout_params
    return {"precision": precision, "kv_precision": kv_precision, "page_size": page_size,
            "steps_per_call": ARGS.steps_per_call if page_size else 0,
            "batch": batch, "prompt_len": p_len, "new_tokens": new,
            "decode_tokens_per_s": batch * (new - 1) / decode, "decode_step_ms": step * 1e3,
            "prefill_and_first_token_s": first, "warmup_s": warmup,
            # Where a case's wall time goes (one H200 case took ~180 s, ~100 s of it unplaced):
            # random weights and their quantization, the sampler's construction, the timed runs.
            "actor_s": t_setup - t_actor, "sampler_setup_s": t0 - t_setup, "timed_s": timed,
            "actor_weight_gib": weight_bytes / GIB, "kv_cache_gib": kv_bytes / GIB,
            "bytes_read_per_step_gib": (weight_bytes + live_kv_bytes) / GIB,
            "achieved_gb_per_s": (weight_bytes + live_kv_bytes) / step / 1e9}


def _timed_loop(step: Any, q: jax.Array, operands: tuple) -> float:
    """Seconds per call of `step(q, *operands)` in one jitted loop of `--attention_calls`
    dependent calls (the next query is the last one moved by the output, so no call is
    loop-invariant), the fastest of `--rounds` after a warm-up."""
    calls = ARGS.attention_calls

    @jax.jit
    def loop(q, *ops):
        body = lambda _, x: (x + 1e-3 * step(x, *ops)).astype(x.dtype)  # noqa: E731
        return jax.lax.fori_loop(0, calls, body, q)

    jax.block_until_ready(loop(q, *operands))
    best = float("inf")
    for _ in range(max(ARGS.rounds, 1)):
        t0 = time.perf_counter()
        jax.block_until_ready(loop(q, *operands))
        best = min(best, time.perf_counter() - t0)
    return best / calls


@contextlib.contextmanager
def _paged_tiling(splits: int, per_block: int) -> Any:
    """`decode_attention`'s GPU paged kernel at this tiling (k_splits, pages per compute block)
    while the block runs: a benchmark's sweep, not a setting."""
    from qurl_jax.models import decode_attention as da

    saved = da.gpu_paged_splits, da.pages_per_compute_block
    da.gpu_paged_splits = lambda n: splits
    da.pages_per_compute_block = lambda n, partitions=1, largest=8: per_block
    try:
        yield
    finally:
        da.gpu_paged_splits, da.pages_per_compute_block = saved


def attention(config: ModelConfig, batch: int) -> list[dict[str, Any]]:
    """One layer's decode attention alone, dense and paged caches (the module docstring)."""
    from qurl_jax.models.decode_attention import decode_attention, paged_decode_attention
    from qurl_jax.models.kv_quant import kv_precision as kv_spec
    from qurl_jax.models.kv_quant import quantize_kv

    h, hkv, d = config.num_heads, config.num_kv_heads, config.head_dim
    dtype = config.compute_dtype
    slots = ARGS.prompt_len + ARGS.new_tokens
    page = ARGS.attention_page_size
    live = ARGS.prompt_len + ARGS.new_tokens // 2
    n_pages = -(-slots // page)
    keys = iter(jax.random.split(jax.random.key(2), 4))
    q = jax.random.normal(next(keys), (batch, h, d), dtype)
    lengths = jnp.full((batch,), live, jnp.int32)
    rows = []

    def record(cache: str, impl: str, kv: str, seconds: float) -> None:
        kv_bytes = batch * live * kv_spec(kv).bytes_per_token(hkv, d, dtype)  # K and V, scales
        rate = kv_bytes / seconds / 1e9
        rows.append({"batch": batch, "cache": cache, "impl": impl, "kv_precision": kv,
                     "live_slots": live, "slots": slots, "us_per_call": seconds * 1e6,
                     "live_kv_mib": kv_bytes / 2**20, "achieved_gb_per_s": rate})
        print(f"  attention {cache:5s} {impl:6s} kv {kv:4s} B={batch:4d}: "
              f"{seconds * 1e6:8.1f} us/call, {rate:6.0f} GB/s of live K/V", flush=True)

    k = jax.random.normal(next(keys), (batch, hkv, slots, d), dtype)
    v = jax.random.normal(next(keys), (batch, hkv, slots, d), dtype)
    for impl in ("xla", "pallas" if jax.default_backend() == "gpu" else "auto"):
        step = functools.partial(
            lambda x, k, v, lengths, impl: decode_attention(x, k, v, lengths, impl=impl), impl=impl)
        record("dense", impl, "bf16", _timed_loop(step, q, (k, v, lengths)))
    del k, v
    # A pool with a page for every slot of every row, handed out in a shuffled order.
    table = jax.random.permutation(next(keys), batch * n_pages).reshape(batch, n_pages)
    shape = (hkv, batch * n_pages, page, d)
    for kv in ARGS.kv_precisions:
        k_pages = jax.random.normal(jax.random.key(3), shape, dtype)
        v_pages = jax.random.normal(jax.random.key(4), shape, dtype)
        k_scales = v_scales = None
        if kv_spec(kv).quantizes:
            store = kv_spec(kv).storage_dtype(dtype)
            (k_pages, k_scales), (v_pages, v_scales) = (quantize_kv(k_pages, store),
                                                        quantize_kv(v_pages, store))
        step = lambda x, kp, vp, t, n, ks, vs: paged_decode_attention(  # noqa: E731
            x, kp, vp, t, n, k_scales=ks, v_scales=vs)
        operands = (k_pages, v_pages, table, lengths, k_scales, v_scales)
        record("paged", "auto", kv, _timed_loop(step, q, operands))
        for tile in ARGS.paged_tiles if jax.default_backend() == "gpu" else ():
            splits, per_block = (int(x) for x in tile.split("x"))
            if n_pages % splits or (n_pages // splits) % per_block:
                print(f"  attention paged {tile}: {n_pages} pages per row do not tile", flush=True)
                continue
            with _paged_tiling(splits, per_block):
                # `_timed_loop` jits a new loop each call: traced again at this tiling
                record("paged", f"pallas {tile}", kv, _timed_loop(step, q, operands))
        del k_pages, v_pages
    return rows


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*([\w]+)\[")
_CALL = re.compile(r"=\s*(\w+)\[[^=]*?\s(dot|custom-call)\(([^)]*)\)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def matmul_lowering(hlo: str) -> dict[str, int]:
    """Counts of a compiled program's matrix products as 'kind: operand types -> result type':
    kind is the custom-call target of a GEMM library call (cuBLAS(Lt), cuDNN) or 'dot' (a product
    XLA emits itself). Operand types are looked up from the instructions that define them."""
    types = {m.group(1): m.group(2) for m in map(_INSTRUCTION.match, hlo.splitlines()) if m}
    counts: collections.Counter[str] = collections.Counter()
    for line in hlo.splitlines():
        m = _CALL.search(line)
        if not m:
            continue
        kind = "dot"
        if m.group(2) == "custom-call":
            target = _TARGET.search(line)
            if not target or not re.search(r"gemm|matmul|conv", target.group(1), re.I):
                continue
            kind = target.group(1)
        operands = [types.get(o.strip().lstrip("%"), "?") for o in m.group(3).split(",")]
        counts[f"{kind}: {' x '.join(operands[:2])} -> {m.group(1)}"] += 1
    return dict(counts.most_common())


def lowering(config: ModelConfig, precision: str, batch: int) -> dict[str, Any]:
    p_len, new = ARGS.prompt_len, ARGS.new_tokens
    rollout_params, dot_general = actor(config, precision)
    sampler = Sampler(config, dot_general, prompt_buckets=(p_len,), gen_buckets=(new,))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), rollout_params)
    compiled = sampler.lower_programs(abstract, batch, p_len, new)["decode"].compile()
    return {"precision": precision, "batch": batch,
            "decode_matmuls": matmul_lowering(compiled.as_text()),
            "decode_memory": compiled_memory(compiled)}


def learner(precision: str) -> dict[str, Any]:
    config = load_config_file(ARGS.learner_config)
    rows = ARGS.learner_rows
    config.mesh.data = config.mesh.fsdp = config.mesh.tensor = 1
    config.data.prompts_per_step, config.rollout.n = rows, 1
    config.rl.num_minibatches, config.rl.num_micro_batches = 1, rows
    if precision != "fp":
        config.train.precision = precision
    shape = _maybe_tiny(model_shape(ModelSettings.from_config(config.model), SHAPES_DIR))
    if ARGS.tiny:
        config.data.max_prompt_len, config.rollout.max_new_tokens = 64, 192
    setup = build_setup(RunSettings.from_config(config), shape)
    t_len, g_len = setup.prompt_len + setup.response_len, setup.response_len
    rng = np.random.default_rng(0)
    batch = {"tokens": rng.integers(1, shape.vocab_size, (rows, t_len)).astype(np.int32),
             "positions": np.broadcast_to(np.arange(t_len, dtype=np.int32), (rows, t_len)),
             "attn_mask": np.ones((rows, t_len), bool),
             "resp_mask": np.ones((rows, g_len), np.float32),
             "logp_behav": np.full((rows, g_len), -2.0, np.float32),
             "logp_prox": np.full((rows, g_len), -2.0, np.float32),
             "advantages": rng.standard_normal(rows).astype(np.float32)}
    if config.rl.kl_coef:
        batch["logp_ref"] = np.full((rows, g_len), -2.0, np.float32)
    batch = setup.learner.shard_batch({k: jnp.asarray(v) for k, v in batch.items()})
    params = setup.learner.shard_params(
        jax.jit(lambda k: init_params(shape, k))(jax.random.key(0)))
    opt_state = setup.learner.init_opt_state(params)
    t0 = time.perf_counter()
    fn = setup.learner.update_fn(params, opt_state, batch)
    compiled = fn.lower(params, opt_state, batch, None).compile()
    compile_s = time.perf_counter() - t0
    analysis = compiled_memory(compiled)
    times = []
    for _ in range(1 + max(ARGS.rounds, 2)):
        t0 = time.perf_counter()
        params, opt_state, metrics = compiled(params, opt_state, batch, None)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t0)
    step = float(np.median(times[1:]))
    stats = jax.devices()[0].memory_stats() or {}
    return {"precision": precision, "rows": rows, "tokens_per_row": t_len,
            "remat": config.train.remat, "attention": shape.attention, "compile_s": compile_s,
            "step_s": step, "tokens_per_s": rows * t_len / step, "compiled": analysis,
            "device_peak_bytes_in_use": stats.get("peak_bytes_in_use"),
            "device_bytes_limit": stats.get("bytes_limit"),
            "loss": float(jax.device_get(metrics.get("loss", jnp.nan)))}


# --suite's rollouts in priority order: (model shape, actor, KV precision, page size, rows).
# Each case takes about 3 minutes of a lease (one H200, 2026-11-29), so what the device goals
# need and no lease has measured comes first; the three cases measured then come after.
ONE_5B, SEVEN_B = "DeepSeek-R1-Distill-Qwen-1.5B", "Qwen2.5-Math-7B"
SUITE = (
    (ONE_5B, "fp", "bf16", 16, 256),  # the bf16 actor at 256 rows ...
    (ONE_5B, "int8", "bf16", 16, 256),  # ... against int8
    "rl_step",  # one whole RL step, bf16 against int8 rollouts
    (ONE_5B, "int8", "int8", 16, 256),  # 8-bit KV against bf16 KV
    (ONE_5B, "int8", "bf16", 16, 64),  # the paged pool against the dense cache, equal lengths
    (ONE_5B, "int8", "bf16", 0, 64),  # the dense step against the HBM bound
    ("attention", ONE_5B, 256),  # one layer's attention: the paged kernel's tilings (below)
    ("products", ONE_5B, 64),  # the fused W8A8 products against XLA's, A B B A
    (ONE_5B, "fp8", "fp8", 16, 256),  # FP8 weights and FP8 KV (NVIDIA's FP8-RL setting)
    (ONE_5B, "fp", "bf16", 0, 64),  # the bf16 actor, dense
    (SEVEN_B, "int8", "bf16", 16, 64),  # the 7B shape at one setting
)
# The paged kernel's tilings the suite's attention case sweeps (k_splits x pages per compute
# block; 96 pages a row at 512 + 1024 tokens and 16-token pages): the step model puts most of a
# paged step at 256 rows in that kernel (docs/performance.md).
SUITE_TILES = ("16x2", "8x4", "4x8", "2x8", "1x8")
# The key of a reading of the fused products ('on'), after its rollout's name; a plain name is
# the default ('auto') program's reading, XLA's products since the H200 measured the fused
# kernels slower (docs/performance.md).
PRODUCTS_FUSED = "|fused_products"
SUITE_READINGS = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "targets",
                              "suite_readings.json")


def suite_case_name(model: str, precision: str, kv: str, page_size: int, rows: int) -> str:
    """A suite rollout's key in `SUITE_READINGS` and the JSON."""
    cache = f"paged{page_size}" if page_size else "dense"
    return f"{model}|{precision}|kv_{kv}|{cache}|{rows}"


def _chip(device: jax.Device) -> Any:
    """`plan.kernels.CHIPS`'s figures of this device (None: not a GPU the model knows)."""
    from qurl_jax.plan import kernels

    kind = device.device_kind.lower()
    return next((c for name, c in kernels.CHIPS.items() if name in kind), None)


def _predicted_step_ms(name: str, chip: Any, kv: str, page_size: int) -> float | None:
    """The step model's prediction of a suite rollout on `chip` from its committed deviceless
    reading (None without one: another shape, or --tiny)."""
    from qurl_jax.plan import kernels

    if chip is None or ARGS.tiny or not os.path.exists(SUITE_READINGS):
        return None
    with open(SUITE_READINGS, encoding="utf-8") as f:
        reading = json.load(f)["cases"].get(name)
    if reading is None or (reading["prompt_len"], reading["new_tokens"]) != (
            ARGS.prompt_len, ARGS.new_tokens):
        return None
    attention = ("paged_8bit" if kv != "bf16" else "paged") if page_size else "dense"
    step = kernels.predict_step(kernels.PerToken.from_json(reading), chip, attention,
                                refill=page_size > 0)
    return step["step"] * 1e3


def rl_step(precisions: tuple[str, ...] = ("fp", "int8")) -> dict[str, Any]:
    """One whole RL step of the 1.5B GRPO config's shape on one device, per rollout precision:
    requantize, the rollout (`--rl_prompts` x `--rl_n` rows of `--prompt_len` random tokens,
    `--new_tokens` new tokens each, EOS disabled, the config's refilling sampler and paged pool
    sized for these rows on one device), the
    log-prob recomputation (pi_prox, and pi_ref when the config's KL term is on; here the same
    weights) and one update on the whole batch, each phase timed to `block_until_ready`. The
    learner's programs are shared by the precisions; each precision's step is timed twice, A B
    B A, after a warm-up step that compiles."""
    from qurl_jax.models.transformer import positions_from_mask
    from qurl_jax.sampling import SamplingParams
    from qurl_jax.sampling.factory import build_rollout_sampler

    config = load_config_file(ARGS.learner_config)
    config.mesh.data = config.mesh.fsdp = config.mesh.tensor = 1
    prompts_n = ARGS.rl_prompts
    config.data.prompts_per_step, config.rollout.n = prompts_n, ARGS.rl_n
    config.rl.num_minibatches = 1
    config.data.max_prompt_len, config.rollout.max_new_tokens = ARGS.prompt_len, ARGS.new_tokens
    rows = prompts_n * ARGS.rl_n
    # The config's sampler (a paged pool with a page for every token a row may hold), for these
    # rows on one device.
    per_row = -(-(ARGS.prompt_len + ARGS.new_tokens) // config.rollout.kv_page_size)
    config.rollout.max_concurrent_rows, config.rollout.kv_pages = rows, rows * per_row
    if ARGS.tiny:  # micro-batches of one sequence, not the config's 9216-token rows
        config.train.tokens_per_micro_batch = ARGS.prompt_len + ARGS.new_tokens
    shape = _maybe_tiny(model_shape(ModelSettings.from_config(config.model), SHAPES_DIR))
    setup = build_setup(RunSettings.from_config(config), shape)
    learner_ = setup.learner
    params = learner_.shard_params(jax.jit(lambda k: init_params(shape, k))(jax.random.key(0)))
    opt_state = learner_.init_opt_state(params)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, shape.vocab_size, (prompts_n, ARGS.prompt_len)).tolist()
    settings = SamplingParams(max_new_tokens=ARGS.new_tokens, temperature=1.0)
    samplers = {}
    for precision in precisions:
        recipe = quant.get_recipe(precision)
        sampler_settings = RunSettings.from_config(config).rollout.sampler
        samplers[precision] = (recipe, build_rollout_sampler(
            shape, quant.make_dot_general(recipe), sampler_settings,
            prompt_buckets=(ARGS.prompt_len,), gen_buckets=(ARGS.new_tokens,)))

    def step(precision: str, state: tuple) -> tuple[tuple, dict[str, float]]:
        params, opt_state = state
        recipe, sampler = samplers[precision]
        times: dict[str, float] = {}
        t = time.perf_counter()
        actor = jax.block_until_ready(quant.requantize(params, recipe, shape.compute_dtype))
        times["requantize_s"], t = time.perf_counter() - t, time.perf_counter()
        out = sampler.sample(actor, prompts, settings, key=jax.random.key(1), n=ARGS.rl_n)
        jax.block_until_ready(out.tokens)
        times["rollout_s"], t = time.perf_counter() - t, time.perf_counter()
        del actor
        tokens, mask, _ = out.sequences()
        batch = {"tokens": tokens, "positions": positions_from_mask(mask), "attn_mask": mask,
                 "resp_mask": out.mask.astype(jnp.float32), "logp_behav": out.logp}
        batch = learner_.shard_batch(batch)
        batch["logp_prox"] = learner_.logprobs(params, batch)
        if config.rl.kl_coef:
            batch["logp_ref"] = learner_.logprobs(params, batch)
        jax.block_until_ready(batch)
        times["logprobs_s"], t = time.perf_counter() - t, time.perf_counter()
        batch["advantages"] = learner_.shard_batch(
            {"advantages": jnp.asarray(rng.standard_normal(rows), jnp.float32)})["advantages"]
        params, opt_state, metrics = learner_.update(params, opt_state, batch)
        jax.block_until_ready(metrics)
        times["update_s"] = time.perf_counter() - t
        times["step_s"] = sum(times.values())
        times["generated_tokens"] = float(jnp.sum(out.lengths))
        return (params, opt_state), times

    state = (params, opt_state)
    t0 = time.perf_counter()
    for precision in precisions:  # compiles every program
        state, _ = step(precision, state)
    warmup = time.perf_counter() - t0
    timed: dict[str, list[dict[str, float]]] = {p: [] for p in precisions}
    for precision in (*precisions, *precisions[::-1]):
        state, times = step(precision, state)
        timed[precision].append(times)
    out: dict[str, Any] = {"rows": rows, "prompt_len": ARGS.prompt_len,
                           "new_tokens": ARGS.new_tokens, "warmup_s": warmup,
                           "train_precision": config.train.precision, "remat": config.train.remat,
                           "kl": bool(config.rl.kl_coef), "order": "A B B A"}
    for precision, runs in timed.items():
        out[precision] = {k: float(np.mean([r[k] for r in runs])) for k in runs[0]}
    first, last = precisions[0], precisions[-1]
    out["step_speedup"] = out[first]["step_s"] / out[last]["step_s"]
    out["rollout_speedup"] = out[first]["rollout_s"] / out[last]["rollout_s"]
    return out


def products(model: str, rows: int, chip: Any) -> dict[str, Any]:
    """The fused W8A8 products of a GPU decode step (`Engine.fused_products` 'on', one Pallas
    launch per product) against XLA's ('off'), the int8 actor's dense rollout of `rows` rows:
    both samplers compiled and warmed, their full calls timed A B B A, each less its fastest
    1-token call; beside each, the step model's prediction (`PRODUCTS_FUSED` names the fused
    program's reading). On a CPU both run XLA's products (the dry run)."""
    config = model_config(model)
    p_len, new = ARGS.prompt_len, ARGS.new_tokens
    params, dot_general = actor(config, "int8")
    prompts = np.random.default_rng(0).integers(1, config.vocab_size, (rows, p_len)).tolist()
    runs = {c: sampler_timer(config, params, dot_general, prompts, new, fused_products=c)
            for c in ("on", "off")}
    for run in runs.values():
        run(1)
        run(new)
    first = {c: min(run(1) for _ in range(ARGS.rounds)) for c, run in runs.items()}
    full: dict[str, list[float]] = {c: [] for c in runs}
    for c in ("on", "off", "off", "on"):
        full[c].append(runs[c](new))
    step = {c: (min(full[c]) - first[c]) / (new - 1) * 1e3 for c in runs}
    name = suite_case_name(model, "int8", "bf16", 0, rows)
    predicted = {c: _predicted_step_ms(n, chip, "bf16", 0)
                 for c, n in (("on", name + PRODUCTS_FUSED), ("off", name))}
    return {"model": model, "rows": rows, "prompt_len": p_len, "new_tokens": new,
            "order": "A B B A", "fused_step_ms": step["on"], "xla_step_ms": step["off"],
            "fused_speedup": step["off"] / step["on"],
            "fused_predicted_ms": predicted["on"], "xla_predicted_ms": predicted["off"]}


def suite(out: dict[str, Any], save: Any) -> None:
    """--suite (module docstring): `SUITE` in order within `--budget_s`, `out` saved after every
    case."""
    start = time.perf_counter()
    device = jax.devices()[0]
    chip = _chip(device)
    out.update({"suite": True, "budget_s": ARGS.budget_s, "rl_step": None, "products": None,
                "skipped": [], "chip": chip.name if chip else None,
                "chip_bandwidth_gb_per_s": chip.bandwidth / 1e9 if chip else None})
    cases = SUITE if ARGS.suite_only is None else [SUITE[i] for i in ARGS.suite_only]
    for case in cases:
        name = case if isinstance(case, str) else (
            f"{case[0]}|{case[1]}|{case[2]}" if case[0] in ("attention", "products")
            else suite_case_name(*case))
        elapsed = time.perf_counter() - start
        if elapsed > ARGS.budget_s:
            out["skipped"].append({"case": name, "reason": f"budget: {elapsed:.0f} s spent"})
            save()
            continue
        try:
            if case[0] == "attention":
                ARGS.kv_precisions, ARGS.paged_tiles = ["bf16", "int8"], list(SUITE_TILES)
                out["attention"] += [{"model": case[1], **r}
                                     for r in attention(model_config(case[1]), case[2])]
            elif case[0] == "products":
                out["products"] = products(case[1], case[2], chip)
                r = out["products"]
                print(f"  products: fused {r['fused_step_ms']:.2f} ms a step, XLA's "
                      f"{r['xla_step_ms']:.2f} ms: x{r['fused_speedup']:.2f}", flush=True)
            elif case == "rl_step":
                out["rl_step"] = rl_step()
                r = out["rl_step"]
                print(f"  rl_step: bf16 rollout {r['fp']['step_s']:.2f} s/step (rollout "
                      f"{r['fp']['rollout_s']:.2f} s), int8 {r['int8']['step_s']:.2f} s "
                      f"({r['int8']['rollout_s']:.2f} s): step x{r['step_speedup']:.2f}, "
                      f"rollout x{r['rollout_speedup']:.2f}", flush=True)
            else:
                model, precision, kv, page_size, rows = case
                row = {"model": model, "case": name, **rollout(model_config(model), precision,
                                                                rows, kv, page_size)}
                step_ms = row["decode_step_ms"]
                bound = (row["bytes_read_per_step_gib"] * GIB / chip.bandwidth * 1e3
                         if chip else None)
                predicted = _predicted_step_ms(name, chip, kv, page_size)
                row.update({"hbm_bound_ms": bound,
                            "fraction_of_hbm_bound": bound / step_ms if bound else None,
                            "achieved_fraction_of_bandwidth": (
                                row["achieved_gb_per_s"] * 1e9 / chip.bandwidth if chip else None),
                            "predicted_step_ms": predicted,
                            "measured_over_predicted": step_ms / predicted if predicted else None})
                out["rollout"].append(row)
                print(f"  {name}: {row['decode_tokens_per_s']:9.0f} tok/s, step {step_ms:.2f} ms"
                      + (f" ({bound / step_ms:.0%} of the HBM bound)" if bound else "")
                      + (f", predicted {predicted:.2f} ms" if predicted else ""), flush=True)
        except Exception as e:  # one case's failure must not lose the others: recorded
            out["skipped"].append({"case": name, "reason": f"{type(e).__name__}: {e}"[:500]})
            print(f"  {name}: FAILED {type(e).__name__}: {e}", flush=True)
        save()
    out["suite_s"] = time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ARGS.__dict__.update(vars(parse_args(argv)))
    device = jax.devices()[0]
    out: dict[str, Any] = {"device": device.device_kind, "platform": device.platform,
                           "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
                           "rollout": [], "attention": [], "lowering": [], "learner": []}
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
    parts = set() if ARGS.suite else set(ARGS.parts)

    def save() -> None:  # after every row, so a run stopped at its time limit keeps its figures
        if ARGS.json:
            with open(ARGS.json, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
    if ARGS.suite:
        suite(out, save)
    for name in ARGS.models if parts & {"rollout", "attention", "lowering"} else ():
        config = model_config(name)
        print(f"\n{name}: {config.num_params / 1e9:.2f}B params", flush=True)
        for batch in ARGS.batches:
            if "attention" in parts:
                out["attention"] += [{"model": name, **r} for r in attention(config, batch)]
                save()
            for precision in ARGS.precisions if parts & {"rollout", "lowering"} else ():
                for kv, page in itertools.product(
                        ARGS.kv_precisions if "rollout" in parts else (), ARGS.page_sizes):
                    row = {"model": name, **rollout(config, precision, batch, kv, page)}
                    out["rollout"].append(row)
                    save()
                    print(f"  rollout {precision:5s} kv {kv:4s} pages {page:3d} B={batch:4d}: "
                          f"{row['decode_tokens_per_s']:9.0f} tok/s, step "
                          f"{row['decode_step_ms']:.2f} ms, reads "
                          f"{row['bytes_read_per_step_gib']:.1f} GiB/step = "
                          f"{row['achieved_gb_per_s']:.0f} GB/s", flush=True)
                if "lowering" in parts and batch == ARGS.batches[0]:
                    row = {"model": name, **lowering(config, precision, batch)}
                    out["lowering"].append(row)
                    save()
                    print(f"  decode matmuls {precision}: {row['decode_matmuls']}", flush=True)
    for precision in ARGS.train_precisions if "learner" in parts else ():
        row = learner(precision)
        out["learner"].append(row)
        save()
        print(f"learner {precision}: {row['step_s']:.3f} s/step, {row['tokens_per_s']:.0f} tok/s, "
              f"compiled peak {row['compiled']['peak_bytes'] / GIB:.2f} GiB, device peak "
              f"{(row['device_peak_bytes_in_use'] or 0) / GIB:.2f} GiB", flush=True)
    rows = out["rollout"]
    # Each row against the one that differs from it only in the actor (bf16), only in the KV
    # cache's precision (bf16) or only in the cache's layout (dense).
    bases = {"vs_bf16": ("precision", "fp"), "vs_bf16_kv": ("kv_precision", "bf16"),
             "vs_dense": ("page_size", 0)}
    fields = ("model", "batch", "precision", "kv_precision", "page_size")
    for field, (varied, base) in bases.items():
        table = {tuple(r[f] for f in fields if f != varied): r["decode_tokens_per_s"]
                 for r in rows if r[varied] == base}
        for r in rows:  # None where this run has no such row
            key = tuple(r[f] for f in fields if f != varied)
            r[field] = r["decode_tokens_per_s"] / table[key] if key in table else None
    if rows:
        print("\nmodel | batch | actor | KV | pages | decode tok/s | x bf16 actor | x bf16 KV "
              "| x dense | step ms | GB/s")
        for r in rows:
            ratios = " | ".join(f"{r[f]:.2f}" if r[f] is not None else "-" for f in bases)
            print(f"{r['model']} | {r['batch']} | {r['precision']} | {r['kv_precision']} | "
                  f"{r['page_size']} | {r['decode_tokens_per_s']:.0f} | {ratios} | "
                  f"{r['decode_step_ms']:.2f} | {r['achieved_gb_per_s']:.0f}")
    save()


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    main()
