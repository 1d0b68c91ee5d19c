"""An int8 matmul kernel for XLA:CPU (AVX512-VNNI or AVX2): AQT's raw int8 product for decode.

`int8_dot_general` has the signature of `jax.lax.dot_general` and is what the int8 recipe's AQT
config uses for its s8 x s8 -> s32 product (`DotGeneralRaw.dot_general`). On an x86 CPU, for a
product of at most `max_rows()` rows (decode: one row per sequence) of x[M, K] @ w[K, N], it calls
the FFI custom call `qurl_int8_matmul` (`qurl_jax/cpu_kernels/int8_matmul.cc`), or on a CPU
without AVX512-VNNI its AVX2 path `qurl_int8_matmul_avx2` (`kernel_isa`); everything else, and
every other platform, goes to `lax.dot_general`. Results are bit-identical on either path
(integer arithmetic).

Why: XLA:CPU's int8 GEMM is compute-bound at decode batch sizes (~60-90 GMAC/s on 2 cores), so an
int8 decode step was only ~1.4x the float32 one although it reads a quarter of the bytes; the
kernel streams each weight tile once through VNNI dot-products (AVX2: 16-bit multiply-adds).

The kernel is compiled from source on first use (`qurl_jax.cpu_kernels`). Without a compiler, on
a CPU without AVX2, or with `QURL_JAX_CPU_KERNELS=0` (`QURL_JAX_CPU_ISA=none`), a warning is
logged once and XLA's own product is used; `QURL_JAX_CPU_ISA=avx2` takes the AVX2 path on an
AVX512 CPU.

For the decode loop, `pack_int8` stores a kernel's codes in the kernel's tile layout (the same
for both paths) once per rollout (the sampler does this as loop-invariant work); the product on
packed codes, `packed_int8_dot_general`, then streams the weights contiguously with no per-call
repacking (about 2x faster again at batch 8).

On a CPU with AMX-INT8 tiles XLA's own int8 GEMM runs on the tile unit, and from a few dozen rows
on it beats the kernel (`AMX_MAX_ROWS`): there the kernel takes decode products of at most 16 rows,
and a decode loop of more rows keeps its codes unpacked for XLA (`packs_for_decode`).
`QURL_JAX_CPU_ISA=avx512` takes an AVX512 CPU's choice (64 rows) on such a CPU.

Limits: the custom call is not partitionable, so under a multi-device mesh XLA gathers its
operands (correct, not fast); prefill-sized products (more than `max_rows()` rows) use XLA's GEMM.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax import cpu_kernels
from qurl_jax.quant._qtensor import QuantizedTensor
from qurl_jax.quant._recipes import QuantFormat

# The custom calls of each path: (row-major product, packed product, pack).
_TARGETS = {"avx512": ("qurl_int8_matmul", "qurl_int8_matmul_packed", "qurl_int8_pack"),
            "avx2": ("qurl_int8_matmul_avx2", "qurl_int8_matmul_packed_avx2",
                     "qurl_int8_pack_avx2")}
_SYMBOLS = {"avx512": ("QurlInt8Matmul", "QurlInt8MatmulPacked", "QurlInt8Pack"),
            "avx2": ("QurlInt8MatmulAvx2", "QurlInt8MatmulPackedAvx2", "QurlInt8PackAvx2")}
MAX_ROWS = 64
# With AMX-INT8, XLA's int8 GEMM against the packed kernel at SmolLM2's decode shapes (576 wide,
# 960 / 576 / 3,072 / 576 / 49,152 outputs; 2-core Intel Xeon with AMX, 2026-11-30): the kernel
# took 0.53-0.88x XLA's time at 8 rows, 0.84-1.33x at 16, 0.88-2.10x at 32 and 1.24-3.19x at 64.
AMX_MAX_ROWS = 16
# Smaller kernels stay on XLA's int8 dot: for them the custom call's fixed cost is not repaid
# (measured on the embedded default's 128-wide model, where the kernel made the int8 rollout
# slower than fp32).
MIN_KERNEL_ELEMENTS = 1 << 16
PACK_TILE = 64  # columns per packed tile
_LINEAR_DIMS = (((1,), (0,)), ((), ()))


def kernel_isa() -> str:
    """The kernel's path this process uses: 'avx512' (VNNI), 'avx2', or '' when the kernel is
    not built, loaded and supported by this CPU (`qurl_jax.cpu_kernels.load`)."""
    return cpu_kernels.load("int8_matmul.cc", "qurl_int8_matmul_isa", tuple(
        (path, tuple(zip(_TARGETS[path], _SYMBOLS[path], strict=True))) for path in _TARGETS))


def _amx() -> bool:
    """Whether XLA's int8 GEMM runs on AMX tiles here (`runtime.xla_cpu.cpu_isa() == 'amx'`)."""
    from qurl_jax.runtime.xla_cpu import cpu_isa

    return cpu_isa() == "amx"


