"""Block-scaled quantized tensors and the AQT quantizers that produce them.

A `QuantizedTensor` stores a 2-D kernel as low-precision codes (int8 or float8_e4m3fn) in the
kernel's own layout plus one float32 scale per block, so that `kernel ~= codes * scale`. One layout
covers every granularity the recipes use: per output channel is a block of (all input rows x 1
column), DeepSeek-V3 / Jet-RL weight blocks are 128x128. The rounding itself is AQT's: an
`AbsMaxCalibration` scale (max |x| of the block / largest code) and AQT's `IntSymmetric` (round to
nearest even, clip to +-127) or `Fp8Numerics` (clip to +-448, round to nearest E4M3) numerics.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from aqt.jax.v2 import aqt_quantizer, aqt_tensor

from qurl_jax.quant._recipes import QuantFormat


def aqt_quantizer_for(fmt: QuantFormat) -> aqt_quantizer.Quantizer:
    """AQT quantizer for `fmt` with abs-max calibration.

    int8 uses `preserve_max_val=True`, i.e. scale = max|x| / 127 and codes in [-127, 127] (AQT's
    default maps max|x| to 127.5 and clips, which loses the largest value of every channel).
    """
    return aqt_quantizer.quantizer_make(fmt.value, preserve_max_val=True, scale_dtype=jnp.float32)


def quantize_groups(x: jax.Array, fmt: QuantFormat,
                    axes: Sequence[int]) -> tuple[jax.Array, jax.Array]:
    """Quantizes x with one scale per slice over `axes`.

    Returns (codes of x.shape in fmt.dtype, f32 scales of x.shape with `axes` reduced to 1).

    """
    qt, _ = aqt_quantizer_for(fmt).quant(x.astype(jnp.float32), calibration_axes=list(axes))
    return keep_rounded(qt.qvalue), qt.scale[0]


def keep_rounded(codes: jax.Array) -> jax.Array:
    """`codes` behind an optimization barrier when they are floats (FP8): XLA:GPU may drop a
    float -> float8 -> float round trip inside one program (its excess precision, on by default),
    which leaves the codes unrounded wherever the same program widens them again (an emulated
    product, a dequantize, a comparison of codes). Seen on an H100: `update_capture` compared
    unrounded codes (99% changed instead of 12%), the learner's FP8 products were off their
    emulation by up to 3%. Integer codes are exact once rounded and pass unchanged."""
    if jnp.issubdtype(codes.dtype, jnp.floating):
        return jax.lax.optimization_barrier(codes)
    return codes


def quantize_row_groups(x: jax.Array, fmt: QuantFormat,
                        group: int) -> tuple[jax.Array, jax.Array]:
    """Quantizes each row of x[M, K] in groups of `group` consecutive columns (1 x group blocks).

    K is zero-padded to a multiple of `group`; zeros change neither a group's max |x| nor any
    product. An all-zero group gets codes 0 (AQT calibrates it with max |x| = 1), never NaN.
    Returns (codes [M, G * group] in fmt.dtype, f32 scales [M, G]), G = ceil(K / group).
    """
    m, k = x.shape
    ng = math.ceil(k / group)
    x = x.astype(jnp.float32)
    if ng * group != k:
        x = jnp.pad(x, ((0, 0), (0, ng * group - k)))
    codes, scale = quantize_groups(x.reshape(m, ng, group), fmt, (2,))
    return codes.reshape(m, ng * group), scale[..., 0]


def quantize_column_groups(x: jax.Array, fmt: QuantFormat,
                           group: int) -> tuple[jax.Array, jax.Array]:
    """`quantize_row_groups(x.T, fmt, group)` left in x's layout: each column of x[M, K] in
    groups of `group` consecutive rows (group x 1 blocks), M zero-padded to whole groups.

    Returns (codes [G * group, K] in fmt.dtype, f32 scales [G, K]), G = ceil(M / group): the
    transposes of `quantize_row_groups(x.T, ...)`'s, bit for bit (the same quantizer per
    element, the same maximum per group), without transposing x's float32 values."""
    m, k = x.shape
    ng = math.ceil(m / group)
    x = x.astype(jnp.float32)
    if ng * group != m:
        x = jnp.pad(x, ((0, ng * group - m), (0, 0)))
    codes, scale = quantize_groups(x.reshape(ng, group, k), fmt, (1,))
    return codes.reshape(ng * group, k), scale[:, 0]


