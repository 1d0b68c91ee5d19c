"""A failing reward is never silent: the first failure is logged once with its response, the
summary counts the failures, a batch in which every call failed stops the run in one line
(`RewardError`), and a wrong-length or non-numeric return is named a bad reward function."""

import logging
import subprocess
import sys

import pytest

from qurl_jax.data import reward_hook
from qurl_jax.data.rewards import RewardComputer
from qurl_jax.runtime.errors import RewardError
from qurl_jax.runtime.metrics import format_summary
from tests.cli import REPO, assert_one_line, cli_env, tree_first_pythonpath

ENV = cli_env(PYTHONPATH=tree_first_pythonpath())

HOOKS = '''
def always_raises(responses, answers):
    raise KeyError("no such field")

def two_values(responses, answers):
    return [1.0, 0.0]

def a_string(responses, answers):
    return ["high"]

def odd(responses, answers):
    if responses[0] == "bad":
        raise ValueError("odd one")
    return [1.0]
'''


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    return str(path)


def _raises(response, answer):
    raise ZeroDivisionError(f"cannot score {response}")


def test_every_call_failing_stops_with_the_first_failure_and_its_response(caplog):
    with caplog.at_level(logging.WARNING), \
            RewardComputer(_raises, num_workers=2, use_processes=False,
                           stop_if_all_fail=True) as rc:
        with pytest.raises(RewardError) as e:
            rc(["resp-a", "resp-b", "resp-c"], ["1", "2", "3"])
        assert rc.stats["errors"] == 3
    message = str(e.value)
    assert "every one of the 3 reward calls" in message and "ZeroDivisionError" in message
    assert "'resp-" in message  # the response that caused it
    firsts = [r.getMessage() for r in caplog.records if "first failing call" in r.getMessage()]
    assert len(firsts) == 1 and "ZeroDivisionError: cannot score resp-" in firsts[0]


def test_some_calls_failing_go_on_and_are_logged_once(caplog, hooks):
    computer = reward_hook.hook_computer(f"{hooks}:odd", workers=1, timeout_s=5.0)
    try:
        with caplog.at_level(logging.WARNING):
            assert computer(["ok", "bad", "bad"], [("a", "p")] * 3) == [1.0, 0.0, 0.0]
            assert computer(["bad", "ok"], [("a", "p")] * 2) == [0.0, 1.0]
        assert computer.stats["errors"] == 3
        firsts = [r for r in caplog.records if "first failing call" in r.getMessage()]
        assert len(firsts) == 1 and "ValueError: odd one" in firsts[0].getMessage()
        assert "(response 'bad')" in firsts[0].getMessage()
    finally:
        computer.close()


@pytest.mark.parametrize("name, words", [
    ("two_values", "bad reward function: it returned 2 values for 1 response"),
    ("a_string", "bad reward function: it returned 'high', not a float"),
    ("always_raises", "KeyError: 'no such field'"),
])
def test_a_broken_reward_function_is_named(hooks, name, words):
    computer = reward_hook.hook_computer(f"{hooks}:{name}", workers=1, timeout_s=5.0)
    try:
        with pytest.raises(RewardError, match="every one of the 2 reward calls") as e:
            computer(["x", "y"], [("a", "p")] * 2)
        assert words in str(e.value)
    finally:
        computer.close()


def test_the_summary_shows_the_reward_failures():
    summary = {"start_step": 0, "end_step": 3,
               "last": {"verifier/errors": 278.0, "verifier/timeouts": 0.0, "loss": 1.0}}
    text = format_summary(summary)
    assert "reward calls failed (scored 0): errors 278" in text
    assert "timeouts" not in text
    assert "reward calls failed" not in format_summary(
        {"start_step": 0, "end_step": 3, "last": {"verifier/errors": 0.0}})


@pytest.mark.slow  # kept out of the default suite's 15-minute budget
def test_main_stops_in_one_line_when_the_reward_fails_on_every_call(tmp_path, hooks):
    """The user's path: a config's reward function that raises on every call."""
    out = subprocess.run(
        [sys.executable, "-m", "qurl_jax.main", "--config=configs/arith_tiny.py",
         f"--workdir={tmp_path / 'w'}", f"--config.reward.function={hooks}:always_raises",
         "--config.sft.steps=1", "--config.model.tiny.num_layers=1",
         "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
         "--config.model.tiny.head_dim=16", "--config.data.prompts_per_step=2",
         "--config.rollout.n=2", "--config.rollout.max_new_tokens=4", "--config.eval.before=False",
         "--config.train.num_steps=2", "--config.train.report_speed=False",
         "--config.train.progress=False"],
        cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    line = assert_one_line(out, "bad reward function", "every one of the 4 reward calls",
                           "KeyError: 'no such field'")
    assert "first failing call" in out.stderr  # logged before the stop too
    del line