def max_rows() -> int:
    """The most rows of an unpacked product the kernel takes on this CPU: `MAX_ROWS`, or
    `AMX_MAX_ROWS` where XLA's int8 GEMM runs on AMX tiles."""
    return AMX_MAX_ROWS if _amx() else MAX_ROWS


def kernel_available() -> bool:
    """True when the kernel is built, loaded, registered and supported by this CPU."""
    return bool(kernel_isa())


def _is_int8_linear(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_dtype: Any,
                    kwargs: dict[str, Any]) -> bool:
    """x s8[M, K] contracted with w s8[K, N] on K, no batch axes, int32 out: the kernel's op."""
    return (lhs.ndim == 2 and rhs.ndim == 2 and lhs.dtype == jnp.int8 and rhs.dtype == jnp.int8
            and jnp.dtype(out_dtype) == jnp.int32
            and tuple(map(tuple, dimension_numbers[0])) == _LINEAR_DIMS[0]
            and not any(dimension_numbers[1]) and not kwargs)


def _target(which: int, isa: str | None = None) -> str:
    """The custom call `which` (0: product, 1: packed product, 2: pack) of path `isa` (default:
    `kernel_isa()`'s)."""
    default = kernel_isa()  # builds and registers every path this CPU runs
    return _TARGETS[isa or default][which]


def _kernel_product(lhs: jax.Array, rhs: jax.Array, packed: bool = False,
                    isa: str | None = None) -> jax.Array:
    """s8[M, K] x s8[K, N] (row-major, or `packed`) -> s32[M, N] on the kernel's path `isa`
    (default: the process's)."""
    target = _target(int(packed), isa)
    out_type = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1]), jnp.int32)
    return jax.ffi.ffi_call(target, out_type, vmap_method="sequential")(lhs, rhs)


def can_pack(shape: tuple[int, ...]) -> bool:
    """Whether a [K, N] int8 kernel can be stored in the kernel's packed layout (same shape)."""
    return len(shape) == 2 and shape[0] % 4 == 0 and shape[1] % PACK_TILE == 0


def pack_int8_reference(codes: jax.Array) -> jax.Array:
    """Reorders int8 codes [K, N] into the int8 kernel's tile layout, returned with the same shape.

    packed[t][kg][j][L][i][r] = codes[4 kg + r, 64 t + 16 L + 4 j + i] ^ 0x80
    (see qurl_jax/cpu_kernels/int8_matmul.cc): each 64-column tile becomes contiguous, each 4-row
    group of a column becomes 4 adjacent bytes, and the codes are shifted to unsigned (VNNI's
    unsigned operand), so the kernel streams the weights once per product with no per-call
    repacking. The array keeps shape [K, N] (so it still fits the model's parameter shapes) but
    only the packed product may read it. This is the definition in jnp (slow on CPU: a 6-D
    transpose); `pack_int8` computes the same with the kernel library.
    """
    k, n = codes.shape
    if not can_pack(codes.shape):
        raise ValueError(f"pack_int8: shape {codes.shape} needs K % 4 == 0 and N % {PACK_TILE} "
                         f"== 0")
    tiled = codes.reshape(k // 4, 4, n // PACK_TILE, 4, 4, 4)  # [kg, r, t, L, j, i]
    packed = tiled.transpose(2, 0, 4, 3, 5, 1).reshape(k, n)
    return jnp.bitwise_xor(packed, jnp.int8(-128))  # flips the top bit: w + 128 as a u8 pattern


def pack_int8(codes: jax.Array, isa: str | None = None) -> jax.Array:
    """`pack_int8_reference` on the kernel library (memory-bound; ~10x faster on CPU), on path
    `isa` (default: the process's; both give the same bytes)."""
    if not can_pack(codes.shape) or codes.dtype != jnp.int8:
        raise ValueError(f"pack_int8: needs int8 [K, N] with K % 4 == 0 and N % {PACK_TILE} == 0, "
                         f"got {codes.dtype}{codes.shape}")
    if not kernel_available():
        raise RuntimeError("pack_int8: the int8 kernel is unavailable; do not pack")
    out_type = jax.ShapeDtypeStruct(codes.shape, jnp.int8)
    return jax.ffi.ffi_call(_target(2, isa), out_type, vmap_method="sequential")(codes)


def packed_int8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                            precision: Any = None, preferred_element_type: Any = None,
                            **kwargs: Any) -> jax.Array:
    """s8[M, K] x packed s8[K, N] (`pack_int8`) -> s32[M, N] on the int8 kernel (any M).

    Unlike `int8_dot_general` there is no fallback: the packed codes mean nothing to another
    product, so anything but the kernel's one pattern is an error."""
    del precision
    out_dtype = preferred_element_type or jnp.int32
    if not (_is_int8_linear(lhs, rhs, dimension_numbers, out_dtype, kwargs)
            and can_pack(rhs.shape) and lhs.shape[1] == rhs.shape[0]):
        raise ValueError(
            f"packed_int8_dot_general: needs int8 x[M, K] @ packed int8 w[K, N] -> int32 with "
            f"dimension_numbers {_LINEAR_DIMS}; got lhs {lhs.dtype}{lhs.shape}, rhs "
            f"{rhs.dtype}{rhs.shape}, {dimension_numbers}, preferred {preferred_element_type}"
        )
    if not kernel_available():
        raise RuntimeError("packed_int8_dot_general: the int8 kernel is unavailable; do not "
                           "pack")
    return _kernel_product(lhs, rhs, packed=True)


