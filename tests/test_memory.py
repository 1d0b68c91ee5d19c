"""Learner memory grows linearly with the sequence: a regression to materialised [T, T] attention
scores or whole [tokens, vocab] logits fails here. Programs are compiled, never run."""

import jax
import jax.numpy as jnp
import pytest

from qurl_jax import sharding as shd
from qurl_jax.bench import memory
from qurl_jax.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.rl.objectives import ObjectiveConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=4096, hidden_size=64, intermediate_size=128,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)
ROWS = 2


def _temp_bytes(learner: Learner, length: int) -> dict[str, int]:
    """Compiled temp bytes of the update and the log-prob recomputation at T = length."""
    params, opt_state = learner.abstract_state(
        jax.eval_shape(lambda: init_params(CFG, jax.random.key(0))))
    g = 3 * length // 4

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=shd.batch_sharding(learner.mesh, len(shape)))

    batch = {"tokens": spec((ROWS, length), jnp.int32),
             "positions": spec((ROWS, length), jnp.int32),
             "attn_mask": spec((ROWS, length), jnp.bool_),
             "resp_mask": spec((ROWS, g), jnp.float32), "logp_behav": spec((ROWS, g), jnp.float32)}
    logprobs = learner.logprobs_fn(params, batch).lower(params, batch).compile()
    batch.update(logp_prox=spec((ROWS, g), jnp.float32), advantages=spec((ROWS,), jnp.float32))
    update = learner.update_fn(params, opt_state, batch).lower(params, opt_state, batch).compile()
    return {"update": memory.compiled_memory(update)["temp_bytes"],
            "logprobs": memory.compiled_memory(logprobs)["temp_bytes"]}


@pytest.mark.parametrize("remat", ["full", "none"])
def test_temp_memory_grows_linearly_with_length(remat):
    learner = Learner(CFG, ObjectiveConfig(entropy_coef=0.01), OptimConfig(), shd.make_mesh(),
                      remat=remat, logprob_chunk=256)
    short, long = _temp_bytes(learner, 2048), _temp_bytes(learner, 8192)
    for program in ("update", "logprobs"):
        # 4x the length: linear growth is 4x, materialised attention scores would be 16x.
        growth = long[program] / short[program]
        assert growth < 5.0, f"{program}: temp grew {growth:.1f}x for 4x the length ({short}, {long})"
    # The logits of all response tokens in f32 would be ROWS * G * V * 4 = 151 MB at T = 8192;
    # in chunks of 256 positions the logits cost ~ROWS * 256 * V * 4 = 8 MB per array.
    whole_logits = ROWS * (3 * 8192 // 4) * CFG.vocab_size * 4
    assert long["update"] < whole_logits / 2, long
    assert long["logprobs"] < whole_logits / 4, long
