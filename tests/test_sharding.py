"""Sharding: logical axes -> mesh specs, and a sharded forward pass equals the unsharded one.

Uses the 8 host CPU devices that conftest.py requests, as a (data=2, fsdp=2, tensor=2) mesh.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from qurl_jax.models import ModelConfig, Transformer, init_params, param_logical_axes
from qurl_jax.parallel.sharding import batch_sharding, logical_to_mesh_spec, make_mesh, shard_params

CONFIG = ModelConfig(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return make_mesh(data=2, fsdp=2, tensor=2)


@pytest.mark.parametrize("logical,shape,expected", [
    (P("embed", "heads"), (32, 32), P("fsdp", "tensor")),
    (P("vocab", "embed"), (96, 32), P("tensor", "fsdp")),
    (P("vocab", "embed"), (97, 32), P(None, "fsdp")),       # 97 not divisible by tensor=2
    (P("embed", "mlp"), (31, 64), P(None, "tensor")),       # 31 not divisible by fsdp=2
    (P("batch", "length"), (4, 5), P(("data", "fsdp"), None)),
    (P("batch", "length"), (2, 5), P("data", None)),        # 2 rows: data only, fsdp dropped
    (P("norm"), (32,), P(None)),
])
def test_logical_to_mesh_spec(mesh, logical, shape, expected):
    assert logical_to_mesh_spec(logical, shape, mesh) == expected


def test_sharded_params_give_same_logits(mesh):
    rng = np.random.RandomState(0)
    shapes = jax.eval_shape(functools.partial(init_params, CONFIG), jax.random.key(0))
    params = jax.tree.map(lambda x: jnp.asarray(0.2 * rng.standard_normal(x.shape), jnp.float32)
                          + (1.0 if x.ndim == 1 else 0.0), shapes)  # norm gains (and biases) ~1
    sharded = shard_params(params, param_logical_axes(CONFIG), mesh)

    q = sharded["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert q.sharding.spec == P("fsdp", "tensor")
    assert {s.data.shape for s in q.addressable_shards} == {(16, 16)}

    tokens = jnp.asarray(rng.randint(0, CONFIG.vocab_size, (4, 6)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(6, dtype=jnp.int32), (4, 6))
    apply = jax.jit(Transformer(CONFIG).apply)
    expected, _ = apply({"params": params}, tokens, positions)
    tokens_s = jax.device_put(tokens, batch_sharding(mesh, 2))
    positions_s = jax.device_put(positions, batch_sharding(mesh, 2))
    got, _ = apply({"params": sharded}, tokens_s, positions_s)
    assert len(got.sharding.device_set) == 8
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5)
