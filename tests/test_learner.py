"""The learner: sharded update == single-device, accumulation == one big batch, NaN guard, and the
memory knobs (chunked response log-probs, remat, sliced recomputation) leave results unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.learner.learner import (
    Learner,
    OptimConfig,
    learning_rate_schedule,
    merge_rows,
    response_logprobs,
    split_rows,
)
from qurl_jax.models import ModelConfig, Transformer, init_params, token_logprobs_and_entropy
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
B, P, G = 8, 6, 5


def _batch(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    prompt_len = rng.integers(2, P + 1, B)
    resp_len = rng.integers(1, G + 1, B)
    prompt_mask = np.arange(P)[None] >= (P - prompt_len)[:, None]
    resp_mask = np.arange(G)[None] < resp_len[:, None]
    attn = np.concatenate([prompt_mask, resp_mask], axis=1)
    return {
        "tokens": jnp.asarray(rng.integers(0, CFG.vocab_size, (B, P + G)), jnp.int32),
        "positions": jnp.asarray(np.maximum(np.cumsum(attn, 1) - 1, 0), jnp.int32),
        "attn_mask": jnp.asarray(attn),
        "resp_mask": jnp.asarray(resp_mask, jnp.float32),
        "logp_behav": jnp.asarray(-rng.uniform(0.5, 4.0, (B, G)), jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
    }


def _learner(mesh, num_micro_batches=1, adam_eps=1e-8, objective=None) -> Learner:
    optim = OptimConfig(learning_rate=1e-2, weight_decay=0.1, eps=adam_eps)
    return Learner(CFG, objective or ObjectiveConfig(), optim, mesh, temperature=0.9,
                   num_micro_batches=num_micro_batches)


def _one_update(learner: Learner, params, batch):
    params = learner.shard_params(params)
    opt_state = learner.init_opt_state(params)
    batch = learner.shard_batch(batch)
    batch["logp_prox"] = learner.logprobs(params, batch)
    new_params, _, metrics = learner.update(params, opt_state, batch)
    return jax.device_get(new_params), jax.device_get(metrics), np.asarray(batch["logp_prox"])


def test_sharded_update_matches_single_device():
    params = init_params(CFG, jax.random.key(0))
    batch = _batch()
    single = _one_update(_learner(shd.make_mesh()), params, batch)
    sharded_learner = _learner(shd.make_mesh(data=1, fsdp=4, tensor=2))
    sharded = _one_update(sharded_learner, params, batch)
    # The parameters really were split over the mesh.
    placed = sharded_learner.shard_params(params)
    q = placed["layers_0"]["self_attn"]["q_proj"]["kernel"]
    assert len(q.sharding.device_set) == 8 and q.addressable_shards[0].data.shape == (8, 16)
    np.testing.assert_allclose(single[2], sharded[2], atol=1e-5)
    np.testing.assert_allclose(single[1]["update/loss"], sharded[1]["update/loss"], atol=1e-5)
    flat_a, flat_b = jax.tree.leaves(single[0]), jax.tree.leaves(sharded[0])
    for a, b in zip(flat_a, flat_b, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert any(np.abs(a - b).max() > 0 for a, b in zip(
        jax.tree.leaves(params), flat_a, strict=True)), "the update changed nothing"


def test_micro_batch_accumulation_matches_full_batch_for_token_sums():
    # With seq_mean_token_mean every sequence has the same weight, so the mean of two half-batch
    # losses equals the full-batch loss and the accumulated gradient equals the full one. Adam's
    # eps = 1 makes the step proportional to the gradient: with eps = 1e-8 an element whose
    # gradient is ~0 turns float32 summation-order noise into a step of up to lr.
    params = init_params(CFG, jax.random.key(1))
    batch = _batch(1)
    mesh = shd.make_mesh()
    full = _one_update(_learner(mesh, adam_eps=1.0), params, batch)
    acc = _one_update(_learner(mesh, num_micro_batches=2, adam_eps=1.0), params, batch)
    np.testing.assert_allclose(full[1]["update/grad_norm"], acc[1]["update/grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(full[1]["update/loss"], acc[1]["update/loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(full[0]), jax.tree.leaves(acc[0]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_sum_norm"])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_micro_batch_accumulation_matches_full_batch_when_token_counts_differ(agg):
    # Micro-batches with different numbers of response tokens (and, for the second, one sequence
    # with no token at all): a plain mean of micro-batch token means would weight the tokens of
    # the short half more. Weighted by kept tokens / sequences the result is the full batch's.
    params = init_params(CFG, jax.random.key(3))
    batch = _batch(3)
    resp = np.zeros((B, G), np.float32)
    resp[0::2, :G] = 1.0  # first micro-batch (split_rows is strided: the even rows): every token
    resp[1::2, :1] = 1.0  # second: one token each ...
    resp[-1] = 0.0  # ... and one sequence without any
    batch["resp_mask"] = jnp.asarray(resp)
    objective = ObjectiveConfig(agg=agg)
    mesh = shd.make_mesh()
    full = _one_update(_learner(mesh, adam_eps=1.0, objective=objective), params, batch)
    acc = _one_update(_learner(mesh, num_micro_batches=2, adam_eps=1.0, objective=objective),
                      params, batch)
    np.testing.assert_allclose(full[1]["update/loss"], acc[1]["update/loss"], rtol=1e-5)
    np.testing.assert_allclose(full[1]["update/grad_norm"], acc[1]["update/grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(full[0]), jax.tree.leaves(acc[0]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7)
    # Counts add up, extremes stay extremes, token fractions are over all kept tokens.
    for key in ("kept_tokens", "kept_sequences", "valid_tokens", "ratio_max", "is_weight_min",
                "logp_gap_abs_max"):
        np.testing.assert_allclose(full[1][key], acc[1][key], rtol=1e-5, err_msg=key)
    if agg == "token_mean":
        np.testing.assert_allclose(full[1]["clipfrac"], acc[1]["clipfrac"], atol=1e-6)


def test_micro_batch_shares_of_valid_sequences_count_a_fully_vetoed_micro_batch():
    # Sparse-RL vetoes every sequence of the first micro-batch (the even rows): it keeps nothing,
    # so its loss weight is 0; the shares of valid sequences and tokens must still count it.
    params = init_params(CFG, jax.random.key(4))
    batch = _batch(4)
    mesh = shd.make_mesh()
    objective = ObjectiveConfig(mode="sparse_rl", veto_tau=0.5)
    prox = _learner(mesh, objective=objective).logprobs(params, batch)
    behav = np.array(prox)
    behav[0::2] = 0.0  # w = pi_prox / pi_behav < 0.5 on every token: vetoed
    batch["logp_behav"] = jnp.asarray(behav)
    full = _one_update(_learner(mesh, objective=objective), params, batch)[1]
    acc = _one_update(_learner(mesh, num_micro_batches=2, objective=objective), params, batch)[1]
    valid = np.asarray(batch["resp_mask"])
    assert full["vetoed_seq_frac"] == acc["vetoed_seq_frac"] == 0.5
    assert full["valid_sequences"] == acc["valid_sequences"] == B
    np.testing.assert_allclose(acc["masked_token_frac"], valid[0::2].sum() / valid.sum(),
                               rtol=1e-6)
    np.testing.assert_allclose(full["masked_token_frac"], acc["masked_token_frac"], rtol=1e-6)
    np.testing.assert_allclose(full["truncated_frac"], acc["truncated_frac"], atol=1e-7)


def test_nonfinite_loss_skips_update():
    params = init_params(CFG, jax.random.key(2))
    batch = _batch(2)
    batch["advantages"] = batch["advantages"].at[0].set(jnp.nan)
    new_params, metrics, _ = _one_update(_learner(shd.make_mesh()), params, batch)
    assert metrics["update/skipped"] == 1.0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(a, b)


def test_bad_micro_batch_count():
    with pytest.raises(ValueError, match="num_micro_batches"):
        _learner(shd.make_mesh(), num_micro_batches=0)


def test_learning_rate_zero_is_a_control_run():
    # lr 0 is allowed: the step computes loss, gradient and metrics and changes nothing (AdamW
    # scales the decoupled weight decay by the learning rate as well).
    params = init_params(CFG, jax.random.key(8))
    learner = Learner(CFG, ObjectiveConfig(), OptimConfig(learning_rate=0.0, weight_decay=0.1),
                      shd.make_mesh(), temperature=0.9)
    new_params, metrics, _ = _one_update(learner, params, _batch(8))
    assert metrics["update/grad_norm"] > 0 and metrics["update/skipped"] == 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="learning_rate"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(learning_rate=-1e-3), shd.make_mesh())


def test_warmup_first_step_already_moves():
    # Linear warm-up lr * (step + 1) / warmup_steps: step 0 takes a non-zero step and the peak is
    # reached at step warmup_steps - 1; then the cosine decay (or the constant) takes over.
    warm = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=4))
    np.testing.assert_allclose([float(warm(i)) for i in range(6)],
                               [0.25, 0.5, 0.75, 1.0, 1.0, 1.0])
    cosine = learning_rate_schedule(OptimConfig(learning_rate=1.0, warmup_steps=2,
                                                decay_steps=4, end_lr_ratio=0.1))
    np.testing.assert_allclose([float(cosine(i)) for i in range(8)],
                               [0.5, 1.0, 1.0, 0.55 + 0.45 * np.cos(np.pi / 4), 0.55,
                                0.55 - 0.45 * np.cos(np.pi / 4), 0.1, 0.1], rtol=1e-6)
    params = init_params(CFG, jax.random.key(9))
    learner = Learner(CFG, ObjectiveConfig(), OptimConfig(learning_rate=1e-2, warmup_steps=100),
                      shd.make_mesh(), temperature=0.9)
    new_params, _, _ = _one_update(learner, params, _batch(9))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(params), jax.tree.leaves(new_params), strict=True))
    # Adam's first step is ~lr * sign(g) = 1e-4 per element at lr 1e-2 / 100.
    assert 0 < moved < 2e-4, moved


def test_bad_memory_knobs_name_the_argument():
    with pytest.raises(ValueError, match="remat='al'"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), remat="al")
    with pytest.raises(ValueError, match="logprob_chunk"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), logprob_chunk=0)
    with pytest.raises(ValueError, match="training precision 'int8'"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), precision="int8")
    with pytest.raises(ValueError, match="unknown quantization recipe"):
        Learner(CFG, ObjectiveConfig(), OptimConfig(), shd.make_mesh(), precision="fp4")


def test_split_rows_is_strided_and_merge_rows_inverts_it():
    x = jnp.arange(12).reshape(6, 2)
    parts = split_rows({"x": x}, 3)["x"]
    np.testing.assert_array_equal(parts[1], x[1::3])
    np.testing.assert_array_equal(merge_rows(parts), x)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_response_logprobs_match_full_logits(tied):
    # G = 5 positions in chunks of 2 (the last one padded); values and gradients of log-probs and
    # entropies equal those from the model's full logits.
    config = CFG.replace(tie_word_embeddings=tied)
    model = Transformer(config)
    params = init_params(config, jax.random.key(4))
    batch = _batch(4)
    tokens, positions, mask = batch["tokens"], batch["positions"], batch["attn_mask"]
    w = jnp.asarray(np.random.default_rng(5).normal(size=(2, B, G)), jnp.float32)

    def reference(params):
        logits, _ = model.apply({"params": params}, tokens, positions, mask)
        return token_logprobs_and_entropy(logits[:, P - 1:-1], tokens[:, P:], 0.7, True)

    def chunked(params):
        return response_logprobs(model, params, tokens, positions, mask, G, 0.7, chunk=2,
                                 with_entropy=True)

    def objective(fn):
        return jax.jit(jax.value_and_grad(lambda p: jnp.sum(jnp.stack(fn(p)) * w)))

    (ref_logp, ref_ent), (logp, ent) = jax.jit(reference)(params), jax.jit(chunked)(params)
    np.testing.assert_allclose(logp, ref_logp, atol=1e-5)
    np.testing.assert_allclose(ent, ref_ent, atol=1e-5)
    ref_val, ref_grad = objective(reference)(params)
    val, grad = objective(chunked)(params)
    np.testing.assert_allclose(val, ref_val, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(ref_grad), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("remat,attention", [("full", "dense"), ("dots", "blockwise")])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_memory_knobs_leave_the_update_unchanged(remat, attention):
    params = init_params(CFG, jax.random.key(6))
    batch = _batch(6)
    mesh = shd.make_mesh()
    objective = ObjectiveConfig(entropy_coef=0.01)  # the entropy goes through the chunks too
    base = _one_update(_learner(mesh, adam_eps=1.0, objective=objective), params, batch)
    learner = Learner(CFG.replace(attention=attention), objective,
                      OptimConfig(learning_rate=1e-2, weight_decay=0.1, eps=1.0), mesh,
                      temperature=0.9, remat=remat, scan_layers=True, logprob_chunk=3,
                      logprob_batch_size=2)
    knobs = _one_update(learner, params, batch)
    np.testing.assert_allclose(knobs[2], base[2], atol=1e-5)  # logp_prox, in slices of 2 rows
    for a, b in zip(jax.tree.leaves(knobs[0]), jax.tree.leaves(base[0]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_scanned_layers_match_the_unrolled_model(remat, precision):
    # The learner's model scans its layers over stacked parameters; same logits and gradients as
    # the unrolled loop the sampler runs, with the parameters still named layers_{i}.
    config = CFG.replace(num_layers=3, dtype=precision.dtype)
    params = init_params(config, jax.random.key(7))
    batch = _batch(7)
    args = (batch["tokens"], batch["positions"], batch["attn_mask"])

    def loss(model, params):
        logits, _ = model.apply({"params": params}, *args)
        return jnp.sum(jnp.sin(logits)), logits

    grad = lambda model: jax.jit(jax.grad(loss, argnums=1, has_aux=True),  # noqa: E731
                                 static_argnums=0)(model, params)
    ref_grad, ref_logits = grad(Transformer(config))
    scan_grad, scan_logits = grad(Transformer(config, remat=remat, scan_layers=True))
    precision.assert_close(scan_logits, ref_logits, "learner.scan_vs_unrolled_logits")
    assert set(scan_grad) == set(params) and "layers_2" in scan_grad
    for a, b in zip(jax.tree.leaves(scan_grad), jax.tree.leaves(ref_grad), strict=True):
        precision.assert_close(a, b, "learner.scan_vs_unrolled_grads")