@flax.struct.dataclass
class QuantizedTensor:
    """A frozen low-precision kernel for the rollout model.

    qvalue: int8 | float8_e4m3fn[R, C]  codes in the float kernel's layout ([in, out] for linears).
    scale: f32[ceil(R / block[0]), ceil(C / block[1])]  one per block; kernel ~= qvalue * scale.
    block:  (rows, cols) of a scale block, already shrunk to the kernel's shape (static).
    act_format: format the activations are quantized to before the product; None = weight-only
      (static).
    packed: qvalue holds the codes reordered for the CPU int8 kernel (`pack_for_decode`); same
      shape, but only that kernel's product can read it (static).
    transposed: qvalue and scale hold the bytes of the kernel's transpose ([out, in] codes for a
      linear layer, row-major: `transpose_for_gpu`), viewed with the kernel's own shapes so that
      the parameter tree keeps its shapes; `stored()` is the transpose itself (a reshape, no
      copy). `shape`, `ndim` and `dequantize` give the kernel; the product reads `stored()`
      (static).
    """

    qvalue: jax.Array
    scale: jax.Array
    block: tuple[int, int] = flax.struct.field(pytree_node=False)
    act_format: QuantFormat | None = flax.struct.field(pytree_node=False)
    packed: bool = flax.struct.field(pytree_node=False, default=False)
    transposed: bool = flax.struct.field(pytree_node=False, default=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.qvalue.shape)

    @property
    def ndim(self) -> int:
        return self.qvalue.ndim

    @property
    def format(self) -> QuantFormat:
        return QuantFormat.INT8 if self.qvalue.dtype == jnp.int8 else QuantFormat.FP8_E4M3

    @property
    def nbytes(self) -> int:
        return self.qvalue.size * self.qvalue.dtype.itemsize + self.scale.size * 4

    def is_per_channel(self, contracting_axis: int) -> bool:
        """True when one scale covers the whole contracting axis (one scale per output channel)."""
        other = 1 - contracting_axis
        full = self.block[contracting_axis] == self.shape[contracting_axis]
        return full and self.block[other] == 1

    def expanded_scale(self) -> jax.Array:
        """f32[R, C]: every element's scale."""
        s = jnp.repeat(jnp.repeat(self.scale, self.block[0], axis=0), self.block[1], axis=1)
        return s[: self.shape[0], : self.shape[1]]

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """[R, C] kernel reconstructed from the codes, in `dtype`."""
        if self.packed:
            raise ValueError("QuantizedTensor.dequantize: the codes are packed for the CPU int8 "
                             "kernel; dequantize the unpacked rollout parameters instead")
        if self.transposed:
            return self.stored().dequantize(dtype).T
        return (self.qvalue.astype(jnp.float32) * self.expanded_scale()).astype(dtype)

    def stored(self) -> QuantizedTensor:
        """The tensor as its codes lie in memory: itself, or for a `transposed` one the
        kernel's transpose (codes [C, R], scales and block transposed; reshapes of the stored
        arrays, no copy)."""
        if not self.transposed:
            return self
        r, c = self.qvalue.shape
        scale = self.scale.reshape(self.scale.shape[::-1])
        return QuantizedTensor(self.qvalue.reshape(c, r), scale, self.block[::-1],
                               self.act_format, self.packed)

    def store_transposed(self) -> QuantizedTensor:
        """The same kernel with its codes stored transposed (`transposed`): one copy of the codes
        in the transposed layout, viewed with the kernel's shapes."""
        if self.transposed:
            return self
        return self.replace(qvalue=self.qvalue.T.reshape(self.qvalue.shape),
                            scale=self.scale.T.reshape(self.scale.shape), transposed=True)

    def codes_as(self, dtype: Any) -> QuantizedTensor:
        """The same tensor with its codes held in a float `dtype` (exact: int8 and E4M3 values are
        bf16 and f32 values), for a weight-only product on CPU: XLA:CPU does not fuse the cast of
        int8 codes into a product, so a decode loop would cast the whole kernel every step."""
        if self.act_format is not None or self.packed:
            raise ValueError("QuantizedTensor.codes_as: only weight-only, unpacked codes are "
                             "products of their values in any dtype")
        return self.replace(qvalue=self.qvalue.astype(dtype))

    def to_aqt(self, contracting_axis: int = 0) -> aqt_tensor.QTensor:
        """The same tensor as an AQT `QTensor` (per-channel only), for AQT's serving dot_general."""
        if not self.is_per_channel(contracting_axis):
            raise ValueError(
                f"QuantizedTensor with block {self.block} and shape {self.shape} is not "
                f"per-channel along contracting axis {contracting_axis}; AQT's QTensor needs one "
                f"scale per channel"
            )
        return aqt_tensor.QTensor(
            qvalue=self.qvalue, scale=[self.scale], scale_t=None, bias=[],
            dequant_dtype=jnp.float32,
        )


