"""Jet-RL's unified FP8 precision flow, learner side: a block-scaled FP8 E4M3 linear product.

With `train.precision = "fp8_block"` all three GEMMs of every quantized linear layer run on FP8
E4M3 inputs with DeepSeek-V3 scaling and float32 accumulation:

- forward   Y  = X W:     X in 1x128 groups (per token, 128 input channels), W in 128x128 blocks
  quantized from the float32 master;
- dgrad     dX = dY W^T:  dY in 1x128 groups (per token, 128 output channels) against the same
  weight blocks (their transpose), never a re-quantization of W;
- wgrad     dW = X^T dY:  both operands in 128x1 groups (128 tokens of one channel), float32
  result for the float32 master weights.

Only the GEMM inputs are FP8: the layer's output and the gradient handed to the previous layer are
in the compute dtype, the master weights and optimizer state stay float32, and attention, norms
and the LM head are not quantized. The scale convention is the rollout's (AQT abs-max: scale =
max|x| / 448, codes = E4M3(clip(x * (1 / scale), +-448)), round to nearest even, no stochastic
rounding; an all-zero group gets codes 0).

Same values as the sampler. The forward quantizes the weights with `quantize_kernel` and runs
`_dot_general.block_product`, the function the rollout's `fp8_block` recipe runs on `requantize`d
kernels, so the learner's forward and the sampler's forward see identical codes and scales for the
same float32 weights and activations. Per-token activation groups and per-block weight scales
make the codes independent of the batch composition; only the float32 accumulation order can
differ between two programs (see docs/jet_rl.md, "Limits").

Residuals. The backward keeps the forward's FP8 activation codes and scales and the FP8 weight
blocks, not float32 copies. The weight gradient re-groups X along tokens from the saved FP8
activations (dequantized, then quantized in 128x1 groups), as Jet-RL does with its fused FP8->FP8
transpose kernel, rather than from the float32 activations (which are not kept); dY is quantized
from the incoming compute-dtype gradient.

One inner GEMM. All three products are `_dot_general.block_scaled_matmul` (block-scaled codes x
block-scaled codes -> float32), the rollout's inner product too; a fast GPU kernel (cuBLASLt
blockwise FP8 or Pallas/Triton) replaces only that function. On CPU FP8 is emulated: the learner
calls `fast_block_scaled_matmul`, XLA's emulation's bits from qurl_jax's CPU kernel at about a
float32 GEMM's speed (XLA's own takes ~7x that: it materialises every group's partial product),
or `exact_block_scaled_matmul` in the forward under exact on-policy numerics (`models.exact`).

Padding. K, N and the token count are zero-padded to whole groups inside the quantizers; zeros
change no group's max |x| and no product. Padding tokens of the batch are kept out of every scale
by `token_mask`: their activations are zeroed before any quantization and their output-gradient
rows before the dgrad and wgrad quantization, so a 128-token wgrad group containing padding has
the scale of its real tokens only.

Why a `jax.custom_vjp` and not AQT as the carrier. AQT's `config_v4(fwd_bits='e4m3',
dlhs_bits='e4m3', drhs_bits='e4m3')` quantizes all three GEMMs, but true 128x128 weight blocks need
the output axis tiled as well (with a hand-set `calib_shared_axes`), which broadcasts the
activations N/128 times and materialises per-tile partial outputs; its input-gradient GEMM
re-quantizes the weights in 1x128 rows instead of reusing the forward's blocks; it turns on
stochastic rounding for gradients by default; and its products are not the rollout's
`block_product`, so learner and sampler would agree only by convention. The custom VJP keeps AQT's
quantizer as the rounding primitive (shared with the rollout) and states each GEMM's grouping
explicitly.

Which layers. The learner marks exactly the kernels the rollout's `requantize` replaces: the
recipe's `layers` (q/k/v/o/gate/up/down), selected by module path with the same
`quantized_kernel_paths`, each wrapped in a `TrainKernel` (`mark_train_kernels`). The hook
quantizes only `TrainKernel` operands and sends every plain array to `lax.dot_general`. So an
untied `lm_head` kernel, which has the same [in, out] contraction pattern as a linear layer, stays
unquantized unless the recipe sets `quantize_lm_head` (then both sides quantize it), and the tied
head (axis 1 of the embedding) is never a kernel path. A `TrainKernel` is a non-dict pytree node,
so the model's `cast_floats` passes it through uncast: the hook quantizes the float32 master even
when the compute dtype is bfloat16, the same values `requantize` quantizes for the sampler.

Learner integration (inside the jitted loss / log-prob function, per batch):

    model, params = quant.bind_train_precision(model, params, recipe, token_mask=attn_mask)
    logits, _ = model.apply({"params": params}, tokens, positions, attn_mask)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from flax import traverse_util

from qurl_jax.quant._dot_general import (
    DotDimensionNumbers,
    block_product,
    fast_block_scaled_matmul,
)
from qurl_jax.quant._qtensor import (
    QuantizedTensor,
    quantize_column_groups,
    quantize_kernel,
    quantize_row_groups,
)
from qurl_jax.quant._recipes import QuantFormat, Recipe, get_recipe
from qurl_jax.quant._requantize import kernel_block, quantized_kernel_paths

# Tokens per scale group of the weight gradient's operands (DeepSeek-V3's 128x1 groups).
TOKEN_GROUP = 128

Params = dict[str, Any]
DotGeneral = Callable[..., jax.Array]  # the signature of `jax.lax.dot_general`


@flax.struct.dataclass
class TrainKernel:
    """A float master kernel that the training hook multiplies in block-scaled FP8.

    value: f32[K, N]  the master kernel ([in, out]), quantized on the fly in every forward.
    block: (rows, cols) of a weight scale block, already shrunk to the kernel's shape (static).
    fmt: the FP8 format of weights, activations and gradients (static).
    """

    value: jax.Array
    block: tuple[int, int] = flax.struct.field(pytree_node=False)
    fmt: QuantFormat = flax.struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.value.shape)

    @property
    def ndim(self) -> int:
        return self.value.ndim


class _Grouping(NamedTuple):
    """Static scale grouping of one product: weight block, format, tokens per wgrad group; and
    whether the forward product runs in the fixed order (exact on-policy numerics)."""

    block: tuple[int, int]
    fmt: QuantFormat
    token_group: int
    exact: bool = False


def _forward(x: jax.Array, w: jax.Array, valid: jax.Array, grouping: _Grouping
             ) -> tuple[jax.Array, tuple[jax.Array, jax.Array, QuantizedTensor, jax.Array]]:
    """f32[M, N] = X W with X f32[M, K] (invalid rows zeroed), W f32[K, N]; and the residuals:
    activation codes [M, Kp] and f32 scales [M, Kp / block[0]], the FP8 weight blocks, valid."""
    x = jnp.where(valid[:, None], x, 0.0)
    wq = quantize_kernel(w, grouping.fmt, grouping.block, grouping.fmt)
    out, x_codes, x_scale = block_product(x, wq.qvalue, wq.scale, wq.block, grouping.fmt,
                                          grouping.exact, fast=True)
    return out, (x_codes, x_scale, wq, valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_linear(x: jax.Array, w: jax.Array, valid: jax.Array, grouping: _Grouping) -> jax.Array:
    """f32[M, N] block-scaled FP8 product of x f32[M, K] and w f32[K, N]; valid: bool[M]."""
    return _forward(x, w, valid, grouping)[0]


def _fp8_linear_bwd(grouping: _Grouping,
                    res: tuple[jax.Array, jax.Array, QuantizedTensor, jax.Array],
                    dy: jax.Array) -> tuple[jax.Array, jax.Array, None]:
    """(dX f32[M, K], dW f32[K, N], no gradient for the mask) from dY f32[M, N]."""
    x_codes, x_scale, wq, valid = res
    fmt = grouping.fmt
    m, k = dy.shape[0], wq.shape[0]
    br, bc = wq.block
    dy = jnp.where(valid[:, None], dy.astype(jnp.float32), 0.0)

    # dgrad: dY in 1 x bc groups along N against the forward's weight blocks, transposed to
    # [N, K] (a bc x br block of W^T is the transpose of a br x bc block of W).
    dy_codes, dy_scale = quantize_row_groups(dy, fmt, bc)
    w_t = wq.qvalue.T
    pad_n = dy_codes.shape[1] - w_t.shape[0]
    if pad_n:
        w_t = jnp.pad(w_t, ((0, pad_n), (0, 0)))
    dx = fast_block_scaled_matmul(dy_codes, dy_scale, w_t, wq.scale.T, br)

    # wgrad: X^T and dY^T in groups of `token_group` tokens per channel (128x1 in [M, K] terms).
    # X is re-grouped from the saved FP8 activations, dequantized in float32. Both are grouped
    # in place (`quantize_column_groups`): only X's codes are transposed, dY's are the product's
    # right operand as they come.
    tg = min(grouping.token_group, m)
    ng = x_scale.shape[1]
    x_deq = (x_codes.astype(jnp.float32).reshape(m, ng, -1) * x_scale[..., None]).reshape(m, -1)
    x_codes_t, x_scale_t = quantize_column_groups(x_deq, fmt, tg)  # [Mp, Kp], f32[nT, Kp]
    dy_codes_t, dy_scale_t = quantize_column_groups(dy, fmt, tg)  # [Mp, N], f32[nT, N]
    dw = fast_block_scaled_matmul(x_codes_t.T, x_scale_t.T, dy_codes_t, dy_scale_t, 1)[:k]
    return dx, dw, None


_fp8_linear.defvjp(_forward, _fp8_linear_bwd)


def fp8_block_linear(x: jax.Array, w: jax.Array, *, token_mask: jax.Array | None = None,
                     block: tuple[int, int] = (128, 128),
                     fmt: QuantFormat = QuantFormat.FP8_E4M3,
                     token_group: int = TOKEN_GROUP, exact: bool = False) -> jax.Array:
    """x @ w with all three GEMMs in block-scaled FP8 (see module docstring); differentiable.

    Args:
      x: f[..., K] activations in the compute dtype.
      w: f[K, N] float master kernel (float32 in the learner).
      token_mask: optional bool[...] over x's leading axes; False marks padding tokens, whose
        activations and output gradients are zeroed before quantization (their output rows are 0).
      block: weight scale block (rows, cols); shrinks to w's shape. The activation groups along K
        have block[0] channels, the output-gradient groups along N block[1].
      fmt: the FP8 format (E4M3).
      token_group: tokens per scale group of the weight-gradient operands.
      exact: the forward product in the fixed order (`_dot_general.exact_block_scaled_matmul`,
        exact on-policy numerics), the rollout's under the same setting; the backward unchanged.

    Returns f[..., N] in x's dtype. Gradients: dX in x's dtype, dW in w's dtype (both computed in
    float32).
    """
    if w.ndim != 2 or x.shape[-1] != w.shape[0]:
        raise ValueError(f"fp8_block_linear: need x[..., K] and w[K, N], got x {x.shape} and "
                         f"w {w.shape}")
    lead, k = x.shape[:-1], x.shape[-1]
    if token_mask is None:
        valid = jnp.ones((x.size // k,), jnp.bool_)
    elif token_mask.shape != lead:
        raise ValueError(f"fp8_block_linear: token_mask of shape {token_mask.shape} must match "
                         f"the leading axes {lead} of x {x.shape}")
    else:
        valid = token_mask.reshape(-1).astype(jnp.bool_)
    grouping = _Grouping((min(block[0], k), min(block[1], w.shape[1])), fmt, token_group, exact)
    # The casts sit outside the custom VJP, so their transposes hand dX back in the compute dtype
    # and dW in the master dtype.
    out = _fp8_linear(x.reshape(-1, k).astype(jnp.float32), w.astype(jnp.float32), valid,
                      grouping)
    return out.reshape(*lead, w.shape[1]).astype(x.dtype)


def train_dot_general(lhs: jax.Array, rhs: jax.Array | TrainKernel,
                      dimension_numbers: DotDimensionNumbers, precision: Any = None,
                      preferred_element_type: Any = None, *,
                      token_mask: jax.Array | None = None, exact: bool = False,
                      **kwargs: Any) -> jax.Array:
    """The learner's `dot_general` hook: FP8 block-scaled for `TrainKernel`s, plain otherwise.

    lhs: f[..., K] activations; rhs: a `TrainKernel` [K, N] (a marked linear layer, contracting
    axis 0) or any float array (LM head, tied or untied, and every unmarked product), which goes
    to `jax.lax.dot_general` unchanged. token_mask: bool over lhs's leading axes (see
    `fp8_block_linear`); bind it per batch with `functools.partial`. exact: the forward product
    in the fixed order (`models.exact` sets it; float rhs never come here then). Returns
    f[..., N] in lhs's dtype (or `preferred_element_type`).
    """
    if not isinstance(rhs, TrainKernel):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    if lhs_b or rhs_b or tuple(lhs_c) != (lhs.ndim - 1,) or tuple(rhs_c) != (0,) or rhs.ndim != 2:
        raise ValueError(
            f"train_dot_general: a TrainKernel rhs of shape {rhs.shape} supports only contracting "
            f"the last lhs axis with rhs axis 0 and no batch axes; got "
            f"dimension_numbers={dimension_numbers} for lhs of shape {lhs.shape}"
        )
    out = fp8_block_linear(lhs, rhs.value, token_mask=token_mask, block=rhs.block, fmt=rhs.fmt,
                           exact=exact)
    return out.astype(preferred_element_type or lhs.dtype)


def _check_trainable(recipe: Recipe) -> None:
    fp8 = QuantFormat.FP8_E4M3
    if recipe.quantizes and not (recipe.weight_format is fp8 and recipe.act_format is fp8
                                 and recipe.weight_block is not None):
        raise ValueError(
            f"training precision {recipe.name!r}: the learner runs 'fp' or block-scaled FP8 E4M3 "
            f"recipes ('fp8_block'); this recipe has weight_format={recipe.weight_format}, "
            f"act_format={recipe.act_format}, weight_block={recipe.weight_block}"
        )


def make_train_dot_general(recipe: str | Recipe) -> DotGeneral:
    """The learner's dot_general for `recipe`: `lax.dot_general` for `fp`, else
    `train_dot_general` (which reads block and format from each `TrainKernel`).

    Raises ValueError for a recipe that is not block-scaled FP8 E4M3.
    """
    recipe = get_recipe(recipe)
    _check_trainable(recipe)
    return train_dot_general if recipe.quantizes else jax.lax.dot_general


def mark_train_kernels(params: Params, recipe: str | Recipe) -> Params:
    """`params` with every kernel `recipe` quantizes wrapped in a `TrainKernel` (differentiable:
    the gradient w.r.t. the wrapped tree is the gradient w.r.t. `params`).

    The kernels are the ones `requantize` replaces for the sampler (`quantized_kernel_paths`);
    `fp` returns `params` unchanged.
    """
    recipe = get_recipe(recipe)
    _check_trainable(recipe)
    if not recipe.quantizes:
        return params
    flat = traverse_util.flatten_dict(params)
    for path in quantized_kernel_paths(params, recipe):
        w = flat[path]
        flat[path] = TrainKernel(w, kernel_block(recipe, w.shape), recipe.weight_format)
    return traverse_util.unflatten_dict(flat)


def bind_train_precision(model: Any, params: Params, recipe: str | Recipe,
                         token_mask: jax.Array | None = None) -> tuple[Any, Params]:
    """(model, params) that run `recipe`'s training precision on one batch.

    model: a flax module with a `dot_general` attribute (`Transformer`); params: its float
    `params` collection; token_mask: bool[B, T] real tokens of the batch (padding is kept out of
    every FP8 scale). For `fp` both come back unchanged. Call inside the jitted loss, once per
    (micro-)batch.
    """
    recipe = get_recipe(recipe)
    _check_trainable(recipe)
    if not recipe.quantizes:
        return model, params
    hook = functools.partial(train_dot_general, token_mask=token_mask)
    return model.clone(dot_general=hook), mark_train_kernels(params, recipe)