def int8_dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                     precision: Any = None, preferred_element_type: Any = None,
                     **kwargs: Any) -> jax.Array:
    """`lax.dot_general` whose decode-shaped s8[M, K] x s8[K, N] -> s32 products on CPU run on the
    int8 kernel (see module docstring)."""
    xla = functools.partial(jax.lax.dot_general, dimension_numbers=dimension_numbers,
                            precision=precision, preferred_element_type=preferred_element_type,
                            **kwargs)
    # Without preferred_element_type an int8 product is int8, which the kernel does not make.
    eligible = (
        _is_int8_linear(lhs, rhs, dimension_numbers, preferred_element_type or lhs.dtype, kwargs)
        and lhs.shape[0] <= max_rows() and rhs.size >= MIN_KERNEL_ELEMENTS
    )
    # Which branch runs follows the platform the program is lowered for (`platform_dependent`):
    # a CPU host compiling for a TPU or GPU gets XLA's product. The default-backend test only
    # keeps an accelerator host from building the kernel; its programs for CPU devices then use
    # XLA's product too (correct, slower).
    if not (eligible and jax.default_backend() == "cpu" and kernel_available()):
        return xla(lhs, rhs)
    return jax.lax.platform_dependent(lhs, rhs, cpu=_kernel_product, default=xla)


def _packable(x: Any) -> bool:
    return (isinstance(x, QuantizedTensor) and not x.packed and x.format is QuantFormat.INT8
            and x.act_format is QuantFormat.INT8 and x.is_per_channel(0) and can_pack(x.shape)
            and x.qvalue.size >= MIN_KERNEL_ELEMENTS)


def packs_for_decode(rows: int) -> bool:
    """Whether a decode loop of `rows` rows should read packed codes (`pack_for_decode`): yes,
    except on an AMX CPU for more than `AMX_MAX_ROWS` rows, where XLA's product is the faster
    one (on other CPUs the packed kernel is kept at any rows)."""
    return rows <= AMX_MAX_ROWS or not _amx()


def pack_for_decode(params: Any) -> Any:
    """Rollout parameters for a decode loop: every int8 W8A8 kernel the int8 kernel can read is
    stored packed (`pack_int8`, `QuantizedTensor.packed`); the packed product then runs on the
    kernel at any rows (`packs_for_decode` says for which loops to). Traceable; meant to run once
    per rollout, outside the loop. Returns `params` unchanged when the default backend is not the
    CPU or the kernel is unavailable. Callers pack only in programs for CPU devices (the sampler:
    when its platform, its mesh's devices', is 'cpu'); packed codes mean nothing to another
    platform."""
    if jax.default_backend() != "cpu" or not kernel_available():
        return params
    is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
    return jax.tree.map(
        lambda x: x.replace(qvalue=pack_int8(x.qvalue), packed=True) if _packable(x) else x,
        params, is_leaf=is_q,
    )
