"""The rollout's KV-cache precision: keys and values stored as 8-bit codes with a scale each.

`KVPrecision` names how a sampler's cache holds its keys and values:

- BF16: in the model's compute dtype, unquantized (the name is the usual one; a float32 model
  keeps float32).
- INT8: int8 codes, round(x / s) with s = max|x| / 127 over head_dim.
- FP8: float8_e4m3fn codes, x / s cast with s = max|x| / 448 (e4m3's largest finite value); the
  same bytes as int8, relative precision for small values, and what H100 kernels take natively.

Granularity: one float32 scale per token and kv head (absmax over head_dim), the layout JAX's
GPU paged kernel reads (`k_scales_pages` f32[Hkv, P, page_size]) and the TPU one takes through
`QuantizedTensor`. A per-page scale would store 1/page_size of the scales but let one outlier
token coarsen every token of its page; per token costs 4 bytes per 2 x head_dim code bytes of
K and V (head_dim 128: 8-bit KV with scales is 0.516x of bf16, 64: 0.531x).

Or one scale per sequence, layer and kv head (`KVScale.SEQUENCE`, `rollout.kv_scale='sequence'`),
set where the sequence's first tokens are written (prefill or insert: max|x| over its tokens and
head_dim) and kept for every later token, whose codes are clipped to it. A kernel can then apply
the scales outside itself (keys' on the query, values' on the output), which is how JAX's TPU paged
kernel reads plain 8-bit pages without the float32 scale array its wrapper would broadcast to the
pages' shape (`models.decode_attention`). The scales are still stored per token (the sequence's
value in each of its slots), so every cache layout, insert and reader is the same for both
granularities. The cost is accuracy: one outlier token coarsens its sequence's codes, and a later
token past the prompt's range is clipped (measured in docs/paged_kv.md).

Quantization happens once, where a key or value is written (prefill, insert, each decode step);
a page is never re-quantized. Readers dequantize (codes x scale, then the compute dtype), so the
rollout's own distribution, and with it `logp_behav`, includes the error: ACR / TIS correct it
like the weights' (the learner and evaluation keep full-precision caches).
"""

from __future__ import annotations

import enum
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.quant import keep_rounded

_INT8_MAX = 127.0
_FP8_MAX = float(jnp.finfo(jnp.float8_e4m3fn).max)  # 448


class KVPrecision(enum.StrEnum):
    """How a cache stores keys and values (`rollout.kv_precision`)."""

    BF16 = "bf16"
    INT8 = "int8"
    FP8 = "fp8"

    @property
    def quantizes(self) -> bool:
        return self is not KVPrecision.BF16

    def storage_dtype(self, compute_dtype: Any) -> Any:
        """The dtype of the cache's k / v buffers."""
        return {KVPrecision.BF16: compute_dtype, KVPrecision.INT8: jnp.int8,
                KVPrecision.FP8: jnp.float8_e4m3fn}[self]

    def bytes_per_token(self, num_kv_heads: int, head_dim: int, compute_dtype: Any) -> int:
        """Bytes of one token's keys and values in one layer, scales included."""
        codes = 2 * num_kv_heads * head_dim * jnp.dtype(self.storage_dtype(compute_dtype)).itemsize
        return codes + (2 * num_kv_heads * 4 if self.quantizes else 0)


class KVScale(enum.StrEnum):
    """What one scale of an 8-bit cache covers (`rollout.kv_scale`)."""

    TOKEN = "token"
    SEQUENCE = "sequence"


def _member(kind: type[enum.StrEnum], value: Any, field: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{field}={value!r} must be one of "
                         f"{[m.value for m in kind]}") from None


def kv_scale(value: KVScale | str) -> KVScale:
    """`value` as a KVScale; ValueError naming the choices."""
    return _member(KVScale, value, "kv_scale")


def kv_precision(value: KVPrecision | str) -> KVPrecision:
    """`value` as a KVPrecision; ValueError naming the choices."""
    return _member(KVPrecision, value, "kv_precision")


def _code_max(dtype: Any) -> float:
    if jnp.dtype(dtype) == jnp.int8:
        return _INT8_MAX
    if jnp.dtype(dtype) == jnp.float8_e4m3fn:
        return _FP8_MAX
    raise ValueError(f"KV codes must be int8 or float8_e4m3fn; got {jnp.dtype(dtype)}")


def quantize_kv(x: jax.Array, dtype: Any, scale: jax.Array | None = None
                ) -> tuple[jax.Array, jax.Array]:
    """x f[..., D] -> (codes dtype[..., D], scales f32[...]): one scale per vector over D, or
    the given `scale` (f32, broadcastable to x.shape[:-1]; returned at that shape).

    An all-zero vector (a pad's value) gets scale 0 and zero codes. The division is in float32
    and the codes are clipped to the code range, so rounding at max|x| (or a value past a given
    scale's range) never overflows (an e4m3 overflow would be NaN)."""
    top = _code_max(dtype)
    x32 = x.astype(jnp.float32)
    if scale is None:
        scale = jnp.max(jnp.abs(x32), axis=-1) / top
    else:
        scale = jnp.broadcast_to(jnp.asarray(scale, jnp.float32), x.shape[:-1])
    inv = jnp.where(scale > 0, 1.0 / jnp.where(scale > 0, scale, 1.0), 0.0)
    y = jnp.clip(x32 * inv[..., None], -top, top)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return keep_rounded(y.astype(dtype)), scale


def dequantize_kv(codes: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """codes [..., D], scale f32[...] -> codes x scale in `dtype` (computed in float32)."""
    return (codes.astype(jnp.float32) * scale[..., None]).astype(dtype)


def sequence_scales(x: jax.Array, valid: jax.Array, dtype: Any) -> jax.Array:
    """One scale per row and kv head for `KVScale.SEQUENCE`: x f[B, Hkv, T, D], valid bool[B, T]
    -> f32[B, Hkv, 1], max|x| over the row's valid tokens and head_dim / the code range (0 for a
    row with no valid token)."""
    amax = jnp.max(jnp.where(valid[:, None, :, None], jnp.abs(x.astype(jnp.float32)), 0.0),
                   axis=(2, 3))
    return (amax / _code_max(dtype))[..., None]
