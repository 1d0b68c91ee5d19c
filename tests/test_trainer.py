"""The RL trainer end to end on tiny models: every loss mode and rollout precision, the behaviour
log-prob under top-p, the PRNG streams, DAPO filtering and refill, resume after SIGKILL and with a
mismatching model, the large configs with their model swapped for a tiny one, bad overrides, NaN
handling and the plain progress line."""

import dataclasses
import importlib.util
import io
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax import quant
from qurl_jax.config.base import LOSS_MODES, PRECISIONS, base_config, validate
from qurl_jax.config.settings import objective_from_config, optim_from_config
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.rl.objectives import policy_loss
from qurl_jax.runtime.checkpoint import CheckpointMismatchError
from qurl_jax.runtime.metrics import PhaseTimer, read_metrics
from qurl_jax.train.rollout import Rollout, regenerate_groups
from qurl_jax.train.trainer import Stream, Trainer, _Progress, stream_key
from tests.cli import cli_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load_config(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "configs", name + ".py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tiny_config(**overrides):
    c = base_config()
    c.model.source = "tiny"
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16))
    c.data.task = "arithmetic"
    c.data.prompts_per_step = 2
    c.data.max_prompt_len = 32
    c.rollout.n = 4
    c.rollout.max_new_tokens = 4
    c.optim.learning_rate = 1e-3
    c.rl.num_minibatches = 2
    c.train.num_steps = 2
    c.train.checkpoint_every = 1
    c.train.progress = False
    c.eval.max_examples = 4
    c.eval.max_new_tokens = 4
    for key, value in overrides.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


def _finite_metrics(m: dict) -> None:
    bad = {k: v for k, v in m.items() if not np.isfinite(v)}
    assert not bad, bad


def _scripted(*batches):
    """A `Task.rewards` replacement returning the given 0/1 rewards (= accuracy), call by call."""
    it = iter(batches)

    def rewards(texts, answers):
        r = np.asarray(next(it), np.float32)
        return r, r

    return rewards


def _params_changed(before, after) -> float:
    return max(float(np.abs(a - b).max()) for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(jax.device_get(after)), strict=True))


@pytest.fixture(scope="module")
def int8_trainer(tmp_path_factory):
    return Trainer(tiny_config(**{"rollout.precision": "int8"}), str(tmp_path_factory.mktemp("t")))


def _truncated_batch(t: Trainer, n_rows: int = 8, width: int = 12, resp: int = 4) -> dict:
    """A learner batch where every token is truncated (w = pi_prox / pi_behav = 10 > C = 2), the
    ratio R = pi_theta / pi_prox = e^0.5 lies above 1 + eps_high, and advantages are positive: TIS
    clips every token at 1 + eps_high, ACR's upper bound (1 + eps_high) / r = 6 clips none."""
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, 20, (n_rows, width)).astype(np.int32)
    mask = np.ones((n_rows, width), bool)
    batch = {"tokens": tokens, "positions": np.broadcast_to(np.arange(width), tokens.shape),
             "attn_mask": mask, "resp_mask": np.ones((n_rows, resp), np.float32)}
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    logp = t.learner.logprobs(t.params, t.learner.shard_batch(batch))
    batch.update(logp_prox=logp - 0.5, logp_behav=logp - 0.5 - np.log(10.0),
                 advantages=jnp.ones((n_rows,), jnp.float32))
    return t.learner.shard_batch(batch)


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_one_step_each_loss_mode(int8_trainer, mode):
    t = int8_trainer
    c = validate(tiny_config(**{"rollout.precision": "int8", "rl.loss_mode": mode}))
    t.learner = Learner(t.model_config, objective_from_config(c.rl), optim_from_config(c.optim),
                        t.mesh, temperature=c.rollout.temperature)
    before = jax.device_get(t.params)
    # The learner's loss on a batch with truncated weights is the objective of `mode`.
    batch = _truncated_batch(t)
    _, m_loss = t.learner.loss(t.params, batch)
    logp = t.learner.logprobs(t.params, batch)
    assert t.learner.objective.mode == mode
    _, expected = policy_loss(logp, batch["logp_prox"], batch["logp_behav"],
                              batch["advantages"], batch["resp_mask"], objective_from_config(c.rl))
    for k in ("clipfrac_upper", "truncated_frac", "upper_bound_mean"):
        assert float(m_loss[k]) == pytest.approx(float(expected[k]), abs=1e-6), k
    if mode == "tis":
        assert float(m_loss["clipfrac_upper"]) == 1.0
    if mode == "acr":
        assert float(m_loss["clipfrac_upper"]) == 0.0
        assert float(m_loss["upper_bound_mean"]) == pytest.approx(1.2 / 0.2, rel=1e-4)

    t.task.rewards = _scripted([1, 0, 0, 1, 0, 1, 1, 0])
    m = t.step()
    _finite_metrics(m)
    assert m["update/skipped"] == 0
    # behaviour (int8) and proximal (fp32) policies differ a little, never wildly
    assert 0 < m["logp_gap_abs_mean"] < 0.5
    assert _params_changed(before, t.params) > 0
    # The rollout ran on its own replicas of the learner's devices (one-device replicas),
    # resharded once per step (`test_rollout_layout` checks what a reshard moves).
    assert dict(t.sampler.engine.mesh.shape) == {"data": t.mesh.size, "fsdp": 1, "tensor": 1}
    assert m["time/reshard_s"] > 0 and m["reshard/bytes_per_quantized_param"] >= 0


