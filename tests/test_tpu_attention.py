"""Pallas TPU flash attention (`attention.pallas_tpu_attention`, `model.attention=pallas_tpu`).

Numerics: the kernel runs in Pallas' TPU interpret mode on the CPU and is compared with dense
attention in float32 (outputs to 1e-5, gradients to 1e-4 absolute) on left-padded, unpadded and
GQA inputs. Compile: `pallas_tpu` lowered for a TPU v5e device needs no more temporary memory
than blockwise, and `auto` on a sharded TPU program stays blockwise, which XLA can partition
(skipped without libtpu).
"""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.models import attention as attn
from qurl_jax.models.transformer import positions_from_mask
from qurl_jax.parallel import targets

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _inputs(b=2, t=16, h=4, hkv=2, d=8):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32)
    k = jax.random.normal(kk, (b, hkv, t, d), jnp.float32)
    v = jax.random.normal(kv, (b, hkv, t, d), jnp.float32)
    mask = jnp.arange(t)[None, :] >= jnp.array([5, 0])[:, None]  # row 0 left-padded by 5
    return q, k, v, positions_from_mask(mask), mask


def _value_and_grads(fn, q, k, v, pos, mask):
    """Outputs and d(loss)/d(q, k, v) of a loss over the real query rows only."""
    def loss(q, k, v):
        out = fn(q, k, v, pos, pos, mask)
        return jnp.sum(jnp.where(mask[:, :, None, None], out, 0.0) ** 2), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def test_interpret_mode_matches_dense_with_padding_and_gqa():
    q, k, v, pos, mask = _inputs()
    want, want_grads = _value_and_grads(attn.dot_product_attention, q, k, v, pos, mask)
    got, got_grads = _value_and_grads(
        lambda *a: attn.pallas_tpu_attention(*a, interpret=True), q, k, v, pos, mask)
    real = np.asarray(mask)[:, :, None, None]
    np.testing.assert_allclose(np.where(real, got, 0), np.where(real, want, 0), atol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)
    assert np.isfinite(np.asarray(got)).all()  # pad query rows too


def test_auto_off_tpu_runs_blockwise(monkeypatch):
    # Lowered for the CPU, auto's TPU branch is never taken: the result is blockwise attention.
    monkeypatch.setattr(attn, "AUTO_BLOCKWISE_MIN_KEYS", 8)
    q, k, v, pos, mask = _inputs()
    got = attn.attention(q, k, v, pos, pos, mask, "auto", causal_by_index=True)
    want = attn.blockwise_attention(q, k, v, pos, pos, mask)
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_rejects_cross_attention():
    q, k, v, pos, mask = _inputs()
    with pytest.raises(ValueError, match="T == S"):
        attn.pallas_tpu_attention(q[:, :1], k, v, pos[:, :1], pos, mask)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install -e .[tpu-compile])")
def test_kernel_compiles_for_tpu_within_blockwise_memory():
    dev = targets.parse("tpu:v5e-4").devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(dev)
    b, t, h, hkv, d = 1, 1280, 2, 1, 128
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    args = (spec((b, t, h, d), jnp.bfloat16), spec((b, hkv, t, d), jnp.bfloat16),
            spec((b, hkv, t, d), jnp.bfloat16), spec((b, t), jnp.int32), spec((b, t), jnp.bool_))

    def compiled(impl):
        def loss(q, k, v, pos, mask):
            out = attn.attention(q, k, v, pos, pos, mask, impl, causal_by_index=True)
            return jnp.sum(out.astype(jnp.float32) ** 2)

        fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
        # conftest asks for 'highest' float32 matmuls; Mosaic rejects that on bf16 operands.
        with jax.default_matmul_precision("default"):
            return fn.trace(*args).lower(lowering_platforms=("tpu",)).compile()

    auto, blockwise = compiled("pallas_tpu"), compiled("blockwise")
    assert "tpu_custom_call" in auto.as_text()
    assert "tpu_custom_call" not in blockwise.as_text()
    assert (auto.memory_analysis().temp_size_in_bytes
            <= blockwise.memory_analysis().temp_size_in_bytes)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install -e .[tpu-compile])")
def test_auto_on_a_sharded_tpu_program_compiles():
    # A learner's attention is batch-sharded over the mesh; XLA cannot partition a Mosaic kernel
    # ("Mosaic kernels cannot be automatically partitioned"), so `auto` must not lower it there.
    devices = np.array(targets.parse("tpu:v5e-4").devices())
    mesh = jax.sharding.Mesh(devices, ("rows",))
    b, t, h, hkv, d = 4, 1280, 2, 1, 128

    def spec(shape, dtype):
        pspec = jax.sharding.PartitionSpec("rows", *([None] * (len(shape) - 1)))
        return jax.ShapeDtypeStruct(shape, dtype, sharding=jax.sharding.NamedSharding(mesh, pspec))

    args = (spec((b, t, h, d), jnp.bfloat16), spec((b, hkv, t, d), jnp.bfloat16),
            spec((b, hkv, t, d), jnp.bfloat16), spec((b, t), jnp.int32), spec((b, t), jnp.bool_))

    def loss(q, k, v, pos, mask):
        out = attn.attention(q, k, v, pos, pos, mask, "auto", causal_by_index=True)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.default_matmul_precision("default"):
        jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(*args).lower(
            lowering_platforms=("tpu",)).compile()
