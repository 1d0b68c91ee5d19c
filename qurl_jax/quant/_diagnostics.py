"""Per-step quantization diagnostics for the trainer's logs.

`update_capture` is QuRL's weight-update check (Fig. 4/9): between two consecutive learner
parameter sets, how many quantized codes of the rollout kernels actually changed, and how large the
mean update is relative to the mean quantization step. With lr ~ 1e-6 the update is far below one
int8 step, so most updates are rounded away and the rollout policy barely moves. The quantization
step of an element is its scale for int8, and its scale times the spacing of the E4M3 grid at its
code for FP8. The same figures are also given over the kernels of each invariant-scaling target
group (`_invariant_scaling.TARGETS`: q/k/v, gate/up), where QuRL's s acts. `quantization_error`
is the relative Frobenius error of each dequantized kernel.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.quant._invariant_scaling import TARGETS
from qurl_jax.quant._qtensor import QuantizedTensor
from qurl_jax.quant._recipes import QuantFormat, Recipe, get_recipe
from qurl_jax.quant._requantize import Params, quantize_params

# E4M3: 3 mantissa bits; the smallest normal exponent is -6 (below it the spacing is constant).
_E4M3_MANTISSA_BITS = 3
_E4M3_MIN_EXP = -6


def quantization_step(q: QuantizedTensor) -> jax.Array:
    """f32[R, C]: distance between an element's code and the next representable value, in the
    kernel's units (scale for int8; scale * E4M3 grid spacing at the code for FP8)."""
    scale = q.expanded_scale()
    if q.format is QuantFormat.INT8:
        return scale
    _, exp = jnp.frexp(jnp.abs(q.qvalue.astype(jnp.float32)))  # |c| = m * 2^exp, m in [0.5, 1)
    exp = jnp.maximum(exp - 1, _E4M3_MIN_EXP)  # floor(log2 |c|), subnormals share the min exponent
    return scale * jnp.exp2((exp - _E4M3_MANTISSA_BITS).astype(jnp.float32))


def update_capture(old_params: Params, new_params: Params,
                   recipe: str | Recipe) -> dict[str, jax.Array]:
    """How much of one learner update survives requantization, over all quantized kernels.

    Returns scalars:
      code_change_fraction: fraction of kernel elements whose quantized code changed.
      mean_abs_update: mean |new - old| over those elements (float weights).
      mean_quant_step: mean quantization step of the old weights' codes.
      update_to_step_ratio: mean_abs_update / mean_quant_step.
      code_change_fraction_<group>, update_to_step_ratio_<group>: the same over the quantized
        kernels of each invariant-scaling target group ('qkv': q/k/v_proj, 'gate_up':
        gate/up_proj) the parameters have.
    """
    recipe = get_recipe(recipe)
    if not recipe.quantizes:
        raise ValueError(f"update_capture: recipe {recipe.name!r} quantizes nothing")
    return _update_capture_impl(old_params, new_params, recipe)


@functools.partial(jax.jit, static_argnames=("recipe",))
def _update_capture_impl(old: Params, new: Params, recipe: Recipe) -> dict[str, jax.Array]:
    groups = {name: group for group, (_, _, names) in TARGETS.items() for name in names}
    # Per group ('' = every kernel): changed codes, |update| sum, quantization step sum, count.
    sums: dict[str, list] = {}
    pairs = zip(quantize_params(old, recipe), quantize_params(new, recipe), strict=True)
    for (path, q_old), (_, q_new) in pairs:
        w_old, w_new = _leaf(old, path), _leaf(new, path)
        parts = (jnp.sum(q_old.qvalue.astype(jnp.float32) != q_new.qvalue.astype(jnp.float32)),
                 jnp.sum(jnp.abs(w_new.astype(jnp.float32) - w_old.astype(jnp.float32))),
                 jnp.sum(quantization_step(q_old)), q_old.qvalue.size)
        group = groups.get(path[-2]) if len(path) > 1 else None
        for key in ("",) if group is None else ("", group):
            sums[key] = [a + b for a, b in zip(sums.get(key, (0, 0, 0, 0)), parts, strict=True)]
    changed, abs_update, step, count = sums[""]
    out = {"mean_abs_update": abs_update / count, "mean_quant_step": step / count}
    for key, (changed, abs_update, step, count) in sums.items():
        suffix = f"_{key}" if key else ""
        out[f"code_change_fraction{suffix}"] = changed / count
        out[f"update_to_step_ratio{suffix}"] = abs_update / step
    return out


def _leaf(params: Params, path: tuple[str, ...]) -> Any:
    for key in path:
        params = params[key]
    return params


@functools.partial(jax.jit, static_argnames=("recipe",))
def _quantization_error(params: Params, recipe: Recipe) -> dict[str, jax.Array]:
    out = {}
    for path, q in quantize_params(params, recipe):
        w = _leaf(params, path).astype(jnp.float32)
        err = jnp.linalg.norm(q.dequantize() - w) / jnp.maximum(jnp.linalg.norm(w), 1e-30)
        out["/".join(path[:-1])] = err
    return out


def quantization_error(params: Params, recipe: str | Recipe) -> dict[str, jax.Array]:
    """Per quantized kernel: {'layers_0/self_attn/q_proj': ||dequant(Q(W)) - W||_F / ||W||_F}."""
    return _quantization_error(params, get_recipe(recipe))
