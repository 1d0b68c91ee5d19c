"""Packed response log-probs with the LM head on the response slots only (fewer slots than packed
positions) equal the head on every packed position read at the slots: values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.learner import packing
from qurl_jax.learner.learner import packed_response_logprobs
from qurl_jax.models import ModelConfig, Transformer, init_params

CFG = ModelConfig(model_type="llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                  tie_word_embeddings=True, attention="dense")


def test_head_on_response_slots_equals_head_on_every_position():
    rng = np.random.default_rng(0)
    b, p, g = 6, 9, 4
    prompt = rng.integers(3, p + 1, b)
    resp = rng.integers(1, g + 1, b)
    mask = np.concatenate([np.arange(p)[None] >= (p - prompt)[:, None],
                           np.arange(g)[None] < resp[:, None]], axis=1)
    tokens = rng.integers(0, CFG.vocab_size, (b, p + g)).astype(np.int32)
    rows_needed = packing.rows_needed(mask, 16, 1)
    host = packing.pack(tokens, mask, g, 16, num_slices=1, num_rows=rows_needed,
                        resp_mask=mask[:, p:].astype(np.float32))
    rows = {k: jnp.asarray(host.arrays[k])
            for k in ("tokens", "positions", "segment_ids", "attn_mask")}
    index = jnp.asarray(host.arrays["resp_index"])  # [b, g] slots into the packed positions
    # The same slots followed by padding columns (reading position 0) until they outnumber the
    # packed positions: the head then runs on every position and the slots are read after it.
    extra = -(-rows["tokens"].size // index.size)
    wide = jnp.concatenate([index] + [jnp.zeros_like(index)] * extra, axis=1)
    assert index.size < rows["tokens"].size <= wide.size
    model = Transformer(CFG)
    params = init_params(CFG, jax.random.key(1))
    real = jnp.asarray(mask[:, p:])
    weights = jnp.where(real, jnp.asarray(rng.normal(size=(b, g)), jnp.float32), 0.0)

    def objective(params, idx):
        logp, entropy = packed_response_logprobs(model, params, rows, idx, 0.8, chunk=3,
                                                 with_entropy=True)
        logp, entropy = logp[:, :g], entropy[:, :g]
        return jnp.sum(weights * (logp + 0.1 * entropy)), (logp, entropy)

    grad = jax.jit(jax.value_and_grad(objective, has_aux=True))
    (value_a, (logp_a, ent_a)), grads_a = grad(params, index)
    (value_b, (logp_b, ent_b)), grads_b = grad(params, wide)
    np.testing.assert_allclose(np.asarray(logp_a)[mask[:, p:]], np.asarray(logp_b)[mask[:, p:]],
                               atol=2e-6)
    np.testing.assert_allclose(np.asarray(ent_a)[mask[:, p:]], np.asarray(ent_b)[mask[:, p:]],
                               atol=2e-6)
    np.testing.assert_allclose(value_a, value_b, rtol=1e-5)
    for a, c in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
