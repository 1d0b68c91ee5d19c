"""The fixed-order (batch-invariant) CPU kernels of `fixed_order.cc`, as jax functions.

Each function computes its outputs by the documented sequence of float32 operations in
`fixed_order.cc`'s header, per row (token), so a row's result does not depend on the other rows,
tokens or cache slots of the call: the learner's packed forward and the rollout's prefill and
cached decode get bitwise-equal values from them. `qurl_jax.models.exact` builds the model's
exact numerics on these (`train.on_policy_numerics = 'exact'`); tests hold each against a NumPy
reference summed in the same order.

Float32 only; the kernels need AVX2 + FMA (`available`). No gradients here: the model's exact
path gives each one the default path's backward (`models.exact`).

`on_cpu` picks a kernel in a program for CPU devices and another formulation elsewhere;
`row_tiles` is that formulation's device for TPU and GPU: one fixed-shape program per tile of
`TILE_ROWS` rows, so a row's result does not depend on how many rows the call has as long as the
compiler picks one algorithm per shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import cpu_kernels

_TARGETS = (("qurl_fixed_matmul", "QurlFixedMatmul"),
            ("qurl_fixed_matmul_e4m3", "QurlFixedMatmulE4M3"),
            ("qurl_fixed_rms_norm", "QurlFixedRmsNorm"),
            ("qurl_fixed_attention", "QurlFixedAttention"),
            ("qurl_fixed_logprobs", "QurlFixedLogprobs"))


# Rows per tile of the accelerator formulation (a multiple of the MXU's and tensor cores' tiles).
TILE_ROWS = 128


def on_cpu(cpu: Callable[..., Any], other: Callable[..., Any], *args: Any) -> Any:
    """cpu(*args) in a program for CPU devices, other(*args) elsewhere (the platform the program
    is lowered for, not this process's default backend)."""
    return jax.lax.platform_dependent(*args, cpu=cpu, default=other)


def row_tiles(fn: Callable[..., jax.Array], x: jax.Array, *rest: jax.Array) -> jax.Array:
    """fn over x[M, ...] (and row-aligned `rest`) in tiles of TILE_ROWS rows, one `lax.map`
    iteration each behind optimization barriers, so every tile runs the same [TILE_ROWS, ...]
    program whatever M is (the formulation for TPU and GPU)."""
    m = x.shape[0]
    tiles = -(-m // TILE_ROWS)

    def pad(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, tiles * TILE_ROWS - m)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(tiles, TILE_ROWS, *a.shape[1:])

    def one(parts: tuple[jax.Array, ...]) -> jax.Array:
        return jax.lax.optimization_barrier(fn(*jax.lax.optimization_barrier(parts)))

    out = jax.lax.map(one, tuple(pad(a) for a in (x, *rest)))
    return out.reshape(tiles * TILE_ROWS, *out.shape[2:])[:m]


def available() -> bool:
    """True when the kernels are built, registered and this CPU has AVX2 and FMA (one set of
    targets: the library picks its AVX512 or AVX2 loops itself, with the same bits)."""
    return bool(cpu_kernels.load("fixed_order.cc", "qurl_cpu_supports_fixed_order",
                                 (("avx2", _TARGETS),)))


def _call(target: str, shape: tuple[int, ...], *args: jax.Array, **attrs) -> jax.Array:
    if not available():
        raise ValueError("exact on-policy numerics on a CPU need qurl_jax's fixed-order kernels "
                         "(a C++ compiler and a CPU with AVX2 and FMA; QURL_JAX_CPU_KERNELS is not "
                         "0): see the warning above")
    out = jax.ShapeDtypeStruct(shape, jnp.float32)
    return jax.ffi.ffi_call(target, out, vmap_method="sequential")(*args, **attrs)


def matmul(a: jax.Array, b: jax.Array, *, transposed: bool = False) -> jax.Array:
    """f32[..., N] = a f32[..., K] @ b f32[K, N] (transposed: b is f32[N, K]): each output the
    fused multiply-add chain over k = 0..K-1 from 0."""
    lead, k = a.shape[:-1], a.shape[-1]
    n = b.shape[0] if transposed else b.shape[1]
    out = _call("qurl_fixed_matmul", (math.prod(lead), n), a.reshape(-1, k).astype(jnp.float32),
                b.astype(jnp.float32), transposed=np.int64(transposed))
    return out.reshape(*lead, n)


def matmul_e4m3(a: jax.Array, a_scale: jax.Array, b_codes: jax.Array, b_scale: jax.Array,
                block_n: int) -> jax.Array:
    """The block-scaled FP8 product f32[M, N]: a f32[M, G * g] (activation code values),
    a_scale f32[M, G], b_codes float8_e4m3fn[G * g, N], b_scale f32[G, ceil(N / block_n)].

    P_G = the fused chain over group G's g contraction rows from 0; the result is the sum over
    G = 0, 1, ... from 0 of (P_G * a_scale[:, G]) * b_scale[G, n // block_n]."""
    bits = jax.lax.bitcast_convert_type(b_codes, jnp.uint8)
    return _call("qurl_fixed_matmul_e4m3", (a.shape[0], b_codes.shape[1]),
                 a.astype(jnp.float32), a_scale.astype(jnp.float32), bits,
                 b_scale.astype(jnp.float32), block_n=np.int64(block_n))


def rms_norm(x: jax.Array, gain: jax.Array, eps: float) -> jax.Array:
    """f32[..., E]: gain * (x * (1 / sqrt(S / E + eps))), S the sum of x * x in 16 lanes (lane l
    takes elements l, l + 16, ... by fused multiply-adds from 0) added in the fixed tree."""
    e = x.shape[-1]
    out = _call("qurl_fixed_rms_norm", (x.size // e, e), x.reshape(-1, e).astype(jnp.float32),
                gain.astype(jnp.float32), eps=np.float32(eps))
    return out.reshape(x.shape)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              k_valid: jax.Array, q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """Grouped-query attention f32[B, T, H, D] of q f32[B, T, H, D] over k, v f32[B, Hkv, S, D]:
    query t sees the slots s with k_valid, k_pos <= q_pos[t] and k_seg == q_seg[t], in slot
    order (D a multiple of 16). A query with none gets zeros. See `fixed_order.cc` for the
    order of every sum."""
    i32 = jnp.int32
    scale = np.float32(1.0 / math.sqrt(q.shape[-1]))
    return _call("qurl_fixed_attention", q.shape, q.astype(jnp.float32), k.astype(jnp.float32),
                 v.astype(jnp.float32), q_pos.astype(i32), k_pos.astype(i32),
                 k_valid.astype(jnp.bool_), q_seg.astype(i32), k_seg.astype(i32), scale=scale)


def logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array | float) -> jax.Array:
    """f32[...]: log softmax(logits / temperature)[targets] for logits f[..., V] and targets
    i32[...]: (z_t - max z) - log(S), S the sum of Exp(z - max z) in 16 lanes and the tree, the
    log taken in double and rounded."""
    v = logits.shape[-1]
    lead = logits.shape[:-1]
    out = _call("qurl_fixed_logprobs", (math.prod(lead),),
                logits.reshape(-1, v).astype(jnp.float32), targets.reshape(-1).astype(jnp.int32),
                jnp.asarray(temperature, jnp.float32))
    return out.reshape(lead)
