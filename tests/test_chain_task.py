"""The chain task wired into the trainer (fast): config fields and their errors, the warm start on
the buggy teacher's chains, the two evaluation sets, rewards on the final answer only, two RL steps
with plots, and the shape of `configs/chain_tiny.py`'s problems (replies fit, a 64-token KV budget
evicts)."""

import importlib.util
import os

import numpy as np
import pytest

from qurl_jax.config.base import base_config, validate
from qurl_jax.config.settings import RunSettings, chain_config
from qurl_jax.data import chains
from qurl_jax.train import warm_start
from qurl_jax.train.tasks import CHAIN_EVAL_SIZE, CHAIN_TRAIN_SIZE, build_model_and_task
from qurl_jax.train.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _chain_tiny():
    path = os.path.join(REPO, "configs", "chain_tiny.py")
    spec = importlib.util.spec_from_file_location("chain_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def tiny_chain_config(**overrides):
    c = base_config()
    c.model.source = "tiny"
    c.model.tiny.update(dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                             num_kv_heads=1, head_dim=16))
    c.data.task = "chain"
    c.data.prompts_per_step = 2
    c.data.max_prompt_len = 32
    c.rollout.precision = "fp"
    c.rollout.n = 4
    c.rollout.max_new_tokens = 12
    c.optim.learning_rate = 1e-3
    c.rl.num_minibatches = 2
    c.train.num_steps = 2
    c.train.checkpoint_every = 1
    c.train.progress = False
    c.eval.k = 2
    c.eval.max_examples = 4
    c.eval.max_new_tokens = 12
    for key, value in overrides.items():
        section, name = key.rsplit(".", 1)
        c[section][name] = value
    return c


@pytest.mark.parametrize("field, value, message", [
    ("data.chain_min_steps", 0, "config.data.chain_min_steps=0"),
    ("data.chain_max_steps", 2, "config.data.chain_min_steps=5 <= config.data.chain_max_steps=2"),
    ("data.chain_carry10_share", 1.5, "config.data.chain_carry10_share=1.5"),
    ("sft.bug_rate", -0.1, "config.sft.bug_rate=-0.1"),
    ("data.split_seed", -2, "config.data.split_seed=-2"),
])
def test_bad_chain_fields_are_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        validate(tiny_chain_config(**{field: value}))


def test_config_defaults_are_the_chain_configs():
    assert chain_config(base_config().data) == chains.ChainConfig()


def test_warm_start_trains_on_the_buggy_teachers_chains(tmp_path, monkeypatch):
    seen = {}

    def fake_warm_start(model_config, params, pairs, tokenizer, **kwargs):
        seen["pairs"] = pairs
        return params

    monkeypatch.setattr(warm_start, "supervised_warm_start", fake_warm_start)
    c = tiny_chain_config(**{"sft.steps": 1, "sft.bug_rate": 1.0})
    _, _, task = build_model_and_task(RunSettings.from_config(c), str(tmp_path))
    assert len(seen["pairs"]) == len(task.train_examples) == CHAIN_TRAIN_SIZE
    rng = np.random.default_rng(0)
    for (prompt, reply), ex in zip(seen["pairs"][:20], task.train_examples[:20], strict=True):
        assert prompt == task.prompt_text(ex.problem)
        assert reply == chains.teacher_reply(ex.problem, 1.0, rng)[0] + "<|eos|>"
    task.close()

    # The cache is keyed on the teacher's slip rate: another rate rebuilds, the same one reloads.
    seen.clear()
    build_model_and_task(RunSettings.from_config(c), str(tmp_path))[2].close()
    assert not seen
    build_model_and_task(RunSettings.from_config(
        tiny_chain_config(**{"sft.steps": 1, "sft.bug_rate": 0.5})), str(tmp_path))[2].close()
    assert seen


def test_split_seed_fixes_the_held_out_problems_across_seeds(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_start, "supervised_warm_start", lambda m, params, *a, **k: params)

    def held_out(seed: int, split_seed: int = -1) -> list[str]:
        c = tiny_chain_config(**{"sft.steps": 1, "data.split_seed": split_seed})
        c.seed = seed
        _, _, task = build_model_and_task(RunSettings.from_config(c),
                                          str(tmp_path / f"{seed}_{split_seed}"))
        task.close()
        return [ex.problem for ex in task.eval_sets["chain"]]

    fixed = held_out(1, split_seed=0)
    assert fixed == held_out(2, split_seed=0) == held_out(0)
    assert held_out(1) != fixed  # without it the split follows the seed


def test_two_rl_steps_evaluate_both_sets_and_write_plots(tmp_path):
    t = Trainer(tiny_chain_config(), str(tmp_path))
    held_out = t.task.eval_sets["chain"]
    carry10 = t.task.eval_sets["chain_carry10"]
    assert len(held_out) == CHAIN_EVAL_SIZE
    assert carry10 == [ex for ex in held_out if chains.is_carry10(ex.problem)]
    assert 0.4 < len(carry10) / len(held_out) < 0.9

    # The verifier reads the final answer only; a wrong step or a missing answer decides nothing.
    reward, accuracy = t.task.rewards(
        ["1+1=3;answer:48", "47+1=48;answer:47", "47+1=48;48"], ["48", "48", "48"])
    np.testing.assert_array_equal(reward, [1.0, 0.0, 0.0])
    np.testing.assert_array_equal(accuracy, reward)

    summary = t.train()
    assert summary["end_step"] == 2
    for when in ("eval_before", "eval_after"):
        for name in ("chain", "chain_carry10"):
            for metric in ("avg@2", "pass@2", "greedy_acc"):
                assert 0.0 <= summary[when][f"{name}/{metric}"] <= 1.0
            assert summary[when][f"{name}/num_examples"] == 4
    assert np.isfinite(summary["last"]["rollout/reward_mean"])
    assert {os.path.basename(p) for p in summary["plots"]} >= {
        "reward_accuracy.png", "response_length.png", "update.png"}
    assert all(os.path.getsize(p) > 0 for p in summary["plots"])


def test_chain_tiny_replies_fit_and_overflow_a_64_token_kv_budget():
    c = validate(_chain_tiny())
    assert c.data.task == "chain" and c.rollout.precision == "fp"
    train, held_out = chains.chain_splits(CHAIN_TRAIN_SIZE, CHAIN_EVAL_SIZE, seed=c.seed,
                                          config=chain_config(c.data))
    # One character per token with the embedded tokenizer, plus EOS; prompts add <bos><user>
    # ... <assistant>.
    replies = [len(chains.solve(ex.problem)[0]) + 1 for ex in train + held_out]
    prompts = [len(ex.problem) + 3 for ex in train + held_out]
    assert max(prompts) <= c.data.max_prompt_len
    assert max(replies) + 8 <= min(c.rollout.max_new_tokens, c.eval.max_new_tokens)
    assert np.percentile(replies, 5) >= 48
    # A 64-token KV budget (prompt included) evicts on (nearly) every row.
    assert np.mean([p + r > 64 for p, r in zip(prompts, replies, strict=True)]) > 0.99
