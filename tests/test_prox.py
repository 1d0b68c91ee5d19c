"""pi_prox from the update's own forward (`learner.prox`): the same objective, gradients, metrics
and updated parameters as the separate recompute, and the recompute kept wherever it is needed."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.learner.prox import ProxSource, prox_source
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig, sparse_rl_rejections

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
B, P, G = 8, 6, 5


def _batch(params, seed: int = 0) -> dict[str, jax.Array]:
    """A padded batch whose behaviour log-probs sit around the model's own, spread wide enough
    that the cap truncates, the clip binds and Sparse-RL's veto and band both drop tokens."""
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, P + 1, B)
    resp_len = rng.integers(1, G + 1, B)
    attn = np.concatenate([np.arange(P)[None] >= (P - prompt_len)[:, None],
                           np.arange(G)[None] < resp_len[:, None]], axis=1)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (B, P + G)), jnp.int32),
        "positions": jnp.asarray(np.maximum(np.cumsum(attn, 1) - 1, 0), jnp.int32),
        "attn_mask": jnp.asarray(attn),
        "resp_mask": jnp.asarray(attn[:, P:], jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }
    own = _learner(ObjectiveConfig()).logprobs(params, batch)
    batch["logp_behav"] = own + jnp.asarray(rng.uniform(-1.5, 1.5, (B, G)), jnp.float32)
    return batch


def _learner(objective: ObjectiveConfig, **kw) -> Learner:
    return Learner(CFG, objective, OptimConfig(learning_rate=1e-2, weight_decay=0.1),
                   shd.make_mesh(), temperature=0.9, **kw)


def _same_loss_gradients_metrics(learner: Learner, params, batch_a, batch_b):
    """`Learner.loss` on two batches: equal loss, gradients and metrics (float rounding);
    returns both metric dicts."""
    grad = jax.jit(jax.value_and_grad(learner.loss, has_aux=True))
    (loss_a, metrics_a), grads_a = grad(params, batch_a)
    (loss_b, metrics_b), grads_b = grad(params, batch_b)
    np.testing.assert_allclose(loss_b, loss_a, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    for k, v in metrics_a.items():
        np.testing.assert_allclose(metrics_b[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    return metrics_a, metrics_b


OBJECTIVES = {
    "acr": ObjectiveConfig(),
    "tis": ObjectiveConfig(mode="tis", cap=1.5),
    "on_policy": ObjectiveConfig(mode="on_policy", agg="token_mean"),
    "mis": ObjectiveConfig(mode="mis"),
    "sparse_rl": ObjectiveConfig(mode="sparse_rl", veto_tau=0.3, sparse_mask_band=(0.5, 1.5),
                                 sparse_base="acr"),
    "kl_entropy": ObjectiveConfig(kl_coef=0.1, entropy_coef=0.01),
}


# ACR (the default) and Sparse-RL (its counts move into the update) in the default suite; the
# other objectives are slow tests (a compile each).
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=() if n in ("acr", "sparse_rl") else pytest.mark.slow)
    for n in OBJECTIVES])
def test_objective_gradients_and_metrics_equal_the_recompute(name):
    objective = OBJECTIVES[name]
    learner = _learner(objective)
    params = learner.shard_params(init_params(CFG, jax.random.key(0)))
    batch = _batch(params)
    if objective.kl_coef:
        batch["logp_ref"] = batch["logp_behav"] - 0.3
    recomputed = dict(batch, logp_prox=learner.logprobs(params, batch))
    metrics_a, metrics_b = _same_loss_gradients_metrics(learner, params, recomputed, batch)
    # The case is not trivial: tokens are truncated and clipped (and vetoed, band-masked).
    if objective.mode in ("acr", "tis"):
        assert metrics_a["truncated_frac"] > 0 and metrics_a["kl_behav_prox_k3"] > 0.05
    if objective.mode == "sparse_rl":
        expected = sparse_rl_rejections(recomputed["logp_prox"], batch["logp_behav"],
                                        batch["resp_mask"], objective)
        assert expected["vetoed_sequences"] > 0 and expected["band_masked_tokens"] > 0
        for k, v in expected.items():
            np.testing.assert_allclose(metrics_b[f"sparse/{k}"], v, err_msg=k)
    else:
        assert not any(k.startswith("sparse/") for k in metrics_b)


