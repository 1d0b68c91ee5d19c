"""How the LoRA learner reads the frozen base: its products (`model.lora.learner_products`).

A LoRA learner differentiates `attach(base, adapter)` with respect to the adapter only; the base's
products need a forward and an input gradient, never a weight gradient. Two ways to run them:

- 'weight_only': float activations times the base's codes (each `QuantizedTensor` re-wrapped with
  no activation format, `weight_only`): pi_theta is the float-activation policy of the quantized
  weights, and the rollout's W8A8 activation rounding is the mismatch ACR corrects.
- 'w8a8': the rollout's own product, `quant.rollout_dot_general` on the same codes (activations
  quantized per token, int8 x int8 -> int32, the token and channel scales), so pi_theta is the
  policy the rollout samples; the input gradient is an int8 product too (`w8a8_linear`).

On XLA:CPU the weight-only codes are widened to the compute dtype once per program call
(`for_learner`): XLA:CPU does not fuse an int8 -> float cast into its products but hoists it out of
the micro-batch loop anyway (the same float copy), and a cast inside the LM head's checkpointed
chunk kept XLA from merging the head's recomputation with its forward (the head ran three times
per micro-batch instead of two).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.lora._adapter import LEARNER_PRODUCTS, LoraConfig, attach, weight_only
from qurl_jax.quant import QuantFormat, QuantizedTensor, rollout_dot_general
from qurl_jax.quant._qtensor import quantize_row_groups

DotGeneral = Callable[..., jax.Array]
Params = dict[str, Any]
_LINEAR = (((1,), (0,)), ((), ()))
_BY_OUTPUT = (((1,), (1,)), ((), ()))  # g[M, N] against codes [K, N]: contract N


def is_w8a8_linear(kernel: Any) -> bool:
    """An int8 W8A8 kernel [in, out] with one scale per output channel, as the learner holds it
    (not packed or transposed: those layouts are the sampler's, made inside its programs)."""
    return (isinstance(kernel, QuantizedTensor) and kernel.format is QuantFormat.INT8
            and kernel.act_format is QuantFormat.INT8 and kernel.ndim == 2
            and kernel.is_per_channel(0) and not kernel.packed and not kernel.transposed)


@jax.custom_vjp
def w8a8_linear(x: jax.Array, kernel: QuantizedTensor) -> jax.Array:
    """x f[M, in] @ an int8 W8A8 kernel [in, out] -> f[M, out], with the rollout's numerics.

    Forward: `quant.rollout_dot_general`, the rollout's product (AQT's serving path: x quantized
    per token, int8 x int8 -> int32, times the token and channel scales). Backward, with the
    activation quantizer passed straight through: dx = dy diag(s) W_codes^T, run as an int8
    product too (SwitchBack, Wortsman et al. 2023): g = dy * s (s the channels' scales) quantized
    per token, times the same codes contracted over the output axis, int32, times the tokens'
    scales. No weight gradient: the base is frozen. Residuals: the kernel only (the codes the
    caller already holds), never x."""
    return rollout_dot_general(x, kernel, _LINEAR)


def _w8a8_fwd(x: jax.Array, kernel: QuantizedTensor) -> tuple[jax.Array, QuantizedTensor]:
    return w8a8_linear(x, kernel), kernel


def _w8a8_bwd(kernel: QuantizedTensor, dy: jax.Array) -> tuple[jax.Array, None]:
    g = dy.astype(jnp.float32) * kernel.scale.reshape(1, -1)
    codes, scale = quantize_row_groups(g, QuantFormat.INT8, g.shape[1])  # [M, N], f32[M, 1]
    dx = jax.lax.dot_general(codes, kernel.qvalue, _BY_OUTPUT, preferred_element_type=jnp.int32)
    return (dx.astype(jnp.float32) * scale).astype(dy.dtype), None


w8a8_linear.defvjp(_w8a8_fwd, _w8a8_bwd)


def learner_products(products: DotGeneral) -> DotGeneral:
    """The learner's inner hook (wrapped by `lora.dot_general`): an int8 W8A8 kernel of the base
    through `w8a8_linear`, any other `QuantizedTensor` (weight-only codes, the vocabulary tables)
    through `quant.rollout_dot_general`, float kernels (the adapters, a 'compute' base) through
    `products` (on XLA:CPU the plain weight-gradient products of the learner's float kernels)."""

    def inner(lhs: jax.Array, rhs: Any, dimension_numbers: Any, **kwargs: Any) -> jax.Array:
        if is_w8a8_linear(rhs) and tuple(map(tuple, dimension_numbers[0])) == (
                (lhs.ndim - 1,), (0,)) and not any(dimension_numbers[1]):
            out = w8a8_linear(lhs.reshape(-1, lhs.shape[-1]), rhs)
            out = out.reshape(*lhs.shape[:-1], out.shape[-1])
            return out.astype(kwargs.get("preferred_element_type") or lhs.dtype)
        if isinstance(rhs, QuantizedTensor):
            return rollout_dot_general(lhs, rhs, dimension_numbers, **kwargs)
        return products(lhs, rhs, dimension_numbers, **kwargs)

    return inner


def learner_base(base: Params, products: str) -> Params:
    """The frozen base as the learner's `products` read it (and the evaluation, which samples the
    learner's policy): `weight_only(base)` for 'weight_only', the base itself (the rollout's
    activation formats) for 'w8a8'. The same code and scale arrays either way."""
    if products not in LEARNER_PRODUCTS:
        raise ValueError(f"lora.learner_base: products={products!r} is not one of "
                         f"{LEARNER_PRODUCTS}")
    return weight_only(base) if products == "weight_only" else base


def learner_policy(base: Params, adapter: Params, cfg: LoraConfig) -> Params:
    """The learner's policy as a sampler samples it (the evaluation): `adapter` attached to the
    frozen `base` read as `cfg.learner_products` read it (`learner_base`)."""
    return attach(learner_base(base, cfg.learner_products), adapter, cfg.scale)


def for_learner(base: Params, products: str, widen: Any = None) -> Params:
    """`learner_base(base, products)`, inside a learner program; with `widen` (a float dtype: on
    XLA:CPU) every weight-only `QuantizedTensor`'s codes held in it (`codes_as`, exact), once
    per call of the program (module docstring). Traceable."""
    base = learner_base(base, products)
    if widen is None:
        return base
    is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
    return jax.tree.map(lambda x: x.codes_as(widen) if is_q(x) and x.act_format is None
                        and not x.packed else x, base, is_leaf=is_q)
