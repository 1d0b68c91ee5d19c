"""The rollout model's dot_general hook: float kernels pass through, quantized kernels run W8A8.

`rollout_dot_general` has the signature of `jax.lax.dot_general` and is what the rollout model is
built with (`Transformer(config, dot_general=rollout_dot_general)`). It dispatches on the kernel:

- a float array: plain `lax.dot_general` (every layer of the `fp` recipe, and the LM head when
  the vocabulary tables are not quantized);
- a per-channel `QuantizedTensor` (`int8`, `fp8`): AQT's serving path. The kernel is handed to
  AQT's `DotGeneralRaw` as a pre-quantized rhs `QTensor`, so the weights are never re-quantized in
  the forward; AQT quantizes the activations per token (scale = max |x_token| / max code), runs
  the integer (int8 x int8 -> int32) or FP8 (-> f32) product and multiplies the output by the
  outer product of the token and channel scales;
- a block-scaled `QuantizedTensor` (`fp8_block`): activations quantized in 1 x g groups along the
  contracting axis with AQT's quantizer, one low-precision partial product per group of g input
  features (a batched `dot_general` over the groups), each rescaled by its activation-group and
  weight-block scales and summed in float32, as DeepSeek-V3-style kernels do;
- a weight-only `QuantizedTensor` with one scale per output channel (`int8_weight_only`, the
  vocabulary tables of `Recipe.quantize_vocab`): the codes, cast to the activations' dtype, in a
  float product, then the channels' scales; other weight-only blocks are dequantized first.

Why AQT's serving path for the hot product: with the kernel given as a complete `QTensor` it adds
only the per-token activation quantization and one output rescale around the s8 x s8 -> s32
product. That product is AQT's `DotGeneralRaw.dot_general`, set here to `int8_dot_general`: on a
CPU with AVX512-VNNI it runs on qurl_jax's int8 kernel (`quant._cpu_kernel`, bit-identical to XLA's
dot), because XLA:CPU's own int8 GEMM is compute-bound at decode batch sizes (~2x fp32 on the
768-2048-wide layers of the ~100M benchmark model, against ~3-5x for the kernel reading packed
weights). XLA's int8 dot has no fast path for a single row, which is therefore padded to two. On CPU
FP8 is emulated by XLA (upcast), so the FP8 recipes are for numerics, not speed.

The model calls the hook with two dimension-number patterns: a linear layer contracts the last
axis of x with axis 0 of a kernel [in, out]; the tied LM head contracts it with axis 1 of the
embedding [V, E]. Both are handled; anything else raises. A kernel stored transposed
(`QuantizedTensor.transposed`, `transpose_for_gpu`) is read as stored, contracting its other axis.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from aqt.jax.v2 import config as aqt_config
from aqt.jax.v2.numerics import utils as aqt_numerics

from qurl_jax.cpu_kernels import fixed_order
from qurl_jax.quant._cpu_kernel import int8_dot_general, packed_int8_dot_general
from qurl_jax.quant._qtensor import QuantizedTensor, quantize_row_groups
from qurl_jax.quant._recipes import QuantFormat, Recipe, get_recipe

DotDimensionNumbers = tuple[tuple[tuple[int, ...], tuple[int, ...]],
                            tuple[tuple[int, ...], tuple[int, ...]]]


def aqt_serving_config(fmt: QuantFormat, packed: bool = False) -> aqt_config.DotGeneralRaw:
    """AQT forward dot_general for W8A8 in `fmt`: both sides abs-max calibrated along the
    contracting axis (per token / per output channel), int32 accumulation for int8, f32 for FP8.

    For int8, AQT's raw integer product is `int8_dot_general`: the VNNI kernel for decode-shaped
    products on CPU, XLA's dot otherwise (bit-identical); with `packed` weights (see
    `pack_for_decode`) it is the kernel's packed product."""
    cfg = aqt_config.dot_general_raw_make(fmt.value, fmt.value)
    numerics = aqt_numerics.get_numerics(fmt.value, preserve_max_val=True)
    aqt_config.set_numerics(cfg, numerics, numerics)
    if fmt is QuantFormat.INT8:
        cfg.dot_general = packed_int8_dot_general if packed else int8_dot_general
    elif packed:
        raise ValueError(f"aqt_serving_config: only int8 kernels can be packed, not {fmt}")
    return cfg