@pytest.mark.parametrize("kw", [
    pytest.param({}, id="padded", marks=pytest.mark.slow),
    pytest.param({"num_micro_batches": 2}, id="micro_batches", marks=pytest.mark.slow),
    pytest.param({"packing": True, "num_micro_batches": 2}, id="packed"),
    pytest.param({"packing": True, "tokens_per_micro_batch": 16}, id="token_budget",
                 marks=pytest.mark.slow),
])
def test_update_equals_the_recompute(kw):
    objective = OBJECTIVES["sparse_rl"]
    lbs = B // kw.get("num_micro_batches", 1)
    params0 = init_params(CFG, jax.random.key(1))
    out = []
    for recompute in (True, False):
        learner = _learner(objective, logprob_batch_size=lbs, **kw)
        params = learner.shard_params(params0)
        opt_state = learner.init_opt_state(params)
        batch = learner.shard_batch(_batch(params, seed=1))
        if recompute:
            batch["logp_prox"] = learner.logprobs(params, batch)
        new_params, _, metrics = learner.update(params, opt_state, batch)
        out.append((jax.device_get(new_params), jax.device_get(metrics)))
    (params_a, metrics_a), (params_b, metrics_b) = out
    for k, v in metrics_a.items():
        np.testing.assert_allclose(metrics_b[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert metrics_a["update/skipped"] == 0 and metrics_a["truncated_frac"] > 0
    assert metrics_b["sparse/vetoed_sequences"] > 0  # summed over micro-batches
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-5)


@pytest.mark.slow  # kept out of the default suite's 15-minute budget
def test_sparse_counts_add_up_over_micro_batches():
    objective = OBJECTIVES["sparse_rl"]
    learner = _learner(objective, num_micro_batches=2)
    params = learner.shard_params(init_params(CFG, jax.random.key(2)))
    batch = _batch(params, seed=2)
    expected = sparse_rl_rejections(learner.logprobs(params, batch), batch["logp_behav"],
                                    batch["resp_mask"], objective)
    _, _, metrics = learner.update(params, learner.init_opt_state(params), batch)
    for k, v in expected.items():
        np.testing.assert_allclose(metrics[f"sparse/{k}"], v, err_msg=k)


@pytest.mark.parametrize("minibatches,epochs,precision", [
    (2, 1, "fp"), (1, 2, "fp"), (4, 3, "fp"), (1, 1, "fp8_block"), (2, 1, "fp8_block"),
])
def test_recompute_where_pi_prox_is_not_the_update_forward(minibatches, epochs, precision):
    source = prox_source(num_minibatches=minibatches, ppo_epochs=epochs, precision=precision)
    assert source.recompute
    assert "separate log-prob pass" in source.describe()
    # Only several minibatches of one float epoch leave the first update's rows out of the pass.
    assert source.skip_first == (minibatches > 1 and epochs == 1 and precision == "fp")
    assert ("first minibatch" in source.describe()) == source.skip_first


def test_one_float_step_takes_pi_prox_from_the_update():
    source = prox_source(num_minibatches=1, ppo_epochs=1, precision="fp")
    assert source == ProxSource(False, source.reason)
    assert "update's own forward" in source.describe()
    with pytest.raises(ValueError, match="num_minibatches"):
        prox_source(num_minibatches=0, ppo_epochs=1)
    with pytest.raises(ValueError, match="skip_first"):
        ProxSource(False, "no pass", skip_first=True)


def test_marked_rows_take_pi_prox_from_the_forward():
    """Rows marked `prox_from_forward` ignore the logp_prox they carry (here garbage) and take the
    update's own forward; unmarked rows keep theirs. Loss, gradients and metrics equal the full
    recompute's, and the Sparse-RL counts the update reports are the marked rows' only."""
    objective = OBJECTIVES["sparse_rl"]
    learner = _learner(objective)
    params = learner.shard_params(init_params(CFG, jax.random.key(3)))
    batch = _batch(params, seed=3)
    logp_prox = learner.logprobs(params, batch)
    marked = jnp.asarray(np.arange(B) % 2 == 0)
    partial = dict(batch, prox_from_forward=marked,
                   logp_prox=jnp.where(marked[:, None], -7.0, logp_prox))
    _, metrics_b = _same_loss_gradients_metrics(learner, params,
                                                dict(batch, logp_prox=logp_prox), partial)
    expected = sparse_rl_rejections(logp_prox, batch["logp_behav"],
                                    batch["resp_mask"] * marked[:, None], objective)
    everyone = sparse_rl_rejections(logp_prox, batch["logp_behav"], batch["resp_mask"],
                                    objective)
    assert 0 < expected["band_masked_tokens"] < everyone["band_masked_tokens"]
    for k, v in expected.items():
        np.testing.assert_allclose(metrics_b[f"sparse/{k}"], v, err_msg=k)


@pytest.mark.slow  # two tiny trainers' compiles
def test_trainer_step_without_the_pass_equals_the_step_with_it(tmp_path):
    """One RL step of a one-minibatch Sparse-RL run: the trainer skips the pi_prox pass (it says
    so at start), and its metrics and updated parameters equal a run forced to recompute."""
    from test_trainer import tiny_config

    from qurl_jax.train.trainer import Trainer

    kw = {"rollout.precision": "int8", "rl.loss_mode": "sparse_rl", "rl.veto_tau": 0.5,
          "rl.sparse_mask_band": (0.9, 1.1), "rl.num_minibatches": 1, "train.num_steps": 1}
    out = []
    for recompute in (True, False):
        t = Trainer(tiny_config(**kw), str(tmp_path / str(recompute)))
        assert not t.prox.recompute
        if recompute:
            t.prox = ProxSource(True, "forced by the test")
        m = t.step()
        assert ("time/logp_recompute_s" in m) == recompute
        out.append((m, jax.device_get(t.params)))
    (m_a, params_a), (m_b, params_b) = out
    for k in ("update/loss", "update/grad_norm", "kl_behav_prox_k3", "raw_is_weight_max",
              "truncated_frac", "is_weight_mean", "masked_token_frac", "vetoed_seq_frac",
              "sparse/vetoed_sequences", "sparse/band_masked_tokens"):
        np.testing.assert_allclose(m_b[k], m_a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert m_a["kl_behav_prox_k3"] > 0  # an int8 rollout: behaviour and proximal differ
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)


@pytest.mark.slow  # two tiny trainers' compiles
@pytest.mark.parametrize("mode", ["acr", "sparse_rl"])
def test_trainer_step_with_the_first_minibatch_from_its_forward(tmp_path, mode):
    """Two minibatches: the pass covers the second minibatch's rows only, the first update takes
    its rows' pi_prox from its own forward; metrics (Sparse-RL's counts of both parts added) and
    updated parameters equal a run forced to recompute every row."""
    from test_trainer import tiny_config

    from qurl_jax.train.trainer import Trainer

    kw = {"rollout.precision": "int8", "rl.loss_mode": mode, "rl.num_minibatches": 2,
          "train.num_steps": 1}
    if mode == "sparse_rl":
        kw.update({"rl.veto_tau": 0.5, "rl.sparse_mask_band": (0.999, 1.001)})
    out = []
    for full in (True, False):
        t = Trainer(tiny_config(**kw), str(tmp_path / str(full)))
        assert t.prox.recompute and t.prox.skip_first
        if full:
            t.prox = ProxSource(True, "forced by the test")
        seen = []

        def counting(params, batch, seen=seen, logprobs=t.learner.logprobs):
            seen.append(batch["tokens"].shape[0])
            return logprobs(params, batch)

        t.learner.logprobs = counting
        m = t.step()
        rows = t.settings.rollout_rows
        assert seen == [rows if full else rows // 2]
        out.append((m, jax.device_get(t.params)))
    (m_a, params_a), (m_b, params_b) = out
    keys = ["update/loss", "update/grad_norm", "kl_behav_prox_k3", "raw_is_weight_max",
            "truncated_frac", "is_weight_mean"]
    if mode == "sparse_rl":
        keys += ["masked_token_frac", "vetoed_seq_frac", "sparse/vetoed_sequences",
                 "sparse/vetoed_tokens", "sparse/band_masked_tokens",
                 "sparse/band_masked_sequences"]
        assert m_a["sparse/band_masked_tokens"] > 0
    for k in keys:
        np.testing.assert_allclose(m_b[k], m_a[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert m_a["kl_behav_prox_k3"] > 0
    for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(params_b), strict=True):
        np.testing.assert_allclose(b, a, atol=1e-6)


def test_the_step_harness_config_runs_one_float_optimizer_step():
    """configs/smollm2_135m_step.py (the whole-step timing harness of docs/performance.md) is the
    setting it says: 32 samples of at most 64 tokens, one optimizer step, no separate pass, and
    the learner's memory settings its docstring gives."""
    import os

    from qurl_jax.config.base import load_config_file
    from qurl_jax.config.settings import RunSettings

    c = load_config_file(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                      "smollm2_135m_step.py"))
    settings = RunSettings.from_config(c)
    assert settings.rollout_rows == 32 and settings.rollout.max_new_tokens == 64
    assert not settings.prox.recompute and not settings.learner_logprobs
    train = settings.train
    assert (train.remat, train.scan_layers, train.logprob_chunk) == ("full", True, 16)
    assert c.train.cpu_dots == "auto"


@pytest.mark.slow  # two tiny trainers' compiles
def test_update_capture_inside_the_update_equals_the_copy(tmp_path):
    """One optimizer step per RL step: the update program reports the INT8 actor's update
    capture itself (no copy of the old parameters beside the update), with the values the
    trainer's copy-and-compare gives."""
    from test_trainer import _scripted, tiny_config

    from qurl_jax.train.trainer import Trainer

    kw = {"rollout.precision": "int8", "rl.num_minibatches": 1, "train.num_steps": 1,
          "optim.learning_rate": 1e-2, "optim.warmup_steps": 0}
    out = []
    for inside in (True, False):
        t = Trainer(tiny_config(**kw), str(tmp_path / str(inside)))
        assert t.settings.capture_in_update and t.learner.update_capture is not None
        if not inside:
            t.learner.update_capture = None
        t.task.rewards = _scripted([1, 0, 0, 1, 0, 1, 1, 0])  # advantages that move params
        out.append(t.step())
    for k in ("code_change_fraction", "mean_abs_update", "mean_quant_step",
              "update_to_step_ratio"):
        np.testing.assert_allclose(out[0][f"quant/{k}"], out[1][f"quant/{k}"], rtol=1e-6,
                                   err_msg=k)
    assert out[0]["quant/code_change_fraction"] > 0 and out[0]["quant/mean_abs_update"] > 0
    assert not Trainer(tiny_config(**dict(kw, **{"rl.num_minibatches": 2})),
                       str(tmp_path / "two")).settings.capture_in_update
