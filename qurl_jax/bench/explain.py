"""`python -m qurl_jax.bench.explain`: why a decode step is slow on a GPU, read from the compiled
program, before renting one (the reader: `qurl_jax.plan.kernels`).

    # a run's rollout decode, compiled for its slice
    python -m qurl_jax.bench.explain --config=configs/deepscaler_r1_1p5b_int8.py \
        --target=gpu:h100-8
    # the benchmark's programs (bench.accelerator's rollout): a paper shape on one GPU
    python -m qurl_jax.bench.explain --model=DeepSeek-R1-Distill-Qwen-1.5B --actor=int8 \
        --rows=64 --page_size=0 --target=gpu:h100-1 --chip=h200

Compiles the decode program with XLA's dump on for that program only (needs the target's
compiler, `pip install -e .[gpu-compile]`; no GPU) and prints, per generated token: the launches
of the decode step, of the loop around it and of each call (`plan.kernels` for what counts), the
bytes they read and write, by category and per layer, the host reads of loop predicates and other
host transfers, the weights widened or transposed into new HBM copies, and the predicted step
(`plan.kernels.predict_step` on `--chip`: the chip's bandwidth, a launch cost and host costs
calibrated on the leased runs; a prediction, not a measurement). `--json` writes the figures.
A bad flag ends with one line naming it.

What is compiled:
- `--config`: the config's `rollout_decode` program (`plan.memory_plan`), on the config's mesh
  over the target's devices, at its largest shapes; tokens per call: a page with a paged pool
  (the refilling sampler's steps per call), else the generation (at most: a refilling call
  also returns when enough slots finish); the attention kernels read the live share of the KV
  cache of rows whose responses follow `plan.roofline.length_pmf` (the refilling steady state).
- `--model`: `bench.accelerator`'s rollout programs: a paper shape (`configs/shapes/`) with random
  weights, bf16 compute, `--rows` rows of `--prompt_len` tokens and `--new_tokens` new tokens
  (every row to the limit), the static sampler's dense cache (`--page_size=0`) or the refilling
  sampler's paged pool (a page for every token; `--steps_per_call`), on one device of the target.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import jax

from qurl_jax.bench.interconnect import set_field
from qurl_jax.config.base import load_config_file
from qurl_jax.config.settings import RunSettings
from qurl_jax.models.config import ModelConfig
from qurl_jax.parallel import sharding as shd
from qurl_jax.parallel import targets
from qurl_jax.plan import kernels, memory_plan, roofline
from qurl_jax.sampling import RefillSampler, Sampler

SHAPES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes")
ACTORS = ("bf16", "int8", "fp8")


def shape_config(name: str, tiny: bool = False) -> ModelConfig:
    """A paper shape in bf16 (`--tiny`: shrunk to 2 layers of width 256, as bench.accelerator's
    --tiny)."""
    config = roofline.model_config(name) if not tiny else roofline.model_config(name).replace(
        num_layers=2, hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2,
        head_dim=64, vocab_size=4096)
    return config


def model_program(config: ModelConfig, target: targets.Target, actor: str, rows: int,
                  prompt_len: int, new_tokens: int, kv_precision: str = "bf16",
                  page_size: int = 0, steps_per_call: int = 0, **engine: Any
                  ) -> tuple[Any, int, float]:
    """(lowered decode program, tokens per call, live fraction of the KV cache) of
    bench.accelerator's rollout at these settings, on one device of `target`."""
    mesh = shd.make_mesh(1, 1, 1, devices=target.devices()[:1])
    params, dot_general = roofline.abstract_actor(config, actor)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          params)
    common = dict(prompt_buckets=(prompt_len,), gen_buckets=(new_tokens,), mesh=mesh,
                  kv_precision=kv_precision, **engine)
    if page_size:
        pages = rows * -(-(prompt_len + new_tokens) // page_size)
        sampler: Any = RefillSampler(config, dot_general, kv_pages=pages, kv_page_size=page_size,
                                     kv_watermark_pages=0, max_steps_per_call=steps_per_call,
                                     **common)
        per_call = steps_per_call or page_size
    else:
        sampler = Sampler(config, dot_general, **common)
        per_call = new_tokens
    lowered = sampler.lower_programs(params, rows, prompt_len, new_tokens)["decode"]
    live = roofline.live_slots(prompt_len, new_tokens, "equal") / (prompt_len + new_tokens)
    return lowered, per_call, live


def config_program(config: Any, shapes_dir: str, target: targets.Target
                   ) -> tuple[Any, int, float, int, bool, bool, bool]:
    """(lowered rollout_decode program, tokens per call, live fraction, layers, paged pool,
    refilling sampler, 8-bit KV) of a config on `target`."""
    settings = RunSettings.from_config(config)
    model = memory_plan.model_shape(settings.model, shapes_dir)
    setup = memory_plan.build_setup(settings, model, target.devices())
    lowered = memory_plan.PROGRAMS["rollout_decode"](setup).lowered
    sampler = settings.rollout.sampler
    # The refilling sampler's default steps per call: a page with a paged pool (`RefillSampler`).
    per_call = sampler.kv_page_size if sampler.refills and sampler.kv_pages else \
        setup.response_len
    slots = setup.prompt_len + setup.response_len
    live = roofline.live_slots(setup.prompt_len, setup.response_len) / slots
    return (lowered, per_call, live, model.num_layers, bool(sampler.refills and sampler.kv_pages),
            sampler.refills, sampler.kv_precision.quantizes)


def _option_value(text: str) -> Any:
    """An XLA option's value as compiler_options wants it: a bool, an int, or the text."""
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    try:
        return int(text)
    except ValueError:
        return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a config file: explain its rollout decode on --target")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field (repeatable)")
    p.add_argument("--shapes_dir", help="model config.json files; default: shapes/ beside "
                                        "--config")
    p.add_argument("--model", help="a configs/shapes name: explain bench.accelerator's rollout")
    p.add_argument("--tiny", action="store_true", help="--model shrunk to 2 layers of width 256")
    p.add_argument("--actor", default="int8", choices=ACTORS)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt_len", type=int, default=512)
    p.add_argument("--new_tokens", type=int, default=1024)
    p.add_argument("--kv", default="bf16", help="KV cache precision: bf16, int8, fp8")
    p.add_argument("--page_size", type=int, default=0, help="0: dense cache; P: paged pool")
    p.add_argument("--steps_per_call", type=int, default=0, help="paged: steps per host call")
    p.add_argument("--decode_chunk", type=int, default=0,
                   help="--model: decode steps per loop iteration (0: the engine's default)")
    p.add_argument("--command_buffer", default=None,
                   help="--model: xla_gpu_enable_command_buffer of the decode program (default: "
                        "the engine's; '' for XLA's default)")
    p.add_argument("--fused_products", default="auto", choices=("auto", "on", "off"),
                   help="--model: the decode step's W8A8 products, one Pallas launch each "
                        "('on'), XLA's ('off') or the engine's default ('auto'; "
                        "Engine.fused_products)")
    p.add_argument("--xla", action="append", default=[], metavar="OPTION=VALUE",
                   help="an XLA option for this compile only, e.g. --xla "
                        "xla_gpu_graph_min_graph_size=1 (repeatable; experiments)")
    p.add_argument("--target", default="gpu:h100-1", help="gpu:h100-N")
    p.add_argument("--chip", default="h100", choices=sorted(kernels.CHIPS),
                   help="the step model's chip")
    p.add_argument("--dump_dir", help="keep XLA's dump here (default: a scratch directory)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--suite_readings", metavar="PATH",
                   help="instead: read every rollout of bench.accelerator --suite (gpu:h100-1) "
                        "and write their tables here (docs/targets/suite_readings.json)")
    return p.parse_args(argv)


