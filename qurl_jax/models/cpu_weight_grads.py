"""Weight gradients of the model's products in layouts XLA:CPU multiplies without copies.

The model's linear layers and tied head are `dot_general(x, w, ...)` with x f[..., n] and a 2-D
kernel w (Linear: [in, out], contracting w's dim 0; the tied head: the embedding [V, E],
contracting dim 1). Their weight gradient sums over every token, dW = x^T g. XLA:CPU lowers that
product with one operand copied to a transposed layout, and fuses the copy into the producer of
the output gradient g. Measured on a 2-core Xeon (AVX512 + VNNI): in the embedded default's
warm-start step the SiLU backward written transposed ([384, 896] f32) took 2.4-2.7 ms, and such
copies were 27% of the step; in the SmolLM2-135M-shaped update (`bench.learner --vs_torch`'s)
3.0 of its 16 s. With this product: that update 16.1 -> 13.9 s (1.16x, A B B A, medians of 3;
the copies 0.9 s), peak memory +0.15 GB; the warm-start step 29.8 -> 25.0 ms.

`dot_general` here is `lax.dot_general` with a custom VJP whose weight gradient is a plain
row-major product of a transposed operand made explicitly, behind `lax.optimization_barrier`
(without it XLA folds the transpose back into the product's dimension numbers): x^T [in, N] @ g
[N, out], or g^T [out, N] @ x [N, in] (then the small [out, in] result transposed where the
kernel is [in, out]), whichever copies fewer elements. Forward values and the input gradient are
`lax.dot_general`'s; the weight gradient is the same sum in another order (float rounding).
Every other product (batch dimensions, a kernel that is not 2-D, other contractions) is
`lax.dot_general` unchanged. For XLA:CPU only: on TPU and GPU the compilers fuse transposes into
their products, and the barrier would only stop them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def dot_general(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any,
                precision: Any = None, preferred_element_type: Any = None, **kwargs: Any
                ) -> jax.Array:
    """`jax.lax.dot_general`, with the weight gradient of a 2-D kernel's product (x's last
    dimension against one of the kernel's) computed as a plain product (module docstring)."""
    (lc, rc), (lb, rb) = dimension_numbers
    if (rhs.ndim != 2 or lb or rb or tuple(lc) != (lhs.ndim - 1,) or len(rc) != 1
            or kwargs or not jnp.issubdtype(rhs.dtype, jnp.floating)):
        return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type, **kwargs)
    return _kernel_product(lhs, rhs, int(rc[0]), precision, preferred_element_type)


def _forward(x, w, contract, precision, preferred):
    return jax.lax.dot_general(x, w, (((x.ndim - 1,), (contract,)), ((), ())),
                               precision=precision, preferred_element_type=preferred)


def _product_fwd(x, w, contract, precision, preferred):
    return _forward(x, w, contract, precision, preferred), (x, w)


def _product_bwd(contract, precision, preferred, res, g):
    x, w = res
    free = 1 - contract  # the kernel's output dimension
    dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (free,)), ((), ())), precision=precision,
                             preferred_element_type=preferred).astype(x.dtype)
    xs = x.reshape(-1, x.shape[-1])
    gs = g.reshape(-1, g.shape[-1])
    n, k_in, k_out = xs.shape[0], xs.shape[1], gs.shape[1]
    # The kernel's gradient in w's layout: [in, out] (contract == 0) or [out, in].
    # x^T g copies n * in elements (+ in * out to transpose a [out, in] kernel's result);
    # g^T x copies n * out (+ in * out for an [in, out] kernel).
    x_first = n * k_in + (k_in * k_out if contract == 1 else 0)
    g_first = n * k_out + (k_in * k_out if contract == 0 else 0)
    if x_first <= g_first:
        dw = jnp.matmul(jax.lax.optimization_barrier(xs.T), gs, precision=precision,
                        preferred_element_type=preferred)  # [in, out]
        dw = dw if contract == 0 else dw.T
    else:
        dw = jnp.matmul(jax.lax.optimization_barrier(gs.T), xs, precision=precision,
                        preferred_element_type=preferred)  # [out, in]
        dw = dw.T if contract == 0 else dw
    return dx, dw.astype(w.dtype)


_kernel_product = jax.custom_vjp(_forward, nondiff_argnums=(2, 3, 4))
_kernel_product.defvjp(_product_fwd, _product_bwd)
