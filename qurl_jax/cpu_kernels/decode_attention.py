"""Decode attention on the CPU kernel `decode_attention.cc`, as the model's `decode_attention` hook.

The kernel has an AVX512 path and an AVX2 path (with FMA; `kernel_isa` says which this process
uses, `QURL_JAX_CPU_ISA` caps it: `qurl_jax.cpu_kernels`).

`Transformer(config, decode_attention=decode_attention)` computes the attention of a one-token
step against its KV cache with this kernel instead of XLA's two batched products: it reads only
the slots in use (up to the fullest row's; the cache's later slots are still empty during a
rollout) and streams each key and value once. The sampler's decode loop uses it when
`usable(compute_dtype, head_dim)` holds. Scores, softmax and the weighted sum are float32, as in
the model; results match XLA's path to float32 rounding (the summation order differs).

An int8 cache (`rollout.kv_precision='int8'`) is read as its codes and per-slot scales
(`k_scale`, `v_scale`), dequantized in registers: 1 byte per cached element read instead of 4.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import cpu_kernels

# Each path's custom calls: (float cache, int8 cache).
_TARGETS = {"avx512": ("qurl_decode_attention", "qurl_decode_attention_int8"),
            "avx2": ("qurl_decode_attention_avx2", "qurl_decode_attention_int8_avx2")}
_SYMBOLS = {"avx512": ("QurlDecodeAttention", "QurlDecodeAttentionInt8"),
            "avx2": ("QurlDecodeAttentionAvx2", "QurlDecodeAttentionInt8Avx2")}


def kernel_isa() -> str:
    """The kernel's path this process uses: 'avx512', 'avx2' (AVX2 with FMA), or '' when it is
    not built, registered and supported by this CPU (`qurl_jax.cpu_kernels.load`)."""
    return cpu_kernels.load("decode_attention.cc", "qurl_decode_attention_isa", tuple(
        (path, tuple(zip(_TARGETS[path], _SYMBOLS[path], strict=True))) for path in _TARGETS))


def available() -> bool:
    """True when the kernel is built, registered and this CPU has AVX512F or AVX2 with FMA."""
    return bool(kernel_isa())


def usable(compute_dtype: jnp.dtype, head_dim: int) -> bool:
    """Whether a model with this compute dtype and head size can use the kernel in a program for
    CPU devices (the caller checks its program's platform, e.g. the sampler's mesh's devices',
    not this process's default backend: a CPU host may compile for a TPU, and the reverse)."""
    return (jnp.dtype(compute_dtype) == jnp.float32 and head_dim % 16 == 0 and available())


def decode_attention(q: jax.Array, keys: jax.Array, values: jax.Array, key_mask: jax.Array,
                     length: jax.Array, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None, *, isa: str | None = None) -> jax.Array:
    """Grouped-query attention of one query position per row.

    q: f32[B, Hkv, G, D]; keys, values: f32[B, Hkv, S, D], or int8 codes s8[B, Hkv, S, D] with
    k_scale, v_scale f32[B, Hkv, S] (`models.kv_quant`: key = code x scale); key_mask:
    bool[B, S]; length: i32 scalar, slots [0, length) are read (the model passes the largest
    `n_used` of the batch after this step's write; a row's slots past its own are empty, so
    masked). Returns f32[B, Hkv, G, D]. A row without any valid slot gets zeros. isa: the
    kernel's path (default: `kernel_isa()`'s).
    """
    b, hkv, g, d = q.shape
    default = kernel_isa()  # builds and registers every path this CPU runs
    target, target_int8 = _TARGETS[isa or default]
    if k_scale is not None:
        s = keys.shape[2]
        if not (keys.dtype == values.dtype == jnp.int8 and q.dtype == jnp.float32
                and d % 16 == 0 and keys.shape == values.shape == (b, hkv, s, d)
                and k_scale.shape == v_scale.shape == (b, hkv, s)
                and key_mask.shape == (b, s)):
            raise ValueError(
                f"decode_attention: an int8 cache needs f32 q[B, Hkv, G, D], s8 keys/values"
                f"[B, Hkv, S, D] with D % 16 == 0, scales f32[B, Hkv, S] and key_mask[B, S]; "
                f"got q {q.dtype}{q.shape}, keys {keys.dtype}{keys.shape}, k_scale "
                f"{k_scale.shape}, key_mask {key_mask.shape}")
        call = jax.ffi.ffi_call(target_int8, jax.ShapeDtypeStruct(q.shape, jnp.float32),
                                vmap_method="sequential")
        return call(q, keys, values, k_scale.astype(jnp.float32), v_scale.astype(jnp.float32),
                    key_mask.astype(jnp.bool_), jnp.asarray(length, jnp.int32),
                    scale=np.float32(1.0 / math.sqrt(d)))
    if not (q.dtype == keys.dtype == values.dtype == jnp.float32 and d % 16 == 0
            and keys.shape == values.shape == (b, hkv, keys.shape[2], d)
            and key_mask.shape == (b, keys.shape[2])):
        raise ValueError(
            f"decode_attention: needs f32 q[B, Hkv, G, D] and keys/values[B, Hkv, S, D] with "
            f"D % 16 == 0 and key_mask[B, S]; got q {q.dtype}{q.shape}, keys "
            f"{keys.dtype}{keys.shape}, values {values.dtype}{values.shape}, key_mask "
            f"{key_mask.shape}"
        )
    out_type = jax.ShapeDtypeStruct(q.shape, jnp.float32)
    call = jax.ffi.ffi_call(target, out_type, vmap_method="sequential")
    return call(q, keys, values, key_mask.astype(jnp.bool_),
                jnp.asarray(length, jnp.int32), scale=np.float32(1.0 / math.sqrt(d)))


# The model hands this hook an 8-bit cache's codes and scales (rather than the values
# dequantized) when the codes are of these dtypes (`models.transformer.Attention`).
decode_attention.reads_codes = (jnp.dtype(jnp.int8),)