def _per_channel_product(lhs: jax.Array, rhs: QuantizedTensor, rhs_axis: int) -> jax.Array:
    """AQT's serving path with the pre-quantized kernel as rhs QTensor. Output f32[..., N]."""
    lead, k = lhs.shape[:-1], lhs.shape[-1]
    x = lhs.reshape(-1, k).astype(jnp.float32)
    rows = x.shape[0]
    if rows == 1:
        # XLA:CPU's int8 dot has no fast path for a single row (~8x slower than two rows); the
        # padding row is nearly free for the VNNI kernel.
        x = jnp.pad(x, ((0, 1), (0, 0)))
    cfg = aqt_serving_config(rhs.act_format, packed=rhs.packed)
    # AQT still wants an rhs array of the right shape; its own calibration of it is discarded
    # when a complete rhs QTensor is given (and removed by XLA as dead code).
    placeholder = jnp.zeros(rhs.shape, jnp.float32)
    with warnings.catch_warnings():
        # aqtp 0.9.0 calls jnp.promote_types(lhs, rhs) on arrays, which jax deprecates (trace time).
        warnings.filterwarnings("ignore", "Implicit conversion of an array to a dtype",
                                DeprecationWarning)
        out, _ = cfg(x, placeholder, None, rhs.to_aqt(rhs_axis),
                     (((1,), (rhs_axis,)), ((), ())))
    return out[:rows].reshape(*lead, out.shape[-1])


def block_scaled_matmul(a_codes: jax.Array, a_scale: jax.Array, b_codes: jax.Array,
                        b_scale: jax.Array, block_n: int) -> jax.Array:
    """a @ b for block-scaled low-precision operands, accumulated in float32 (int32 for int8).

    a_codes: [M, G * g] codes, a_scale: f32[M, G]  one scale per row and group of g columns.
    b_codes: [G * g, N] codes, b_scale: f32[G, ceil(N / block_n)]  one scale per g x block_n block.
    Returns f32[M, N] = sum_G a_scale[m, G] * b_scale[G, n // block_n] * (a_G @ b_G)[m, n].

    This is the one GEMM of every block-scaled product: the rollout's `fp8_block` forward and the
    learner's forward, input-gradient and weight-gradient products (`_fp8_train`) all run here, so
    a fast block-scaled kernel (cuBLASLt blockwise modes, Pallas/Triton) replaces only this
    function. The emulation runs one low-precision partial product per group (a batched
    `dot_general` over the groups) and rescales and sums the partials in float32, as DeepSeek-V3
    style kernels do.
    """
    m, kp = a_codes.shape
    ng = a_scale.shape[1]
    g, n = kp // ng, b_codes.shape[1]
    acc = jnp.int32 if b_codes.dtype == jnp.int8 else jnp.float32
    partial = jax.lax.dot_general(  # [G, M, N]: batch over groups, contract within a group
        a_codes.reshape(m, ng, g), b_codes.reshape(ng, g, n), (((2,), (1,)), ((1,), (0,))),
        preferred_element_type=acc,
    ).astype(jnp.float32)
    b_scale = jnp.repeat(b_scale, block_n, axis=1)[:, :n]  # [G, N]
    return jnp.einsum("gmn,mg,gn->mn", partial, a_scale, b_scale)


