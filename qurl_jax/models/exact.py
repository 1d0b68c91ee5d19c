"""Exact on-policy numerics: every value that feeds a quantizer or a log-prob in one fixed order.

`ModelConfig.numerics = 'exact'` (`train.on_policy_numerics`) makes the learner's packed forward
and the rollout's prefill and cached decode (static, refilling, paged) compute bitwise-equal
hidden states, logits and log-probs for the same tokens, so pi_behav == pi_prox exactly for the
same parameters (fp32, and the unified fp8_block flow, whose FP8 activation codes then agree
too). Both sides run the one model (`transformer.py`); under 'exact' it routes the ops whose
reduction order XLA chooses per shape through functions whose order is fixed per row (token):

- products (`products`): every linear layer and the LM head, float or block-scaled FP8;
- the RMSNorm reduction (`rms_norm`);
- attention over a query's keys in their sequence's order (`attention`), whatever the layout:
  a packed learner row with segments, a left-padded prefill, a dense or paged decode cache;
- the log-softmax over the vocabulary (`token_logprobs`), the learner's and the sampler's.

The rest is elementwise (embedding gather, RoPE, SiLU, residual adds, casts) and gives the same
bits per element in any program. Measured with `python -m qurl_jax.bench.on_policy`.

On CPU each of these is a fixed-order kernel (`qurl_jax.cpu_kernels.fixed_order`: the order of
every sum is written out there, and tests hold each against NumPy summed in that order), in
float32 whatever the compute dtype (both sides alike); under a multi-device mesh XLA gathers their
operands (correct, not fast: the custom calls are not partitioned). The learner differentiates
through them with the default path's backward (`_default_backward`: a `jax.custom_vjp` whose
forward is the exact op and whose backward is the VJP of the op it replaces), so gradients are the
default path's up to rounding.

On TPU and GPU (compiled for `tpu:v5p-8` and `gpu:h100-1`; on one H200, 96.4% of an outlier
model's fp8_block tokens came out bitwise equal, not all: docs/jet_rl.md) products,
norms and log-probs run in fixed tiles of rows (`fixed_order.row_tiles`): every tile is the same
program whatever the batch, so a row's result depends on the compiler's choice for that one shape
(on GPU with autotuning off, `--xla_gpu_autotune_level=0`, and no split-K); attention is XLA's,
whose key reduction follows each layout's own blocking, so it is NOT invariant there: a Pallas
kernel that walks a query's keys in position order with a fixed split size (the batch-invariant
kernels of vLLM and Thinking Machines) is what those backends still need (docs/jet_rl.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qurl_jax.cpu_kernels import fixed_order
from qurl_jax.models import attention as attn_lib

DotGeneral = Callable[..., jax.Array]


def _default_backward(exact: Callable[..., Any], default: Callable[..., Any]
                      ) -> Callable[..., Any]:
    """`exact` in the forward, the VJP of `default` (same arguments, same result up to
    rounding) in the backward; integer arguments get no gradient."""
    fn = jax.custom_vjp(exact)

    def fwd(*args: Any) -> tuple[Any, tuple[Any, ...]]:
        return exact(*args), args

    def bwd(args: tuple[Any, ...], g: Any) -> tuple[Any, ...]:
        return jax.vjp(default, *args)[1](g)

    fn.defvjp(fwd, bwd)
    return fn


# ------------------------------------------------------------------------------------ products
def _matmul(x: jax.Array, w: jax.Array, transposed: bool) -> jax.Array:
    """f32[..., N] = x f32[..., K] @ w ([K, N], or [N, K] when transposed) in the fixed order."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)

    def cpu(x2: jax.Array, w: jax.Array) -> jax.Array:
        return fixed_order.matmul(x2, w, transposed=transposed)

    def other(x2: jax.Array, w: jax.Array) -> jax.Array:
        dims = (((1,), (1 if transposed else 0,)), ((), ()))
        return fixed_order.row_tiles(lambda t: jax.lax.dot_general(
            t, w, dims, preferred_element_type=jnp.float32), x2)

    out = fixed_order.on_cpu(cpu, other, x2.astype(jnp.float32), w.astype(jnp.float32))
    return out.reshape(*lead, out.shape[-1])