def explain(args: argparse.Namespace) -> dict[str, Any]:
    """Compiles and reads the program `args` name; returns the JSON-able figures (and prints)."""
    target = targets.parse(args.target)
    if target.platform != "gpu":
        raise targets.TargetError(f"target {args.target!r}: the explain tool reads GPU programs "
                                  "(gpu:h100-N)")
    if args.config:
        config = load_config_file(args.config)
        for item in args.set:
            set_field(config, item)
        shapes_dir = args.shapes_dir or os.path.join(
            os.path.dirname(os.path.abspath(args.config)), "shapes")
        lowered, per_call, live, layers, paged, refill, kv_8bit = config_program(
            config, shapes_dir, target)
        what = {"config": args.config, "set": args.set}
    else:
        model = shape_config(args.model, args.tiny)
        lowered, per_call, live = model_program(
            model, target, args.actor, args.rows, args.prompt_len, args.new_tokens, args.kv,
            args.page_size, args.steps_per_call, decode_chunk=args.decode_chunk,
            command_buffer=args.command_buffer, fused_products=args.fused_products)
        layers, paged, kv_8bit = model.num_layers, args.page_size > 0, args.kv != "bf16"
        refill = paged
        what = {"model": args.model, "tiny": args.tiny, "actor": args.actor, "rows": args.rows,
                "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "kv": args.kv,
                "page_size": args.page_size, "fused_products": args.fused_products}
    options = {k: _option_value(v) for k, _, v in (item.partition("=") for item in args.xla)}
    reading = kernels.compile_and_read(lowered, options, keep=args.dump_dir)
    table = kernels.per_token(reading, per_call, live)
    chip = kernels.CHIPS[args.chip]
    attention = ("paged_8bit" if kv_8bit else "paged") if paged else "dense"
    step = kernels.predict_step(table, chip, attention, refill=refill)
    print(f"{target.name}: {', '.join(f'{k}={v}' for k, v in what.items() if v)}")
    print("\n".join(kernels.describe(reading, table, layers)))
    print(f"  predicted step on {chip.name} (a prediction; plan/kernels.py): "
          f"{step['step'] * 1e3:.2f} ms = bytes {step['bytes'] * 1e3:.2f} + attention "
          f"{step['attention'] * 1e3:.2f} + launches {step['launches'] * 1e3:.2f} + host "
          f"{step['host'] * 1e3:.2f}")
    return {**what, "target": target.name, "chip": chip.name, "live_fraction": live,
            **kernels.to_json(reading, table, layers), "attention": attention, "refill": refill,
            "predicted_step_s": step, "jax": jax.__version__}