@pytest.mark.parametrize("precision", [p for p in PRECISIONS if p != "int8"])
def test_one_step_each_precision(tmp_path, precision):
    t = Trainer(tiny_config(**{"rollout.precision": precision}), str(tmp_path))
    m = t.step()
    _finite_metrics(m)
    if precision == "fp":
        assert m["logp_gap_abs_mean"] < 1e-5  # on-policy up to float rounding
    else:
        assert m["logp_gap_abs_mean"] > 0
        assert "quant/code_change_fraction" in m


def _main(workdir: str, *overrides: str, env: dict | None = None, **popen) -> subprocess.Popen:
    """`python -m qurl_jax.main` on a tiny arithmetic run (extra environment variables in env)."""
    args = [sys.executable, "-m", "qurl_jax.main", f"--config={REPO}/configs/arith_tiny.py",
            f"--workdir={workdir}", "--config.sft.steps=0", "--config.model.tiny.num_layers=1",
            "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
            "--config.model.tiny.head_dim=16", "--config.data.prompts_per_step=2",
            "--config.rollout.n=4", "--config.rollout.max_new_tokens=4",
            "--config.eval.max_examples=4", "--config.eval.max_new_tokens=4",
            "--config.train.progress=False", *overrides]
    env = cli_env(**(env or {}))
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def _last_rows(workdir: str) -> dict[int, dict]:
    rows = {}
    for r in read_metrics(workdir):
        if "rollout/reward_mean" in r:
            rows[r["step"]] = {k: v for k, v in r.items() if not k.startswith(("time/", "compile/"))
                               and k != "rollout/tokens_per_s"}
    return rows


@pytest.mark.slow  # ~2 min: three CLI runs
def test_resume_after_sigkill_reproduces_metrics(tmp_path):
    steps = "--config.train.num_steps=5"
    every = "--config.train.checkpoint_every=2"
    full = _main(str(tmp_path / "full"), steps, every)
    out, _ = full.communicate(timeout=600)
    assert full.returncode == 0, out[-3000:]

    killed_dir = str(tmp_path / "killed")
    proc = _main(killed_dir, steps, every)
    deadline = time.time() + 600
    while time.time() < deadline:  # kill once step 3 is logged: checkpoint 2 exists, 3 does not
        if 3 in _last_rows(killed_dir):
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert 3 in _last_rows(killed_dir)
    saved = set(os.listdir(os.path.join(killed_dir, "checkpoints")))
    assert "2" in saved and "3" not in saved

    resumed = _main(killed_dir, steps, every)
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    # The steps redone after the resume are in metrics.jsonl once (the killed run's step 3 row
    # was dropped), so end-of-run means count every step once.
    steps = [r["step"] for r in read_metrics(killed_dir) if "rollout/reward_mean" in r]
    assert steps == [1, 2, 3, 4, 5]
    a, b = _last_rows(str(tmp_path / "full")), _last_rows(killed_dir)
    for step in (3, 4, 5):
        assert a[step].keys() == b[step].keys()
        for k in a[step]:
            assert a[step][k] == pytest.approx(b[step][k], rel=1e-6, abs=1e-7), (step, k)