# `fast_block_scaled_matmul` runs the kernel where it gives XLA:CPU's own bits: at least this
# many rows, a multiple of this many columns, and with 8 or more groups a multiple of 8 rows
# (elsewhere XLA takes other paths, whose sums round differently: its GEMM's below 64 rows or
# off 64 columns, a sequential combine for the rows past the last 8; measured with XLA's default
# optimisation level, YNNPACK's or Eigen's products alike; tests/test_exact_numerics.py).
FAST_MIN_ROWS = 64
FAST_COLUMN_MULTIPLE = 64
FAST_ROW_MULTIPLE = 8


def fast_block_scaled_matmul(a_codes: jax.Array, a_scale: jax.Array, b_codes: jax.Array,
                             b_scale: jax.Array, block_n: int) -> jax.Array:
    """`block_scaled_matmul`, bit for bit, at about a float32 GEMM's speed on CPU: the FP8
    learner's three products (`_fp8_train`).

    XLA:CPU's emulation materialises every group's float32 partial product ([G, M, N]) and
    combines them in a batched product over the groups: about 7x a float32 GEMM of the same
    shape. The fixed-order kernel (`cpu_kernels.fixed_order.matmul_e4m3`) computes each group's
    partial as the same fused chain (XLA's GEMM at M >= 64) and combines them in XLA's order
    (eight lanes and a tail, see its `GemmItem`), in registers and one pass. It runs where the
    two agree (a CPU program, E4M3 codes, the shapes of FAST_MIN_ROWS, FAST_COLUMN_MULTIPLE and
    FAST_ROW_MULTIPLE); everything else is `block_scaled_matmul`."""
    m, n, groups = a_codes.shape[0], b_codes.shape[1], a_scale.shape[1]
    if (m < FAST_MIN_ROWS or n % FAST_COLUMN_MULTIPLE
            or (groups >= 8 and m % FAST_ROW_MULTIPLE)
            or b_codes.dtype != jnp.float8_e4m3fn or a_codes.dtype != jnp.float8_e4m3fn
            or not fixed_order.available()):
        return block_scaled_matmul(a_codes, a_scale, b_codes, b_scale, block_n)

    def cpu(a: jax.Array, a_scale: jax.Array, b_codes: jax.Array, b_scale: jax.Array
            ) -> jax.Array:
        return fixed_order.matmul_e4m3(a.astype(jnp.float32), a_scale, b_codes, b_scale,
                                       block_n)

    def other(a: jax.Array, a_scale: jax.Array, b_codes: jax.Array, b_scale: jax.Array
              ) -> jax.Array:
        return block_scaled_matmul(a, a_scale, b_codes, b_scale, block_n)

    return fixed_order.on_cpu(cpu, other, a_codes, a_scale, b_codes, b_scale)


def exact_block_scaled_matmul(a_codes: jax.Array, a_scale: jax.Array, b_codes: jax.Array,
                              b_scale: jax.Array, block_n: int) -> jax.Array:
    """`block_scaled_matmul` of E4M3 operands in a fixed order, the same for every row whatever
    the rows in the call (exact on-policy numerics, `models.exact`): per group the fused
    multiply-add chain over its contraction rows from 0, then the groups' partials, each times
    its activation scale, combined with the weight scales in `fast_block_scaled_matmul`'s order
    (`cpu_kernels.fixed_order.matmul_e4m3`; on TPU and GPU a sum over the groups in order per
    tile of rows)."""
    if b_codes.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"exact numerics: block-scaled products need E4M3 codes, got "
                         f"{b_codes.dtype} (train.on_policy_numerics='exact' runs the 'fp' and "
                         f"'fp8_block' recipes)")
    a = a_codes.astype(jnp.float32)

    def cpu(a: jax.Array, a_scale: jax.Array, b_codes: jax.Array, b_scale: jax.Array
            ) -> jax.Array:
        return fixed_order.matmul_e4m3(a, a_scale, b_codes, b_scale, block_n)

    def other(a: jax.Array, a_scale: jax.Array, b_codes: jax.Array, b_scale: jax.Array
              ) -> jax.Array:
        ng, n = a_scale.shape[1], b_codes.shape[1]
        b = b_codes.astype(jnp.float32).reshape(ng, -1, n)
        sb = jnp.repeat(b_scale, block_n, axis=1)[:, :n]

        def tile(a: jax.Array, sa: jax.Array) -> jax.Array:
            parts = jnp.einsum("mgk,gkn->gmn", a.reshape(a.shape[0], ng, -1), b)
            out = jnp.zeros(parts.shape[1:], jnp.float32)
            for g in range(ng):
                out = out + (parts[g] * sa[:, g:g + 1]) * sb[g][None]
            return out

        return fixed_order.row_tiles(tile, a, a_scale)

    return fixed_order.on_cpu(cpu, other, a, a_scale.astype(jnp.float32), b_codes,
                              b_scale.astype(jnp.float32))


