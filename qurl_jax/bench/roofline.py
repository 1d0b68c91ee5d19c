"""Roofline predictions of decode speed for a chip we do not have, from its compiled decode program.

    python -m qurl_jax.bench.roofline --target=gpu:h100-1 --json=h100_roofline.json
    python -m qurl_jax.bench.roofline --target=tpu:v5p-8 --json=v5p_roofline.json
    python -m qurl_jax.bench.roofline --table h100_roofline.json v5p_roofline.json

For each (model shape, batch, actor) of `CASES` (bf16, int8 W8A8 and fp8 E4M3 W8A8 actors of the
paper models' shapes, `configs/shapes/*.json`, compute dtype bfloat16, a 512-token prompt bucket and
1024 new tokens, as the H100 measurement in the README ran them), the sampler's decode program is
built (`Sampler.lower_programs`, the program `sample` runs) on one device of the target and
compiled by the target's compiler. One decode step must at least read every weight once and, with
XLA's attention, every slot of the KV cache; so

    bytes per step >= the compiled decode program's argument bytes (weights, cache, sampling state;
                      `memory_analysis().argument_size_in_bytes`, a lower bound), and
    flops per step  = 2 x batch x (matrix parameters) + 4 x batch x layers x heads x head_dim x
                      cache slots (attention), counted from the shapes;

    predicted step = max(bytes / peak bandwidth, flops / peak matrix rate of the actor's format),
    predicted decode tokens/s = batch / predicted step.

TPU compilers also give `cost_analysis()` (flops and bytes accessed of the program; XLA counts a
loop's body once), recorded beside it. A compile-only GPU gives no cost analysis; its bytes are
the argument-bytes lower bound above. These are predictions from public peak figures (`CHIPS`),
not measurements; a real step also pays kernel launch gaps, the activation quantization and
attention's softmax.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import quant, targets
from qurl_jax import sharding as shd
from qurl_jax.models import cast_floats, init_params
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.hf import config_from_hf
from qurl_jax.sampling import Sampler

SHAPES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes")
PROMPT_LEN, NEW_TOKENS = 512, 1024
ACTORS = ("bf16", "int8", "fp8")
# (model shape, decode batch): the README's H100 measurement shapes and the 7B batch of the goal.
CASES = (("DeepSeek-R1-Distill-Qwen-1.5B", 64), ("DeepSeek-R1-Distill-Qwen-1.5B", 256),
         ("Qwen2.5-Math-7B", 256))

# Public peak figures per chip: HBM bandwidth (bytes/s) and dense matrix rate (ops/s) per format.
#  H100 SXM: NVIDIA H100 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h100): 3.35 TB/s
#    HBM3; 989 TFLOP/s BF16, 1,979 TFLOP/s FP8, 1,979 TOPS INT8 (dense; the datasheet's larger
#    figures are with 2:4 sparsity).
#  TPU v5p: cloud.google.com/tpu/docs/v5p: 2,765 GB/s HBM2e; 459 TFLOP/s BF16, 918 TOPS INT8.
#    v5p has no FP8 matrix unit: libtpu widens e4m3 codes and runs f32 MXU passes
#    (`bench.native_products`); its FP8 rate is taken as the BF16 rate, an optimistic bound.
CHIPS: dict[str, dict[str, float]] = {
    "h100": {"bandwidth": 3.35e12, "bf16": 989e12, "int8": 1979e12, "fp8": 1979e12},
    "v5p": {"bandwidth": 2.765e12, "bf16": 459e12, "int8": 918e12, "fp8": 459e12},
}
MEASURED = {  # README, one H100 SXM, decode tokens/s (1.5B x 64): the only measurement there is
    ("gpu", "DeepSeek-R1-Distill-Qwen-1.5B", 64, "bf16"): 19365.0,
    ("gpu", "DeepSeek-R1-Distill-Qwen-1.5B", 64, "int8"): 20533.0,
    ("gpu", "Qwen2.5-Math-7B", 256, "bf16"): 15384.0,
}


def model_config(name: str) -> ModelConfig:
    with open(os.path.join(SHAPES_DIR, name + ".json"), encoding="utf-8") as f:
        return config_from_hf(json.load(f)).replace(dtype="bfloat16")


def abstract_actor(config: ModelConfig, actor: str) -> tuple[Any, Any]:
    """(abstract rollout parameters, dot_general) of a bf16 / int8 / fp8 actor, nothing made."""
    params = jax.eval_shape(lambda: cast_floats(init_params(config, jax.random.key(0)),
                                                config.compute_dtype))
    if actor == "bf16":
        return params, jax.lax.dot_general
    recipe = quant.get_recipe(actor)
    return (jax.eval_shape(lambda p: quant.requantize(p, recipe, config.compute_dtype), params),
            quant.make_dot_general(recipe))


def _bytes(tree: Any) -> int:
    return sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def step_flops(config: ModelConfig, batch: int, cache_slots: int) -> float:
    """Matrix flops of one decode step: every linear layer and the LM head once per row, and
    attention (scores and the weighted sum) over all cache slots."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    matrix_params = c.num_layers * per_layer + c.hidden_size * c.vocab_size
    attention = 4 * c.num_layers * c.num_heads * c.head_dim * cache_slots
    return float(batch * (2 * matrix_params + attention))