def exact_dot_general(inner: DotGeneral, lhs: jax.Array, rhs: Any, dimension_numbers: Any,
                      precision: Any = None, preferred_element_type: Any = None,
                      **kwargs: Any) -> jax.Array:
    """The model's product hook under exact numerics, around the hook `inner` it replaces.

    A float kernel (rhs [K, N] contracting axis 0, or [N, K] contracting axis 1: the tied head)
    runs the fixed-order matmul, differentiated like `inner`'s product. A quantized kernel
    (`quant.QuantizedTensor`, `quant.TrainKernel`) goes to `inner(..., exact=True)`: the quant
    hooks then run the fixed-order block-scaled product. Returns f[..., N] in lhs's dtype (or
    `preferred_element_type`)."""
    if not isinstance(rhs, jax.Array):
        return inner(lhs, rhs, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type, exact=True, **kwargs)
    (lc, rc), (lb, rb) = dimension_numbers
    if lb or rb or tuple(lc) != (lhs.ndim - 1,) or len(rc) != 1 or rhs.ndim != 2:
        raise ValueError(f"exact numerics: the product of lhs {lhs.shape} and rhs {rhs.shape} "
                         f"with dimension_numbers={dimension_numbers} is not a linear layer's")
    out_dtype = preferred_element_type or lhs.dtype
    transposed = int(rc[0]) == 1

    def exact(x: jax.Array, w: jax.Array) -> jax.Array:
        return _matmul(x, w, transposed).astype(out_dtype)

    def default(x: jax.Array, w: jax.Array) -> jax.Array:
        return inner(x, w, dimension_numbers, precision=precision,
                     preferred_element_type=preferred_element_type, **kwargs).astype(out_dtype)

    return _default_backward(exact, default)(lhs, rhs)


def products(inner: DotGeneral) -> DotGeneral:
    """`inner` (the model's `dot_general` hook) under exact numerics (`exact_dot_general`)."""
    return functools.partial(exact_dot_general, inner)


# ------------------------------------------------------------------------------------- RMSNorm
def rms_norm(x: jax.Array, gain: jax.Array, eps: float,
             default: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """gain * (x * (1 / sqrt(mean(x * x) + eps))) over x's last axis in the fixed order, f32;
    `default(x, gain)` is the op it replaces (its VJP is the gradient)."""

    def cpu(x: jax.Array, gain: jax.Array) -> jax.Array:
        return fixed_order.rms_norm(x, gain, eps)

    def other(x: jax.Array, gain: jax.Array) -> jax.Array:
        e = x.shape[-1]
        return fixed_order.row_tiles(lambda t: default(t, gain), x.reshape(-1, e)).reshape(x.shape)

    def exact(x: jax.Array, gain: jax.Array) -> jax.Array:
        return fixed_order.on_cpu(cpu, other, x.astype(jnp.float32), gain.astype(jnp.float32))

    return _default_backward(exact, default)(x, gain)


# ----------------------------------------------------------------------------------- attention
def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
              k_valid: jax.Array, implementation: str,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """`attention.attention`'s contract (q f[B, T, H, D]; k, v f[B, Hkv, S, D]; positions,
    validity, optional segment ids of packed self-attention) with each query's allowed keys
    reduced in slot order, which is their sequence's order in every layout
    (`cpu_kernels.fixed_order.attention`). Its gradient is `implementation`'s."""
    packed = segment_ids is not None
    if packed:
        q_seg = k_seg = segment_ids
    else:
        q_seg, k_seg = jnp.zeros(q_pos.shape, jnp.int32), jnp.zeros(k_pos.shape, jnp.int32)

    def default(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                k_valid: jax.Array, q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
        del k_seg
        return attn_lib.attention(q, k, v, q_pos, k_pos, k_valid, implementation,
                                  segment_ids=q_seg if packed else None)

    def cpu(*args: jax.Array) -> jax.Array:
        return fixed_order.attention(*args).astype(q.dtype)

    def exact(*args: jax.Array) -> jax.Array:
        return fixed_order.on_cpu(cpu, default, *args)

    return _default_backward(exact, default)(q, k, v, q_pos, k_pos, k_valid, q_seg, k_seg)


# ----------------------------------------------------------------------------------- log-probs
def token_logprobs(logits: jax.Array, targets: jax.Array, temperature: jax.Array | float,
                   default: Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
                   ) -> jax.Array:
    """f32[...] log softmax(logits / temperature)[targets] in the fixed order (logits f[..., V]);
    `default(logits, targets, temperature)` is the op it replaces (its VJP is the gradient)."""
    temperature = jnp.asarray(temperature, jnp.float32)

    def cpu(logits: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
        return fixed_order.logprobs(logits, targets, temperature)

    def other(logits: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
        v = logits.shape[-1]
        out = fixed_order.row_tiles(lambda lt, tt: default(lt, tt, temperature),
                         logits.reshape(-1, v), targets.reshape(-1))
        return out.reshape(targets.shape)

    def exact(logits: jax.Array, targets: jax.Array, temperature: jax.Array) -> jax.Array:
        return fixed_order.on_cpu(cpu, other, logits.astype(jnp.float32), targets.astype(jnp.int32),
                       temperature)

    return _default_backward(exact, default)(logits, targets, temperature)