def block_product(x: jax.Array, codes: jax.Array, scale: jax.Array, block: tuple[int, int],
                  act_format: QuantFormat, exact: bool = False, fast: bool = False
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x[M, K] times a block-scaled kernel [K, N], activations quantized in 1 x block[0] groups.

    codes: [K, N] kernel codes; scale: f32[ceil(K / block[0]), ceil(N / block[1])]; exact: the
    product in the fixed order (`exact_block_scaled_matmul`); fast: `fast_block_scaled_matmul`
    (the same bits as the default, the learner's).
    Returns (f32[M, N] product, activation codes [M, G * block[0]], f32 scales [M, G]); the
    learner keeps the activation codes for its backward pass (`_fp8_train`).
    """
    x_codes, x_scale = quantize_row_groups(x, act_format, block[0])
    pad = x_codes.shape[1] - codes.shape[0]
    if pad:
        codes = jnp.pad(codes, ((0, pad), (0, 0)))
    product = (exact_block_scaled_matmul if exact
               else fast_block_scaled_matmul if fast else block_scaled_matmul)
    return product(x_codes, x_scale, codes, scale, block[1]), x_codes, x_scale


def _block_product(lhs: jax.Array, rhs: QuantizedTensor, rhs_axis: int,
                   exact: bool = False) -> jax.Array:
    """x[..., K] times a block-scaled kernel (`block_product`). Output f32[..., N]."""
    codes, scale, block = rhs.qvalue, rhs.scale, rhs.block
    if rhs_axis == 1:  # tied head: embedding [V, E] contracts E; view it as a kernel [E, V]
        codes, scale, block = codes.T, scale.T, block[::-1]
    lead, k = lhs.shape[:-1], lhs.shape[-1]
    out, _, _ = block_product(lhs.reshape(-1, k), codes, scale, block, rhs.act_format, exact)
    return out.reshape(*lead, out.shape[-1])


def _weight_only_per_channel(lhs: jax.Array, rhs: QuantizedTensor, rhs_axis: int,
                             precision: Any) -> jax.Array:
    """x[..., K] times weight-only codes with one scale per output channel: the codes cast to
    the activations' dtype (exact for int8 and E4M3 in bf16 or wider) in the product, accumulated
    in float32, then each output channel times its scale. The kernel is never dequantized into a
    float copy, so a decode step reads its codes (the vocabulary tables, `Recipe.quantize_vocab`:
    one byte per element) and XLA fuses the cast into the product. Output f32[..., N]."""
    out = jax.lax.dot_general(lhs, rhs.qvalue.astype(lhs.dtype),
                              (((lhs.ndim - 1,), (rhs_axis,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32)
    return out * rhs.scale.reshape(-1)


def rollout_dot_general(lhs: jax.Array, rhs: jax.Array | QuantizedTensor,
                        dimension_numbers: DotDimensionNumbers, precision: Any = None,
                        preferred_element_type: Any = None, *, exact: bool = False,
                        **kwargs: Any) -> jax.Array:
    """`jax.lax.dot_general` that also accepts a `QuantizedTensor` rhs (see module docstring).

    lhs: f[..., K] activations; rhs: a float array or a QuantizedTensor kernel [K, N] (contracting
    axis 0) or [N, K] (contracting axis 1, the tied LM head). exact: a block-scaled kernel's
    product in the fixed order (exact on-policy numerics; `models.exact` sets it, and runs float
    kernels itself). Returns f[..., N] in lhs's dtype (or `preferred_element_type`).
    """
    if not isinstance(rhs, QuantizedTensor):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    (lhs_c, rhs_c), (lhs_b, rhs_b) = dimension_numbers
    if rhs.transposed and rhs.ndim == 2 and len(rhs_c) == 1:  # contract the stored tensor
        rhs, rhs_c = rhs.stored(), (1 - rhs_c[0],)
        dimension_numbers = ((lhs_c, rhs_c), (lhs_b, rhs_b))
    if lhs_b or rhs_b or tuple(lhs_c) != (lhs.ndim - 1,) or len(rhs_c) != 1 or rhs.ndim != 2:
        raise ValueError(
            f"rollout_dot_general: a QuantizedTensor rhs of shape {rhs.shape} supports only "
            f"contracting the last lhs axis with one rhs axis and no batch axes; got "
            f"dimension_numbers={dimension_numbers} for lhs of shape {lhs.shape}"
        )
    out_dtype = preferred_element_type or lhs.dtype
    rhs_axis = int(rhs_c[0])
    if exact and (rhs.is_per_channel(rhs_axis) or rhs.act_format is not QuantFormat.FP8_E4M3):
        raise ValueError(f"exact numerics: a kernel of weight format {rhs.qvalue.dtype}, "
                         f"activations {rhs.act_format}, block {rhs.block} has no fixed-order "
                         f"product (train.on_policy_numerics='exact' runs the 'fp' and "
                         f"'fp8_block' recipes, vocabulary tables in float)")
    if rhs.act_format is None and rhs.is_per_channel(rhs_axis):
        out = _weight_only_per_channel(lhs, rhs, rhs_axis, precision)
    elif rhs.act_format is None:
        out = jax.lax.dot_general(lhs, rhs.dequantize(lhs.dtype), dimension_numbers,
                                  precision=precision)
    elif rhs.is_per_channel(rhs_axis):
        out = _per_channel_product(lhs, rhs, rhs_axis)
    else:
        out = _block_product(lhs, rhs, rhs_axis, exact)
    return out.astype(out_dtype)


def transpose_for_gpu(params: Any) -> Any:
    """Rollout parameters for a GPU decode program: every per-channel W8A8 linear kernel (int8,
    fp8; the leaves named 'kernel') stored transposed, [out, in] with the input axis minor
    (`QuantizedTensor.transposed`). The GPU's 8-bit tensor-core products (`mma ... s8.s8` and
    the e4m3 ones) read both operands with the contracting axis minor, so XLA otherwise copies
    every such kernel into that layout at the start of each call of a decode program (196 copies
    a call for the 1.5B model, `bench.explain`). Traceable; meant to run once per rollout
    (`Engine.prepare`). The codes and scales are the same numbers: products are unchanged."""

    def one(path: tuple, x: Any) -> Any:
        named_kernel = getattr(path[-1], "key", None) == "kernel" if path else False
        if (named_kernel and isinstance(x, QuantizedTensor) and x.act_format is not None
                and not x.packed and not x.transposed and x.ndim == 2 and x.is_per_channel(0)):
            return x.store_transposed()
        return x

    return jax.tree_util.tree_map_with_path(
        one, params, is_leaf=lambda x: isinstance(x, QuantizedTensor))


def make_dot_general(recipe: str | Recipe) -> Any:
    """The dot_general to build the rollout model with for `recipe`.

    `lax.dot_general` for `fp`, otherwise `rollout_dot_general` (which reads the format and the
    granularity from each quantized kernel, so one hook serves every recipe).
    """
    return rollout_dot_general if get_recipe(recipe).quantizes else jax.lax.dot_general
