"""The RL trainer end to end on tiny models: every loss mode and rollout precision, resume after
SIGKILL, the large configs with their model swapped for a tiny one, bad overrides, NaN handling."""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from qurl_jax.config import LOSS_MODES, PRECISIONS, base_config, objective_from_config, validate
from qurl_jax.learner import Learner
from qurl_jax.metrics import read_metrics
from qurl_jax.trainer import Trainer, optim_from_config

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


@pytest.fixture(scope="module")
def int8_trainer(tmp_path_factory):
    return Trainer(tiny_config(**{"rollout.precision": "int8"}), str(tmp_path_factory.mktemp("t")))


@pytest.mark.parametrize("mode", LOSS_MODES)
def test_one_step_each_loss_mode(int8_trainer, mode):
    t = int8_trainer
    c = t.config
    c.unlock()
    c.rl.loss_mode = mode
    c.lock()
    t.learner = Learner(t.model_config, objective_from_config(c.rl), optim_from_config(c.optim),
                        t.mesh, temperature=c.rollout.temperature)
    before = jax.device_get(t.params)
    m = t.step()
    _finite_metrics(m)
    assert m["rollout/tokens"] > 0 and m["quant/code_change_fraction"] >= 0
    assert m["update/skipped"] == 0
    # behaviour (int8) and proximal (fp32) policies differ a little, never wildly
    assert 0 < m["logp_gap_abs_mean"] < 0.5
    changed = [np.abs(a - b).max() for a, b in zip(
        jax.tree.leaves(before), jax.tree.leaves(jax.device_get(t.params)), strict=True)]
    assert max(changed) > 0


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


def _main(workdir: str, *overrides: str, **popen) -> subprocess.Popen:
    args = [sys.executable, "-m", "qurl_jax.main", f"--config={REPO}/configs/arith_tiny.py",
            f"--workdir={workdir}", "--config.sft.steps=0", "--config.model.tiny.num_layers=1",
            "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
            "--config.model.tiny.head_dim=16", "--config.data.prompts_per_step=2",
            "--config.rollout.n=4", "--config.rollout.max_new_tokens=4",
            "--config.eval.max_examples=4", "--config.eval.max_new_tokens=4",
            "--config.train.progress=False", *overrides]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    return subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def _last_rows(workdir: str) -> dict[int, dict]:
    rows = {}
    for r in read_metrics(workdir):
        if "rollout/reward_mean" in r:
            rows[r["step"]] = {k: v for k, v in r.items() if not k.startswith("time/")
                               and k != "rollout/tokens_per_s"}
    return rows


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
    assert not os.path.exists(tmp_path / "checkpoints")


@pytest.mark.parametrize("name, family_checks", [
    ("deepscaler_r1_1p5b_int8", {"rollout.precision": "int8", "rl.loss_mode": "acr",
                                 "rollout.invariant_scaling": 1.5, "rl.kl_coef": 1e-3,
                                 "rl.kl_estimator": "k3", "optim.learning_rate": 1e-6,
                                 "rl.advantage": "grpo", "rollout.n": 8}),
    ("dapo_qwen2p5_7b_fp8", {"rollout.precision": "fp8", "rl.eps_low": 0.2, "rl.eps_high": 0.28,
                             "rl.agg": "token_mean", "rl.dynamic_sampling": True,
                             "rl.kl_coef": 0.0, "rl.overlong_buffer": 4096,
                             "rollout.invariant_scaling": 1.5, "rl.cap": 5.0}),
    ("gsm8k_qwen2p5_0p5b_int8", {"rollout.precision": "int8", "rollout.invariant_scaling": 1.0,
                                 "optim.learning_rate": 1e-5, "rl.cap": 2.0}),
])
def test_large_configs_one_step_with_tiny_model(tmp_path, name, family_checks):
    c = _load_config(name)
    for key, expected in family_checks.items():
        section, field = key.split(".")
        assert c[section][field] == expected, key
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
    c.rollout.n = 2
    c.rollout.max_new_tokens = 8
    c.rl.num_minibatches = 1
    c.rl.num_micro_batches = 2
    c.rl.max_gen_batches = 2
    c.rl.overlong_buffer = min(c.rl.overlong_buffer, 4)
    c.mesh.update(dict(data=1, fsdp=1, tensor=1))
    c.eval.files = ()
    c.train.progress = False
    c.lock()
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        t = Trainer(c, str(tmp_path))
        m = t.step()
    finally:
        os.chdir(cwd)
    _finite_metrics(m)
    assert m["rollout/tokens"] > 0


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


def test_dynamic_sampling_refills_all_equal_groups(tmp_path):
    from qurl_jax import quant
    from qurl_jax.metrics import PhaseTimer

    c = tiny_config(**{"rl.dynamic_sampling": True, "rl.max_gen_batches": 3})
    t = Trainer(c, str(tmp_path))
    n = c.rollout.n
    # Call 1: group 0 mixed, group 1 all zero. Call 2: group 0 all zero, group 1 mixed.
    scripted = iter([[1, 0, 0, 0] + [0] * n, [0] * n + [0, 1, 1, 0]])
    t.task.rewards = lambda texts, answers: np.asarray(next(scripted), np.float32)
    params = quant.requantize(t.params, t.recipe)
    r, stats = t.collect(params, jax.random.key(0), PhaseTimer())
    assert stats["rollout/gen_batches"] == 2 and stats["rollout/kept_group_frac"] == 1.0
    np.testing.assert_array_equal(r.rewards, [1, 0, 0, 0, 0, 1, 1, 0])
    assert r.resp_mask.sum() > 0


def test_dynamic_sampling_masks_groups_it_cannot_refill(tmp_path):
    from qurl_jax import quant
    from qurl_jax.metrics import PhaseTimer

    c = tiny_config(**{"rl.dynamic_sampling": True, "rl.max_gen_batches": 2})
    t = Trainer(c, str(tmp_path))
    n = c.rollout.n
    scripted = iter([[1, 0, 1, 0] + [0] * n, [0] * 2 * n])  # the refill round finds nothing
    t.task.rewards = lambda texts, answers: np.asarray(next(scripted), np.float32)
    params = quant.requantize(t.params, t.recipe)
    r, stats = t.collect(params, jax.random.key(0), PhaseTimer())
    assert stats["rollout/kept_group_frac"] == 0.5
    assert r.resp_mask[n:].sum() == 0 and r.resp_mask[:n].sum() > 0


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
