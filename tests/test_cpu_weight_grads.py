"""`models.cpu_weight_grads.dot_general`: `lax.dot_general`'s values and gradients (float32),
the weight gradient through either transposed operand; other products passed through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.models import Transformer, cpu_weight_grads, init_params
from tests.test_sampler import TINY


@pytest.mark.parametrize("x_shape,w_shape,contract", [
    ((4, 7, 16), (16, 48), 0),   # Linear, in < out: x^T copied
    ((4, 7, 48), (48, 16), 0),   # Linear, in > out: g^T copied, the [out, in] result transposed
    ((3, 5, 16), (40, 16), 1),   # the tied head [V, E]: g^T copied
    ((2, 3, 64), (8, 64), 1),    # [out, in] kernel with few tokens: x^T, the result transposed
    ((6, 16), (16, 16), 0),      # 2-D input
])
def test_values_and_gradients_equal_lax(x_shape, w_shape, contract) -> None:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
    w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)
    dims = (((x.ndim - 1,), (contract,)), ((), ()))

    def loss(dot):
        return lambda x, w: jnp.sum(jnp.sin(dot(x, w, dims)))

    want = jax.value_and_grad(loss(jax.lax.dot_general), argnums=(0, 1))(x, w)
    got = jax.jit(jax.value_and_grad(loss(cpu_weight_grads.dot_general), argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for g, ref in zip(got[1], want[1], strict=True):
        assert g.shape == ref.shape
        np.testing.assert_allclose(g, ref, rtol=1e-5, atol=1e-5)


def test_other_products_are_lax_dot_general() -> None:
    a = jnp.ones((2, 3, 4))
    b = jnp.ones((2, 4, 5))
    batched = (((2,), (1,)), ((0,), (0,)))
    np.testing.assert_array_equal(cpu_weight_grads.dot_general(a, b, batched),
                                  jax.lax.dot_general(a, b, batched))
    codes = jnp.ones((4, 5), jnp.int8)  # an integer kernel (quantized paths) is not wrapped
    out = cpu_weight_grads.dot_general(jnp.ones((3, 4), jnp.int8), codes, (((1,), (0,)), ((), ())),
                                       preferred_element_type=jnp.int32)
    assert out.dtype == jnp.int32 and int(out[0, 0]) == 4


def test_a_models_gradients_equal_lax() -> None:
    cfg = TINY["qwen2"].replace(tie_word_embeddings=True, num_layers=1)
    params = init_params(cfg, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (3, 9))

    def loss(dot):
        model = Transformer(cfg, dot)
        return lambda p: jnp.mean(jax.nn.log_softmax(
            model.apply({"params": p}, tokens, positions)[0])[..., 0])

    want = jax.jit(jax.grad(loss(jax.lax.dot_general)))(params)
    got = jax.jit(jax.grad(loss(cpu_weight_grads.dot_general)))(params)
    for (path, g), ref in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                              strict=True):
        np.testing.assert_allclose(g, ref, rtol=2e-5, atol=1e-6, err_msg=str(path))