def predict(target: targets.Target, model: str, batch: int, actor: str,
            config: ModelConfig | None = None) -> dict[str, Any]:
    """Compiles the decode program of one case for one device of `target` and predicts its step.

    model: a `configs/shapes` name, whose shape is used unless `config` is given (then `model` is
    only its label)."""
    config = config or model_config(model)
    device = target.devices()[0]
    mesh = shd.make_mesh(1, 1, 1, devices=[device])
    params, dot_general = abstract_actor(config, actor)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
                          params)
    sampler = Sampler(config, dot_general, prompt_buckets=(PROMPT_LEN,),
                      gen_buckets=(NEW_TOKENS,), mesh=mesh)
    t0 = time.perf_counter()
    compiled = sampler.lower_programs(params, batch, PROMPT_LEN, NEW_TOKENS)["decode"].compile()
    compile_s = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    arg_bytes = int(mem.argument_size_in_bytes)
    slots = sampler.engine.cache_slots(PROMPT_LEN, NEW_TOKENS)
    flops = step_flops(config, batch, slots)
    chip = CHIPS[target.chip.name]
    t_mem, t_flops = arg_bytes / chip["bandwidth"], flops / chip[actor]
    step = max(t_mem, t_flops)
    record = {
        "target": target.name, "device_kind": device.device_kind, "model": model,
        "batch": batch, "actor": actor, "compile_s": round(compile_s, 1),
        "weight_bytes": _bytes(params), "kv_cache_bytes": batch * sampler.engine.kv_bytes_per_row(
            PROMPT_LEN, NEW_TOKENS),
        "argument_bytes": arg_bytes, "flops_per_step": flops,
        "predicted_step_ms": step * 1e3, "bound": "memory" if t_mem >= t_flops else "compute",
        "predicted_tokens_per_s": batch / step,
        "measured_tokens_per_s": MEASURED.get((target.platform, model, batch, actor)),
    }
    cost = compiled.cost_analysis()
    if cost:
        cost = cost[0] if isinstance(cost, list) else cost
        record["cost_analysis_flops"] = float(cost.get("flops", np.nan))
        record["cost_analysis_bytes_accessed"] = float(cost.get("bytes accessed", np.nan))
    return record


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Predicted decode tokens/s per case and actor, its ratio to bf16, and the measurement."""
    base = {(r["target"], r["model"], r["batch"]): r["predicted_tokens_per_s"]
            for r in records if r["actor"] == "bf16"}
    lines = ["| target | model | batch | actor | bytes/step (GiB, >=) | bound | predicted step "
             "| predicted tokens/s | vs bf16 (predicted) | measured tokens/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ref = base.get((r["target"], r["model"], r["batch"]))
        ratio = f"{r['predicted_tokens_per_s'] / ref:.2f}x" if ref else ""
        measured = f"{r['measured_tokens_per_s']:,.0f}" if r["measured_tokens_per_s"] else ""
        lines.append(f"| {r['target']} | {r['model']} | {r['batch']} | {r['actor']} | "
                     f"{r['argument_bytes'] / 2**30:.2f} | {r['bound']} | "
                     f"{r['predicted_step_ms']:.2f} ms | {r['predicted_tokens_per_s']:,.0f} | "
                     f"{ratio} | {measured} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="gpu:h100-1, tpu:v5p-8 (one device of it is used)")
    p.add_argument("--actors", default=",".join(ACTORS))
    p.add_argument("--cases", default=";".join(f"{m},{b}" for m, b in CASES),
                   help="model,batch;model,batch")
    p.add_argument("--json", help="write the records here (after every case)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these files")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([r for path in args.table for r in json.load(open(path))]))
        return
    try:
        target = targets.parse(args.target or "")
    except targets.TargetError as e:
        sys.exit(str(e))
    if target.chip is None or target.chip.name not in CHIPS:
        sys.exit(f"--target={args.target}: peak figures known for {', '.join(CHIPS)} only")
    targets.use_cpu_unless_accelerator_attached()
    records = []
    for case in args.cases.split(";"):
        model, batch = case.split(",")
        for actor in args.actors.split(","):
            if actor not in ACTORS:
                sys.exit(f"--actors: {actor!r} is not one of {', '.join(ACTORS)}")
            records.append(predict(target, model, int(batch), actor))
            r = records[-1]
            print(f"{target.name} {model} x{batch} {actor}: >= {r['argument_bytes'] / 2**30:.2f} "
                  f"GiB/step, {r['predicted_tokens_per_s']:,.0f} tokens/s predicted "
                  f"({r['bound']}-bound; compiled in {r['compile_s']} s)", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)


if __name__ == "__main__":
    main()