def quantize_kernel(w: jax.Array, fmt: QuantFormat, block: tuple[int, int],
                    act_format: QuantFormat | None, sharded: bool = False) -> QuantizedTensor:
    """Quantizes a 2-D kernel w[R, C] with one scale per (block[0] x block[1]) block.

    Blocks larger than the kernel shrink to it; ragged edges are padded with zeros, which changes
    neither a block's max |w| nor any product. `sharded`: w is split over devices, so blocks of
    several rows are found in two stages (`_quantize_blocks_in_two_stages`: the same codes and
    scales, without gathering w; on one CPU device about 2.8x slower than tiling).
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_kernel: kernel must be 2-D, got shape {w.shape}")
    r, c = w.shape
    br, bc = min(block[0], r), min(block[1], c)
    nr, nc = math.ceil(r / br), math.ceil(c / bc)
    x = w.astype(jnp.float32)
    if sharded and 1 < br < r and bc > 1 and all(d % _STAGE == 0 for d in (r, c, br, bc)) and (
            nr * br, nc * bc) == (r, c):
        return _quantize_blocks_in_two_stages(x, fmt, (br, bc), act_format)
    if (nr * br, nc * bc) != (r, c):
        x = jnp.pad(x, ((0, nr * br - r), (0, nc * bc - c)))
    # Tiles [nr, br, nc, bc], one scale per (i, :, j, :). Unit axes are dropped first: XLA:CPU
    # reduces a [1, K, N, 1] view ~8x slower than the same data as [K, N] (per-channel case).
    tiled = (nr, br, nc, bc)
    keep = [i for i, d in enumerate(tiled) if d != 1]
    axes = tuple(keep.index(i) for i in (1, 3) if i in keep)
    codes, scale = quantize_groups(x.reshape(tuple(tiled[i] for i in keep)), fmt, axes)
    codes = codes.reshape(nr * br, nc * bc)[:r, :c]
    return QuantizedTensor(codes, scale.reshape(nr, nc), (br, bc), act_format)


# Rows and columns folded into a partial block maximum first (`_quantize_blocks_in_two_stages`);
# the FSDP and tensor shards of the models' kernels are multiples of it.
_STAGE = 8


def _quantize_blocks_in_two_stages(x: jax.Array, fmt: QuantFormat, block: tuple[int, int],
                                   act_format: QuantFormat | None) -> QuantizedTensor:
    """`quantize_kernel` of a kernel tiled by weight blocks of several rows (Jet-RL's 128 x 128),
    written so that a sharded kernel moves scales, not weights: a learner's FSDP shard (e.g. 192
    rows of a 1536-row kernel over 8 devices) does not line up with 128-row blocks, and tiling
    the kernel [R/128, 128, C/128, 128] made XLA gather the float32 weights (or their |w|) to
    find each block's maximum. Here each device folds its own rows and columns in groups of
    `_STAGE` first (a shard-aligned reshape), the small [R/8, C/8] partial maxima give the
    blocks' maxima, AQT calibrates the scales from those (the same max |x|, so the same scales)
    and quantizes each g x g group of elements with its block's scale, picked by index. What a
    sharded kernel gathers is then at most the [R/8, C/8] partial maxima or group scales in
    float32, 1/16 byte per weight. The codes and scales equal the tiled path's."""
    r, c = x.shape
    br, bc = block
    nr, nc = r // br, c // bc
    g = _STAGE
    partial = jnp.abs(x).reshape(r // g, g, c // g, g).max(axis=(1, 3))
    amax = partial.reshape(nr, br // g, nc, bc // g).max(axis=(1, 3))
    quantizer = aqt_quantizer_for(fmt)
    qt = quantizer.calibrate(amax[:, None, :, None], calibration_axes=[1, 3])
    scale = qt.scale[0].reshape(nr, nc)
    # Each g x g group's block scale, picked by index: at most [R/8, C/8] floats, never [R, C].
    groups = jnp.take(jnp.take(scale, jnp.arange(0, r, g) // br, axis=0),
                      jnp.arange(0, c, g) // bc, axis=1)
    qt, _ = quantizer.calculate_qvalue(x.reshape(r // g, g, c // g, g), dataclasses.replace(
        qt, scale=[groups[:, None, :, None]]))
    return QuantizedTensor(keep_rounded(qt.qvalue).reshape(r, c), scale, (br, bc), act_format)