def suite_readings(path: str, target_name: str = "gpu:h100-1") -> None:
    """Reads every rollout of `bench.accelerator`'s device suite (`accelerator.SUITE`, and the
    products case's rollout with the fused products) compiled for `target_name` and writes their
    per-token tables to `path` (after each case), which the suite turns into its predictions on
    the chip it runs on."""
    from qurl_jax.bench import accelerator

    target = targets.parse(target_name)
    out: dict[str, Any] = {"target": target.name, "jax": jax.__version__, "cases": {}}
    cases = [c for c in accelerator.SUITE if isinstance(c, tuple)]
    rollouts = [(c, "auto", "") for c in cases if len(c) == 5] + [
        ((c[1], "int8", "bf16", 0, c[2]), "on", accelerator.PRODUCTS_FUSED)
        for c in cases if c[0] == "products"]
    for case, fused, suffix in rollouts:
        model, actor, kv, page_size, rows = case
        config = shape_config(model)
        lowered, per_call, live = model_program(
            config, target, {"fp": "bf16"}.get(actor, actor), rows, 512, 1024, kv, page_size,
            fused_products=fused)
        reading = kernels.compile_and_read(lowered)
        table = kernels.per_token(reading, per_call, live)
        name = accelerator.suite_case_name(*case) + suffix
        out["cases"][name] = {
            "prompt_len": 512, "new_tokens": 1024, "page_size": page_size,
            "live_fraction": live, **kernels.to_json(reading, table, config.num_layers)}
        print(f"{name}: {table.launches:.0f} launches, {table.bytes / 2**30:.2f} GiB a token",
              flush=True)
        with open(path, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    targets.use_cpu_unless_accelerator_attached()
    if args.suite_readings:
        suite_readings(args.suite_readings)
        return
    if bool(args.config) == bool(args.model):
        sys.exit("qurl_jax: bad flag: give one of --config and --model")
    try:
        out = explain(args)
    except (targets.TargetError, memory_plan.PlanError, shd.MeshError, kernels.DumpError,
            KeyError, ValueError, OSError) as e:
        sys.exit(f"qurl_jax: {e}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
