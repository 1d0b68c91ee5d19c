"""Quantized rollout actor: AQT INT8 / FP8 recipes, per-step requantization, invariant scaling.

The learner keeps float32 master weights. Once per RL step `requantize(params, recipe)` turns them
into frozen low-precision rollout parameters, and the rollout model runs them through the
`rollout_dot_general` hook: `Transformer(config, dot_general=rollout_dot_general)`.
`invariant_scaling` is QuRL's update-aware rescaling, applied to the learner's parameters once
before training; `update_capture` and `quantization_error` are the per-step diagnostics.
"""

# Recipes
from qurl_jax.quant._dot_general import make_dot_general, rollout_dot_general

# Quantized tensors and the rollout hook
from qurl_jax.quant._qtensor import QuantizedTensor, quantize_kernel
from qurl_jax.quant._recipes import LINEAR_LAYERS, RECIPES, QuantFormat, Recipe, get_recipe

# Requantization
from qurl_jax.quant._requantize import quantized_kernel_paths, requantize

__all__ = [
    "LINEAR_LAYERS",
    "RECIPES",
    "QuantFormat",
    "QuantizedTensor",
    "Recipe",
    "get_recipe",
    "make_dot_general",
    "quantize_kernel",
    "quantized_kernel_paths",
    "requantize",
    "rollout_dot_general",
]
