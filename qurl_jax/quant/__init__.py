"""Quantized rollout actor: AQT INT8 / FP8 recipes, per-step requantization, invariant scaling.

The learner keeps float32 master weights. Once per RL step `requantize(params, recipe)` turns them
into frozen low-precision rollout parameters, and the rollout model runs them through the
`rollout_dot_general` hook: `Transformer(config, dot_general=rollout_dot_general)`.
`invariant_scaling` is QuRL's update-aware rescaling, applied to the learner's parameters once
before training; `update_capture` and `quantization_error` are the per-step diagnostics. On an x86
CPU (AVX512-VNNI, or AVX2) the int8 product runs on a custom kernel (`_cpu_kernel`;
`int8_kernel_isa` says which path, `int8_kernel_rows` up to how many rows: fewer where XLA's GEMM
runs on AMX tiles); a decode loop stores its int8 kernels in that kernel's layout once per rollout
with `pack_for_decode` where `packs_for_decode` says it pays. On a GPU a decode step runs each
layer's W8A8 products as one Pallas launch each (`FusedDecode`, `w8a8_product`: quantization,
product, scales and the residual or SwiGLU in one kernel).

The learner side of Jet-RL's unified FP8 flow (`train.precision = "fp8_block"`) runs the same
quantizer and block product in all three GEMMs of its linear layers: `bind_train_precision(model,
params, recipe, token_mask)` inside the jitted loss marks the recipe's kernels (`TrainKernel`) and
binds the custom-VJP hook `train_dot_general` (`fp8_block_linear` on plain arrays).
"""

from qurl_jax.quant._cpu_kernel import kernel_isa as int8_kernel_isa
from qurl_jax.quant._cpu_kernel import max_rows as int8_kernel_rows
from qurl_jax.quant._cpu_kernel import pack_for_decode, packs_for_decode
from qurl_jax.quant._diagnostics import quantization_error, quantization_step, update_capture
from qurl_jax.quant._dot_general import (
    aqt_serving_config,
    make_dot_general,
    rollout_dot_general,
    transpose_for_gpu,
)
from qurl_jax.quant._fp8_train import (
    TrainKernel,
    bind_train_precision,
    fp8_block_linear,
    make_train_dot_general,
    mark_train_kernels,
    train_dot_general,
)
from qurl_jax.quant._gpu_kernel import FusedDecode, w8a8_product
from qurl_jax.quant._invariant_scaling import invariant_scaling
from qurl_jax.quant._qtensor import QuantizedTensor, keep_rounded, quantize_kernel
from qurl_jax.quant._recipes import LINEAR_LAYERS, RECIPES, QuantFormat, Recipe, get_recipe
from qurl_jax.quant._requantize import (
    quantized_kernel_paths,
    quantized_leaves,
    requantize,
    requantize_program,
)

__all__ = [
    # Recipes
    "LINEAR_LAYERS",
    "RECIPES",
    "QuantFormat",
    "Recipe",
    "get_recipe",
    # Quantized kernels and the rollout hook
    "QuantizedTensor",
    "aqt_serving_config",
    "int8_kernel_isa",
    "int8_kernel_rows",
    "make_dot_general",
    "pack_for_decode",
    "packs_for_decode",
    "keep_rounded",
    "quantize_kernel",
    "rollout_dot_general",
    "transpose_for_gpu",
    # A GPU decode step's fused W8A8 products (Pallas)
    "FusedDecode",
    "w8a8_product",
    # Per-step requantization and QuRL's invariant scaling
    "invariant_scaling",
    "quantized_kernel_paths",
    "quantized_leaves",
    "requantize",
    "requantize_program",
    # FP8 training (Jet-RL's unified precision flow, learner side)
    "TrainKernel",
    "bind_train_precision",
    "fp8_block_linear",
    "make_train_dot_general",
    "mark_train_kernels",
    "train_dot_general",
    # Diagnostics
    "quantization_error",
    "quantization_step",
    "update_capture",
]