@pytest.mark.parametrize("override, message", [
    ("--config.rl.los_mode=tis", "los_mode"),
    ("--config.rollout.n=abc", "rollout.n"),
    ("--config.rl.loss_mode=bogus", "rl.loss_mode"),
    ("--config.rollout.precision=int4", "rollout.precision"),
])
def test_bad_override_fails_before_compiling(tmp_path, override, message):
    proc = _main(str(tmp_path), override)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert message in out
    assert "Traceback" not in out, out
    assert len([line for line in out.splitlines() if line.startswith("qurl_jax: bad")]) == 1
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("name, family_checks", [
    pytest.param("deepscaler_r1_1p5b_int8", {
        "rollout.precision": "int8", "rollout.quantize_vocab": True, "rl.loss_mode": "acr",
        "rollout.invariant_scaling": 1.5, "rl.kl_coef": 1e-3, "rl.kl_estimator": "k3",
        "optim.learning_rate": 1e-6, "rl.advantage": "grpo", "rollout.n": 8},
        marks=pytest.mark.slow),
    ("dapo_qwen2p5_7b_fp8", {"rollout.precision": "fp8", "rl.eps_low": 0.2, "rl.eps_high": 0.28,
                             "rl.agg": "token_mean", "rl.dynamic_sampling": True,
                             "rl.kl_coef": 0.0, "rl.overlong_buffer": 4096,
                             "rollout.invariant_scaling": 1.5, "rl.cap": 5.0}),
    pytest.param("gsm8k_qwen2p5_0p5b_int8", {
        "rollout.precision": "int8", "rollout.invariant_scaling": 1.0,
        "optim.learning_rate": 1e-5, "rl.cap": 2.0}, marks=pytest.mark.slow),
    pytest.param("jetrl_r1_1p5b_fp8_block", {
        "rollout.precision": "fp8_block", "train.precision": "fp8_block",
        "rl.loss_mode": "on_policy", "rollout.invariant_scaling": 1.0,
        "train.scan_layers": True, "rollout.quantize_vocab": False}, marks=pytest.mark.slow),
    pytest.param("dapo_qwen2p5_7b_fp8_lora", {
        "model.lora.rank": 32, "model.lora.base_precision": "int8", "rollout.precision": "int8",
        "rl.dynamic_sampling": True, "rollout.invariant_scaling": 1.0, "rl.cap": 5.0},
        marks=pytest.mark.slow),
    pytest.param("grpo_qwen2p5_32b_lora_h100", {
        "model.lora.rank": 16, "model.lora.base_precision": "int8", "rollout.precision": "int8",
        "rollout.kv_precision": "int8", "train.scan_layers": False}, marks=pytest.mark.slow),
])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_large_configs_one_step_with_tiny_model(tmp_path, name, family_checks):
    c = _load_config(name)
    for key, expected in family_checks.items():
        value = c
        for part in key.split("."):
            value = value[part]
        assert value == expected, key
    assert c.model.source == "hf" and c.model.path
    with pytest.raises(ValueError, match="model.path"):
        validate(c)  # the checkpoint is not on this machine: a clear error, nothing random
    c.unlock()
    c.model.source = "tiny"
    c.model.tiny.update(dict(model_type="qwen2", hidden_size=32, intermediate_size=64,
                             num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16))
    c.data.train_files = ("third_party/math_data/test_aime.json",)
    c.data.prompts_per_step = 2
    c.data.max_prompt_len = 1024
    c.model.tiny.max_position_embeddings = 2048  # AIME prompts in characters, + the responses
    c.rollout.n = 2
    c.rollout.max_new_tokens = 8
    c.rl.num_minibatches = 1
    c.rl.num_micro_batches = 2
    c.rl.max_gen_batches = 2
    c.rl.overlong_buffer = min(c.rl.overlong_buffer, 4)
    if c.rollout.kv_pages:  # a page for every token the tiny run's rows may hold
        pages_per_row = -(-(c.data.max_prompt_len + c.rollout.max_new_tokens)
                          // c.rollout.kv_page_size)
        c.rollout.kv_pages = c.data.prompts_per_step * c.rollout.n * pages_per_row
    c.mesh.update(dict(data=1, fsdp=1, tensor=1))
    c.rollout.tensor = "1"
    c.eval.files = ()
    c.train.progress = False
    c.lock()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        t = Trainer(c, str(tmp_path))
        # Mixed outcomes in every group, so the advantages and the policy gradient are non-zero
        # (DAPO's filter keeps both groups in the first round). Two steps, so the second runs
        # with an optimizer state that has seen one update.
        t.task.rewards = _scripted([1, 0, 0, 1], [0, 1, 1, 0])
        before = jax.device_get(t.params)
        metrics = [t.step(), t.step()]
    finally:
        os.chdir(cwd)
    for m in metrics:
        _finite_metrics(m)
        assert m["rollout/tokens"] > 0 and m["update/skipped"] == 0
        assert m["update/grad_norm"] > 0
    assert _params_changed(before, t.params) > 0


@pytest.mark.slow
def test_nonfinite_steps_stop_the_run_and_keep_the_last_checkpoint(tmp_path):
    t = Trainer(tiny_config(**{"train.num_steps": 6, "train.max_bad_steps": 2}), str(tmp_path))
    t.train(num_steps=1)
    assert t.checkpointer.steps() == [1]
    good = jax.device_get(t.params)
    t2 = Trainer(tiny_config(**{"train.num_steps": 6, "train.max_bad_steps": 2}), str(tmp_path))
    t2._advantages = lambda rewards: np.full(rewards.shape, np.nan, np.float32)
    summary = t2.train()
    assert summary["stopped"] and "non-finite" in summary["stopped"]
    assert summary["end_step"] == 3 and t2.checkpointer.steps() == [1]
    for a, b in zip(jax.tree.leaves(good), jax.tree.leaves(jax.device_get(t2.params)),
                    strict=True):
        np.testing.assert_array_equal(a, b)
    rows = [r for r in read_metrics(str(tmp_path)) if "update/skipped" in r]
    assert [r["update/skipped"] for r in rows[-2:]] == [1.0, 1.0]
    json.dumps(summary["last"])


def _rollout(width: int, groups: int, n: int, base: float, accuracy) -> Rollout:
    """A resolved host-side rollout whose every per-row field holds `base` + the row index."""
    rows = groups * n
    vals = base + np.arange(rows, dtype=np.float32)
    acc = np.asarray(accuracy, np.float32)
    return Rollout(tokens=np.repeat(vals[:, None], width + 3, 1).astype(np.int32),
                   attn_mask=np.ones((rows, width + 3), bool),
                   resp_mask=np.repeat(vals[:, None], 3, 1),
                   logp_behav=-np.repeat(vals[:, None], 3, 1),
                   logp_truncation_gap=np.repeat(vals[:, None], 3, 1) / 10,
                   lengths=vals.astype(np.int32), rewards=acc + vals / 1000, accuracy=acc)


@pytest.mark.parametrize("first_width, extra_width", [(5, 9), (9, 5)])
def test_regenerate_groups_moves_every_field_from_the_extra_round(first_width, extra_width):
    n = 2
    # First round: groups 0 and 2 all-equal (dropped); extra round: groups 1 and 2 kept.
    r = _rollout(first_width, 3, n, 100.0, [0, 1, 0, 0, 1, 1])
    extra = _rollout(extra_width, 3, n, 500.0, [0, 0, 1, 0, 0, 1])
    keep, extra_keep = np.array([False, True, False]), np.array([False, True, True])
    snapshot = {f: np.copy(getattr(r, f)) for f in Rollout.ROW_FIELDS}
    out, new_keep = regenerate_groups(r, keep, extra, extra_keep, n)
    np.testing.assert_array_equal(new_keep, [True, True, True])
    for f, v in snapshot.items():  # pure: the input is untouched
        np.testing.assert_array_equal(getattr(r, f), v)
    width = max(first_width, extra_width) + 3
    assert out.tokens.shape == out.attn_mask.shape == (6, width)
    pad_first = width - (first_width + 3)
    # group 0 <- extra group 1 (rows 2, 3); group 1 stays; group 2 <- extra group 2 (rows 4, 5)
    source = {0: (extra, 2), 1: (extra, 3), 2: (r, 2), 3: (r, 3), 4: (extra, 4), 5: (extra, 5)}
    for dst, (src, row) in source.items():
        for f in ("resp_mask", "logp_behav", "logp_truncation_gap", "lengths", "rewards",
                  "accuracy"):
            np.testing.assert_array_equal(getattr(out, f)[dst], getattr(src, f)[row], f)
        pad = width - src.tokens.shape[1]
        np.testing.assert_array_equal(out.tokens[dst, pad:], src.tokens[row], "tokens")
        assert not out.attn_mask[dst, :pad].any() and out.attn_mask[dst, pad:].all()
        assert (out.tokens[dst, :pad] == 0).all()
    assert pad_first == 0 or not out.attn_mask[2, :pad_first].any()


def _recording_sampler(t: Trainer):
    keys, lengths = [], []
    sample = t.sampler.sample

    def wrapped(params, prompts, settings, **kw):
        keys.append(np.asarray(jax.random.key_data(kw["key"])))
        out = sample(params, prompts, settings, **kw)
        lengths.append(int(np.asarray(out.lengths).sum()))
        return out

    t.sampler.sample = wrapped
    return keys, lengths


def test_dynamic_sampling_refills_all_equal_groups(tmp_path):
    c = tiny_config(**{"rl.dynamic_sampling": True, "rl.max_gen_batches": 3})
    t = Trainer(c, str(tmp_path))
    n = c.rollout.n
    keys, lengths = _recording_sampler(t)
    # Call 1: group 0 mixed, group 1 all zero. Call 2: group 0 all zero, group 1 mixed.
    t.task.rewards = _scripted([1, 0, 0, 0] + [0] * n, [0] * n + [0, 1, 1, 0])
    params = quant.requantize(t.params, t.recipe)
    r, stats = t.collect(params, PhaseTimer())
    assert stats["rollout/gen_batches"] == 2 and stats["rollout/kept_group_frac"] == 1.0
    np.testing.assert_array_equal(r.rewards, [1, 0, 0, 0, 0, 1, 1, 0])
    assert r.resp_mask.sum() > 0
    # Each round draws from its own stream: round 0 and the refill round 1 of step 0.
    assert len(keys) == 2 and not np.array_equal(keys[0], keys[1])
    for i, k in enumerate(keys):
        np.testing.assert_array_equal(k, jax.random.key_data(stream_key(0, Stream.ROLLOUT, 0, i)))
    assert stats["rollout/generated_tokens"] == sum(lengths)

    # A whole step with three rounds: tokens/s is every round's tokens over every round's time.
    del lengths[:]
    t.task.rewards = _scripted([0] * 8, [0] * 8, [1, 0, 0, 0, 0, 1, 1, 0])
    m = t.step()
    assert len(lengths) == 3 and m["rollout/gen_batches"] == 3
    assert m["rollout/generated_tokens"] == sum(lengths) > m["rollout/tokens"]
    assert m["rollout/tokens_per_s"] == pytest.approx(
        sum(lengths) / m["time/rollout_s"], rel=1e-6)


def test_dynamic_sampling_masks_groups_it_cannot_refill(tmp_path):
    c = tiny_config(**{"rl.dynamic_sampling": True, "rl.max_gen_batches": 2})
    t = Trainer(c, str(tmp_path))
    n = c.rollout.n
    t.task.rewards = _scripted([1, 0, 1, 0] + [0] * n, [0] * 2 * n)  # the refill finds nothing
    params = quant.requantize(t.params, t.recipe)
    r, stats = t.collect(params, PhaseTimer())
    assert stats["rollout/kept_group_frac"] == 0.5
    assert r.resp_mask[n:].sum() == 0 and r.resp_mask[:n].sum() > 0


@pytest.mark.parametrize("metric, kept", [("accuracy", [False, True]), ("reward", [True, True])])
def test_dapo_filters_on_accuracy_not_the_shaped_reward(int8_trainer, metric, kept):
    t = int8_trainer
    settings = t.settings
    t.settings = dataclasses.replace(settings, rl=dataclasses.replace(
        settings.rl, filter_metric=metric, overlong_buffer=2))
    try:
        # Group 0 is all wrong, one response overlong (penalised); group 1 is mixed.
        acc = np.array([0, 0, 0, 0, 1, 0, 1, 0], np.float32)
        lengths = np.array([settings.rollout.max_new_tokens, 1, 1, 1, 1, 1, 1, 1], np.int32)
        r = Rollout(tokens=None, attn_mask=None, resp_mask=None, logp_behav=None,
                    logp_truncation_gap=None, lengths=lengths, rewards=acc, accuracy=acc)
        assert t._shaped_rewards(r)[0] < 0  # the shaped rewards of group 0 are not all equal
        np.testing.assert_array_equal(t._groups_to_keep(r), kept)
    finally:
        t.settings = settings


def test_streams_are_distinct_per_purpose_step_round_and_seed():
    keys = {}
    for seed in (0, 1):
        for step in range(4):
            for purpose, indices in ((Stream.ROLLOUT, range(4)), (Stream.MINIBATCH, range(2)),
                                     (Stream.EVAL, [0]), (Stream.SPEED, [0])):
                for i in indices:
                    keys[(seed, step, purpose, i)] = bytes(np.asarray(
                        jax.random.key_data(stream_key(seed, purpose, step, i))))
    assert len(set(keys.values())) == len(keys)
    # The old scheme's collisions: a refill round r of step s vs round 0 of step s + r, and the
    # evaluation of seed s vs seed s + 2.
    assert keys[(0, 0, Stream.ROLLOUT, 1)] != keys[(0, 1, Stream.ROLLOUT, 0)]
    assert keys[(0, 0, Stream.EVAL, 0)] != keys[(1, 0, Stream.ROLLOUT, 0)]


def test_behaviour_logp_is_the_truncated_distribution_under_top_p(tmp_path):
    c = tiny_config(**{"rollout.precision": "fp", "rollout.top_p": 0.5,
                       "rollout.temperature": 1.0, "rollout.max_new_tokens": 6})
    t = Trainer(c, str(tmp_path))
    t.task.rewards = _scripted([1, 0, 0, 1, 0, 1, 1, 0])
    r, stats = t.collect(t.params, PhaseTimer())
    batch = t._learner_batch(r)
    logp_prox = np.asarray(t.learner.logprobs(t.params, batch))
    weight_seen = np.exp(logp_prox - np.asarray(batch["logp_behav"]))  # what policy_loss gets

    # Independently in numpy: the nucleus {j : mass of tokens strictly more likely < top_p}.
    logits, _ = t.learner.model.apply({"params": jax.device_get(t.params)}, r.tokens,
                                      np.asarray(batch["positions"]), r.attn_mask)
    g = r.resp_mask.shape[1]
    logits = np.asarray(logits, np.float64)[:, -g - 1:-1]
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    above = np.array([[[q[q > x].sum() for x in q] for q in row] for row in p])
    z = np.where(above < 0.5, p, 0.0).sum(-1)
    p_tok = np.take_along_axis(p, r.tokens[:, -g:, None], -1)[..., 0]
    weight_numpy = np.exp(logp_prox) / (p_tok / z)
    valid = r.resp_mask > 0
    np.testing.assert_allclose(weight_seen[valid], weight_numpy[valid], rtol=2e-4)
    assert (z[valid] < 0.99).mean() > 0.5  # truncation happened: the untruncated weight is ~1
    np.testing.assert_allclose(stats["rollout/logp_truncation_gap"], -np.log(z[valid]).mean(),
                               rtol=1e-3)

    # The untruncated log-prob stays selectable: then pi_behav is the learner's own softmax.
    t.settings = dataclasses.replace(t.settings, rollout=dataclasses.replace(
        t.settings.rollout, behav_logp="untruncated"))
    t.task.rewards = _scripted([1, 0, 0, 1, 0, 1, 1, 0])
    r, _ = t.collect(t.params, PhaseTimer())
    logp_prox = np.asarray(t.learner.logprobs(t.params, t._learner_batch(r)))
    valid = r.resp_mask > 0
    np.testing.assert_allclose(r.logp_behav[valid], logp_prox[valid], atol=1e-4)


def test_resume_with_another_model_stops_and_keeps_the_checkpoints(tmp_path):
    t = Trainer(tiny_config(), str(tmp_path))
    t.train(num_steps=2)
    ckpt_dir = tmp_path / "checkpoints"
    before = {p: os.stat(os.path.join(d, p)).st_mtime_ns
              for d, _, files in os.walk(ckpt_dir) for p in files}
    metrics_before = (tmp_path / "metrics.jsonl").read_text()
    other = tiny_config(**{"train.keep_checkpoints": 1})
    other.model.tiny.intermediate_size = 48
    with pytest.raises(CheckpointMismatchError,
                       match=r"tensor 'params\.\S+_proj\.kernel' has shape \((64, 32|32, 64)\) in "
                             r"the checkpoint but \((48, 32|32, 48)\) in this run"):
        Trainer(other, str(tmp_path))
    after = {p: os.stat(os.path.join(d, p)).st_mtime_ns
             for d, _, files in os.walk(ckpt_dir) for p in files}
    assert after == before and sorted(os.listdir(ckpt_dir)) == ["1", "2"]
    assert (tmp_path / "metrics.jsonl").read_text() == metrics_before
    # From the command line: one line naming the tensor, a non-zero exit, nothing written.
    proc = _main(str(tmp_path), "--config.model.tiny.intermediate_size=48")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode != 0
    assert "cannot resume" in out and "has shape" in out and "Traceback" not in out, out[-3000:]
    assert "Event loop is closed" not in out
    assert sorted(os.listdir(ckpt_dir)) == ["1", "2"]


def test_plain_status_lines_when_not_on_a_terminal(caplog):
    stream = io.StringIO()
    progress = _Progress(total=40, start=0, bar=True, stream=stream)
    with caplog.at_level(logging.INFO):
        for step in range(1, 41):
            progress.update(step, {"rollout/reward_mean": 0.5})
    progress.close()
    assert stream.getvalue() == ""  # no bar frames
    lines = [r.getMessage() for r in caplog.records if "reward 0.500" in r.getMessage()]
    assert len(lines) == 20 and lines[-1].startswith("step 40/40")


def test_step_lines_carry_their_seconds_and_the_runs_time_left(caplog):
    # The time left: the steps to go at the mean of the last five (the first, which compiles,
    # only while it is the only one) plus the evaluation after RL.
    progress = _Progress(total=10, start=0, bar=False, final_eval=60.0)
    with caplog.at_level(logging.INFO):
        progress.update(1, {"rollout/reward_mean": 0.5}, seconds=100.0)
        for step in range(2, 8):
            progress.update(step, {"rollout/reward_mean": 0.5}, seconds=10.0 * step)
    lines = [r.getMessage() for r in caplog.records if "reward 0.500" in r.getMessage()]
    assert lines[0].startswith("step 1/10: 100.0 s, reward")
    assert lines[0].endswith("; about 16:00 left in the run")  # 9 x 100 s + 60 s
    assert lines[-1].startswith("step 7/10: 70.0 s, reward")
    assert lines[-1].endswith("; about 3:30 left in the run")  # 3 x mean(30..70 s) + 60 s
    unknown = _Progress(total=2, start=0, bar=False, final_eval=math.nan)
    unknown.update(1, {}, seconds=5.0)
    assert unknown.left() == "about 0:05 left in the run, and the evaluation after RL"


@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_export_hf_at_the_end_loads_in_transformers(tmp_path):
    import torch
    import transformers

    export = str(tmp_path / "hf")
    t = Trainer(tiny_config(**{"train.export_hf": export, "train.num_steps": 1}),
                str(tmp_path / "run"))
    t.train()
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    ids = tokenizer("12+7=", return_tensors="pt").input_ids
    with torch.no_grad():
        hf_logits = model(ids).logits.numpy()
    ours, _ = t.learner.model.apply({"params": jax.device_get(t.params)}, ids.numpy(),
                                    np.arange(ids.shape[1])[None])
    np.testing.assert_allclose(np.asarray(ours), hf_logits, atol=1e-4)


def test_optim_from_config_carries_every_optimiser_field():
    o = base_config().optim
    fields = {f.name for f in dataclasses.fields(OptimConfig)}
    assert fields == set(o.keys())
    for i, name in enumerate(sorted(fields)):
        o[name] = i + 1 if isinstance(o[name], int) else 0.5 + i / 100  # distinct values
    optim = optim_from_config(o)
    assert {name: getattr(optim, name) for name in fields} == {name: o[name] for name in fields}
