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

Two records per case and actor (`--attention`, default both):

- attention 'dense': the above; XLA's masked attention reads every cache slot of every row. (The
  compiled GPU program itself calls the ragged Pallas kernel, the sampler's default there,
  `pallas_kernel_in_program`; its arguments hold the whole cache either way.)
- attention 'ragged': a decode attention that reads only each row's live slots (the Pallas GPU
  kernel on the dense cache, or the paged kernels; `models.decode_attention`). The compiler's
  argument bytes, adjusted analytically (`ragged_record`, a prediction, not a measurement):

      bytes per step = argument bytes - full KV-cache bytes + full KV-cache bytes x live / slots,
      flops per step = flops - attention flops x (1 - live / slots),

  where `live` is the mean live slots per row-step of a rollout whose responses follow the
  length distribution of `bench.sampler.tail_limits` (log-normal, median NEW_TOKENS / 4, sigma 1,
  rounded and clipped to [1, NEW_TOKENS]) after PROMPT_LEN-token prompts, in the refilling
  sampler's steady state (`live_slots`, schedule 'refill'): every row of the batch always holds
  a response (a finished one is replaced at once, as the tokens/s = batch / step above already
  assumes), so a row-step falls in a response of length L with probability proportional to L,
  and the step that makes token k reads PROMPT_LEN + k slots:
  live = PROMPT_LEN + E[L (L + 1) / 2] / E[L] (815.1 of 1536 slots for 512 + 1024). Schedule
  'equal' (`--schedule`) is every response NEW_TOKENS long instead (no row ends early):
  PROMPT_LEN + (NEW_TOKENS + 1) / 2. Every row at full length reads every slot: the dense bytes
  are that upper bound. The kernels read whole key blocks (the GPU kernel's block_k, a page), so
  a real kernel reads up to one block more per row and split; not counted.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import numpy as np

from qurl_jax import quant
from qurl_jax.models import cast_floats, init_params
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.hf import config_from_hf
from qurl_jax.parallel import sharding as shd
from qurl_jax.parallel import targets
from qurl_jax.runtime.sizes import tree_bytes
from qurl_jax.sampling import Sampler

SHAPES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "shapes")
PROMPT_LEN, NEW_TOKENS = 512, 1024
ACTORS = ("bf16", "int8", "fp8")
ATTENTIONS = ("dense", "ragged")
SCHEDULES = ("refill", "equal")
# The response lengths of `bench.sampler.tail_limits`: log-normal, median max_new / TAIL_MEDIAN_DIV,
# log-space sigma TAIL_SIGMA, rounded, clipped to [1, max_new].
TAIL_MEDIAN_DIV, TAIL_SIGMA = 4.0, 1.0
RAGGED_NOTE = "compiler's argument bytes, adjusted analytically: a prediction, not a measurement"
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
#  TPU v5e: cloud.google.com/tpu/docs/v5e: 819 GB/s HBM2; 197 TFLOP/s BF16, 393 TOPS INT8.
#  TPU v6e: cloud.google.com/tpu/docs/v6e: 1,638 GB/s HBM; 918 TFLOP/s BF16, 1,836 TOPS INT8.
#    Neither has an FP8 matrix unit either (`bench.native_products`): FP8 at the BF16 rate.
CHIPS: dict[str, dict[str, float]] = {
    "h100": {"bandwidth": 3.35e12, "bf16": 989e12, "int8": 1979e12, "fp8": 1979e12},
    "v5p": {"bandwidth": 2.765e12, "bf16": 459e12, "int8": 918e12, "fp8": 459e12},
    "v5e": {"bandwidth": 0.819e12, "bf16": 197e12, "int8": 393e12, "fp8": 197e12},
    "v6e": {"bandwidth": 1.638e12, "bf16": 918e12, "int8": 1836e12, "fp8": 918e12},
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


def attention_flops(config: ModelConfig, batch: int, slots: float) -> float:
    """Matrix flops of one decode step's attention (scores and the weighted sum) over `slots`
    slots per row."""
    c = config
    return float(batch * 4 * c.num_layers * c.num_heads * c.head_dim * slots)


def step_flops(config: ModelConfig, batch: int, cache_slots: int) -> float:
    """Matrix flops of one decode step: every linear layer and the LM head once per row, and
    attention (scores and the weighted sum) over all cache slots."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size \
        + 3 * c.hidden_size * c.intermediate_size
    matrix_params = c.num_layers * per_layer + c.hidden_size * c.vocab_size
    return float(batch * 2 * matrix_params) + attention_flops(config, batch, cache_slots)


def length_pmf(max_new: int) -> np.ndarray:
    """f64[max_new]: P(response length = l + 1) under `bench.sampler.tail_limits(rows, max_new)`'s
    distribution (log-normal, median max_new / TAIL_MEDIAN_DIV, sigma TAIL_SIGMA, rounded to the
    nearest integer, clipped to [1, max_new]), exactly (no sampling)."""
    if max_new < 1:
        raise ValueError(f"length_pmf: max_new={max_new} must be >= 1")
    mu = math.log(max_new / TAIL_MEDIAN_DIV)
    edges = np.log(np.arange(1, max_new) + 0.5)  # round(x) <= l  iff  x < l + 0.5
    cdf = 0.5 * (1.0 + np.array([math.erf((e - mu) / (TAIL_SIGMA * math.sqrt(2.0)))
                                 for e in edges]))
    return np.diff(np.concatenate([[0.0], cdf, [1.0]]))


def live_slots(prompt_len: int, max_new: int, schedule: str = "refill") -> float:
    """Mean cache slots a ragged decode attention reads per row and step, for prompts of
    prompt_len tokens and responses of `length_pmf(max_new)`; the step that makes response
    token k reads prompt_len + k slots.

    schedule 'refill': the refilling sampler's steady state, every row always holding a
      response; the mean over all row-steps, prompt_len + E[L (L + 1) / 2] / E[L] (a row-step
      falls in a response in proportion to its length).
    schedule 'equal': every response max_new tokens long instead (no row ends early, static
      or refilling alike); prompt_len + (max_new + 1) / 2.

    Both count only row-steps that make a token, as tokens/s = batch / step does. (A static batch
    under the tail distribution is neither: its finished rows keep their window and still run
    through the model until the batch's longest row ends.)
    """
    if schedule == "equal":
        return prompt_len + (max_new + 1) / 2
    if schedule != "refill":
        raise ValueError(f"live_slots: schedule={schedule!r}; expected one of {SCHEDULES}")
    pmf = length_pmf(max_new)
    lengths = np.arange(1, max_new + 1, dtype=np.float64)
    return float(prompt_len + (pmf * lengths * (lengths + 1) / 2).sum() / (pmf * lengths).sum())


def _roofline(record: dict[str, Any], bytes_per_step: float, flops: float) -> dict[str, Any]:
    """The predicted step of `record`'s chip, actor and batch for these bytes and flops."""
    chip = CHIPS[record["chip"]]
    t_mem, t_flops = bytes_per_step / chip["bandwidth"], flops / chip[record["actor"]]
    step = max(t_mem, t_flops)
    return {"bytes_per_step": bytes_per_step, "flops_per_step": flops,
            "predicted_step_ms": step * 1e3, "bound": "memory" if t_mem >= t_flops else "compute",
            "predicted_tokens_per_s": record["batch"] / step}


def ragged_record(dense: dict[str, Any], live: float) -> dict[str, Any]:
    """The 'ragged' record of a compiled 'dense' one: the same case with an attention that reads
    `live` slots per row (of the record's `cache_slots`) instead of all of them.

    Bytes: the argument bytes less the full KV cache (`kv_cache_bytes`) plus its live share;
    flops: the attention term (`attention_flops_per_step`, over all slots) scaled to the live
    share. Pure: needs only the record's fields, no compile. A prediction, not a measurement."""
    slots = dense["cache_slots"]
    if not 0 <= live <= slots:
        raise ValueError(f"ragged_record: live={live} slots must be in [0, cache_slots={slots}]")
    dead = 1.0 - live / slots
    record = {k: v for k, v in dense.items() if k not in ("measured_tokens_per_s",
                                                          "cost_analysis_flops",
                                                          "cost_analysis_bytes_accessed")}
    record.update(
        attention="ragged", live_slots=live, note=RAGGED_NOTE, measured_tokens_per_s=None,
        **_roofline(dense, dense["argument_bytes"] - dense["kv_cache_bytes"] * dead,
                    dense["flops_per_step"] - dense["attention_flops_per_step"] * dead))
    return record


def _has_pallas_kernel(hlo: str) -> bool:
    """Whether a compiled program's HLO calls a Pallas kernel (a Triton call on GPU, a Mosaic
    custom call on TPU): on GPU the engine's default decode attention is the ragged kernel, whose
    step still takes the whole cache as an argument."""
    return "__gpu$xla.gpu.triton" in hlo or "tpu_custom_call" in hlo


def predict(target: targets.Target, model: str, batch: int, actor: str,
            config: ModelConfig | None = None) -> dict[str, Any]:
    """Compiles the decode program of one case for one device of `target` and predicts its step:
    the 'dense' record (every cache slot read; `ragged_record` derives the 'ragged' one).

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
    record = {
        "target": target.name, "chip": target.chip.name, "device_kind": device.device_kind,
        "model": model, "batch": batch, "actor": actor, "attention": "dense",
        "prompt_len": PROMPT_LEN, "new_tokens": NEW_TOKENS, "compile_s": round(compile_s, 1),
        "pallas_kernel_in_program": _has_pallas_kernel(compiled.as_text()),
        "weight_bytes": tree_bytes(params), "cache_slots": slots,
        "kv_cache_bytes": batch * sampler.engine.kv_bytes_per_row(PROMPT_LEN, NEW_TOKENS),
        "argument_bytes": arg_bytes,
        "attention_flops_per_step": attention_flops(config, batch, slots),
    }
    record.update(_roofline(record, arg_bytes, step_flops(config, batch, slots)))
    record["measured_tokens_per_s"] = MEASURED.get((target.platform, model, batch, actor))
    cost = compiled.cost_analysis()
    if cost:
        cost = cost[0] if isinstance(cost, list) else cost
        record["cost_analysis_flops"] = float(cost.get("flops", np.nan))
        record["cost_analysis_bytes_accessed"] = float(cost.get("bytes accessed", np.nan))
    return record
