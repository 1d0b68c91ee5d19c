"""Your own task: a reward function (config or Python), your own data fields and prompt suffix,
repository-relative data paths, comma-separated list overrides, the warm start keyed on the data,
and the evaluate command (a finished run rerun appends nothing; evaluate reproduces its final
evaluation row). The full runs are slow tests; the rest take seconds."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from qurl_jax.config.base import base_config, validate
from qurl_jax.config.overrides import expand_lists
from qurl_jax.config.settings import RunSettings
from qurl_jax.data import reward_hook
from qurl_jax.data.datasets import MathExample, load_math_file
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.runtime.metrics import read_metrics
from qurl_jax.train import warm_start
from tests.cli import REPO, assert_one_line, cli_env, tree_first_pythonpath

EXAMPLE = os.path.join(REPO, "examples", "own_task")
TINY = "--config=configs/arith_tiny.py"
ENV = cli_env(PYTHONPATH=tree_first_pythonpath())

HOOKS = '''
import time

def score(responses, answers, prompts):
    out = []
    for r, a, p in zip(responses, answers, prompts):
        if r == "raise":
            raise RuntimeError("bad response")
        if r == "sleep":
            time.sleep(30)
        if r == "two":
            return [1.0, 2.0]
        if r == "nan":
            return [float("nan")]
        out.append(float(len(r) + 10 * len(a) + 100 * len(p)))
    return out

def plain(responses, answers):
    return [1.0 for _ in responses]

def three(responses, answers, extra):
    return [0.0 for _ in responses]

NUMBER = 3
'''


def _cli(module: str, *args: str, cwd: str = REPO, timeout: int = 600
         ) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def hooks(tmp_path):
    path = tmp_path / "hooks.py"
    path.write_text(HOOKS)
    return str(path)


def _config(**fields):
    c = base_config()
    c.model.source = "tiny"  # 256 positions: lengths that fit them
    c.data.max_prompt_len, c.rollout.max_new_tokens, c.eval.max_new_tokens = 128, 64, 64
    for key, value in fields.items():
        section, name = key.split(".")
        c[section][name] = value
    return c


# ------------------------------------------------------------------------------- reward hook
@pytest.mark.parametrize("spec, words", [
    ("no_such_module_q39:score", ("no module named 'no_such_module_q39'",)),
    ("qurl_jax.data.rewards:no_such_name", ("has no attribute 'no_such_name'",)),
    ("qurl_jax.data.rewards:DEFAULT_TIMEOUT_S", ("float object is not callable",)),
    ("qurl_jax.data.rewards:format_reward", ("cannot be called as",)),
    ("{hooks}:three", ("cannot be called as",)),
    ("{hooks}:NUMBER", ("int object is not callable",)),
    ("{hooks}:missing", ("has no attribute 'missing'",)),
    ("/nonexistent/q39.py:score", ("no such file /nonexistent/q39.py",)),
    ("score", ("must be 'module.path:name'",)),
])
def test_a_bad_reward_function_is_named_by_validate(hooks, spec, words):
    c = _config(**{"reward.function": spec.format(hooks=hooks)})
    with pytest.raises(ConfigError) as e:
        validate(c)
    assert "config.reward.function" in str(e.value)
    for word in words:
        assert word in str(e.value)


def test_a_bad_reward_function_stops_main_in_one_line_before_writing(tmp_path):
    workdir = tmp_path / "w"
    assert_one_line(_cli("qurl_jax.main", TINY, f"--workdir={workdir}",
                   "--config.reward.function=qurl_jax.data.rewards:no_such_name"),
              "bad config", "config.reward.function", "no_such_name")
    assert not workdir.exists()


def test_reward_function_in_the_verifier_processes_counts_failures(hooks):
    assert reward_hook.takes_prompts(reward_hook.load(f"{hooks}:score"), "x")
    assert not reward_hook.takes_prompts(reward_hook.load(f"{hooks}:plain"), "x")
    computer = reward_hook.hook_computer(f"{hooks}:score", workers=2, timeout_s=2.0)
    try:
        assert computer._pool is not None  # worker processes, not threads
        items = [("ab", "c"), ("ab", "cd")]
        start = time.monotonic()
        rewards = computer(["x", "raise", "sleep", "two", "nan", "yz"], items * 3)
        assert time.monotonic() - start < 20
        assert rewards == [1 + 20 + 100, 0.0, 0.0, 0.0, 0.0, 2 + 20 + 200]
        stats = computer.stats
        assert (stats["errors"], stats["timeouts"], stats["calls"]) == (3, 1, 6)
        assert computer(["ok"], [("a", "b")]) == [2 + 10 + 100]  # the pool goes on
    finally:
        computer.close()


def test_a_python_reward_function_workers_cannot_import_runs_in_threads():
    computer = reward_hook.hook_computer(lambda responses, answers: [len(responses[0])],
                                         workers=1, timeout_s=1.0)
    try:
        assert computer._pool is None
        assert computer(["abc"], [("a", "p")]) == [3.0]
    finally:
        computer.close()
    with pytest.raises(ConfigError, match="reward_fn"):
        reward_hook.hook_computer(lambda responses: [], workers=1, timeout_s=1.0)


def _rows(path, rows) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_task_of_own_fields_suffix_and_reward_function(tmp_path, monkeypatch):
    from qurl_jax.data.tokenizer import build_char_tokenizer
    from qurl_jax.train import tasks
    from qurl_jax.train.tasks import build_model_and_task

    # The task without the policy's weights (initialising them is most of the time here).
    monkeypatch.setattr(tasks, "tiny_policy", lambda model, *a, **k: (
        tasks.tiny_model_config(model), None, build_char_tokenizer()))

    data = _rows(tmp_path / "d.jsonl", [{"q": "2 3 8 -> 19", "sol": "8*2+3"},
                                        {"q": "1 1 1 -> 3", "sol": "1+1+1"}])
    c = _config(**{"data.task": "math", "data.train_files": (data,), "data.prompt_key": "q",
                   "data.answer_key": "sol", "data.prompt_suffix": " Answer:",
                   "data.chat_template": False, "data.prompts_per_step": 2, "sft.steps": 0,
                   "model.tiny": dict(base_config().model.tiny, num_layers=1)})

    def reward(responses, answers, prompts):  # a closure: threads, no worker start-up
        return [len(responses[0]) + 10 * len(answers[0]) + 100 * len(prompts[0])]

    _, _, task = build_model_and_task(RunSettings.from_config(validate(c)), str(tmp_path),
                                      reward_fn=reward)
    try:
        assert task.prompt_text("2 3 8 -> 19") == "2 3 8 -> 19 Answer:"
        _, answers = task.next_prompts(2)
        assert sorted(answers) == [("1+1+1", "1 1 1 -> 3"), ("8*2+3", "2 3 8 -> 19")]
        rewards, accuracy = task.rewards(["ok"], [("8*2+3", "2 3 8 -> 19")])
        np.testing.assert_array_equal(rewards, [2 + 50 + 1100])
        np.testing.assert_array_equal(accuracy, rewards)
    finally:
        task.close()
    c.data.prompt_suffix = base_config().data.prompt_suffix  # the math task's default
    c.data.prompt_key = c.data.answer_key = ""
    data = _rows(tmp_path / "e.jsonl", [{"problem": "1+1", "answer": "2"}])
    c.data.train_files = (data,)
    _, _, task = build_model_and_task(RunSettings.from_config(validate(c)), str(tmp_path),
                                      reward_fn=reward)
    try:
        assert task.prompt_text("1+1") == ("1+1 Let's think step by step and output the final "
                                           "answer within \\boxed{}.")
    finally:
        task.close()


# ------------------------------------------------------------------------------ own data
def test_rows_read_through_named_fields(tmp_path):
    path = _rows(tmp_path / "d.jsonl", [
        {"item": {"text": "What is 2+2?"}, "label": 4},
        {"item": {"text": [{"role": "system", "content": "s"},
                           {"role": "user", "content": "Name it."}]}, "label": {"a": 1}},
        {"item": {"text": "no label"}},
    ])
    examples, stats = load_math_file(path, keys=("item.text", "label"))
    assert [(e.problem, e.answer) for e in examples] == [("What is 2+2?", "4"),
                                                         ("Name it.", '{"a": 1}')]
    assert stats.layout == "keys" and stats.skipped == {"missing label": 1}


def test_prompt_key_without_answer_key_is_named():
    with pytest.raises(ConfigError, match="config.data.prompt_key='q'.*set both"):
        validate(_config(**{"data.prompt_key": "q"}))


def test_prompt_fields_of_a_synthetic_task_are_named_as_ignored():
    from qurl_jax.config.base import ignored_fields

    c = _config(**{"data.task": "arithmetic", "data.prompt_suffix": ""})
    assert ignored_fields(c) == ["config.data.prompt_suffix is ignored: data.task='arithmetic' "
                                 "makes its own prompts"]


def test_repository_data_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    c = _config(**{"eval.files": ("examples/own_task/test.jsonl",)})
    settings = RunSettings.from_config(validate(c))  # the default data.train_files, relative
    (train,) = settings.data.train_files
    assert os.path.isabs(train) and os.path.isfile(train)
    assert settings.eval.files == (os.path.join(EXAMPLE, "test.jsonl"),)
    (tmp_path / "examples").mkdir()  # a path that exists here wins over the repository's
    local = _rows(tmp_path / "examples" / "mine.jsonl", [{"problem": "1+1", "answer": "2"}])
    c = _config(**{"data.train_files": ("examples/mine.jsonl",)})
    assert os.path.abspath(RunSettings.from_config(validate(c)).data.train_files[0]) == local


def test_comma_separated_lists_for_list_fields():
    assert expand_lists(["--config.data.train_files=/a.jsonl,/b.jsonl", "--config.eval.files=",
                         "--config.rl.sparse_mask_band=0.5,1.5", "--config.seed=1",
                         "--config.train.loggers=('wandb',)"]) == [
        "--config.data.train_files=('/a.jsonl', '/b.jsonl')", "--config.eval.files=()",
        "--config.rl.sparse_mask_band=(0.5, 1.5)", "--config.seed=1",
        "--config.train.loggers=('wandb',)"]
    out = _cli("qurl_jax.main", TINY, "--print_config",
               "--config.data.train_files=/a.jsonl,/b.jsonl")
    assert out.returncode == 0, out.stderr[-2000:]
    assert any(line.startswith("data.train_files = ('/a.jsonl', '/b.jsonl')")
               for line in out.stdout.splitlines())


# ----------------------------------------------------------------------------- warm start
def test_warm_start_is_rebuilt_when_the_training_data_changes(tmp_path, monkeypatch):
    calls = []

    def fake_sft(model_config, params, pairs, tokenizer, **kw):
        calls.append(pairs)
        return params

    monkeypatch.setattr(warm_start, "supervised_warm_start", fake_sft)
    s = RunSettings.from_config(_config(**{
        "data.task": "math", "data.prompt_suffix": "", "data.chat_template": False,
        "sft.steps": 1, "model.tiny": dict(base_config().model.tiny, num_layers=1, hidden_size=32,
                                           intermediate_size=64, head_dim=16)}))
    first = [MathExample("2 3", "5", "d", 0)]
    changed = [MathExample("2 3", "6", "d", 0)]
    for train in (first, first, changed):
        _, _, tokenizer = warm_start.tiny_policy(s.model, s.data, s.sft, seed=0,
                                                 workdir=str(tmp_path), train=train)
        # The cached warm start keeps the character tokenizer (spaces included).
        assert len(tokenizer.encode("2 3", add_special_tokens=False)) == 3
    assert len(calls) == 2  # built, reused, rebuilt for the changed file
    assert calls[0] == [("2 3", "5<|eos|>")] and calls[1] == [("2 3", "6<|eos|>")]
    with open(tmp_path / "sft_model" / "warm_start.json", encoding="utf-8") as f:
        assert json.load(f)["data_sha256"] == warm_start.data_hash(changed)


CHUNKS_EQUAL = """
import jax
import numpy as np

from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.data.tokenizer import build_char_tokenizer
from qurl_jax.models import init_params
from qurl_jax.train import warm_start
from tests.test_own_task import _config

model = RunSettings.from_config(_config(**{"model.tiny": dict(
    base_config().model.tiny, num_layers=1, hidden_size=32, intermediate_size=64,
    head_dim=16)})).model
cfg = warm_start.tiny_model_config(model)
pairs = [(f"{a}+{b}=", f"{a + b}<|eos|>") for a in range(9) for b in range(5)]
tok = build_char_tokenizer()
assert warm_start._sft_chunk(10 // 5) == 2
out = []
for chunk in (None, 1):
    if chunk:
        warm_start._sft_chunk = lambda every, c=chunk: c
    params = init_params(cfg, jax.random.key(0))
    out.append(jax.device_get(warm_start.supervised_warm_start(
        cfg, params, pairs, tok, steps=10, learning_rate=1e-2, batch_size=8, seed=0)))
for a, b in zip(jax.tree.leaves(out[0]), jax.tree.leaves(out[1]), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
moved = init_params(cfg, jax.random.key(0))
assert any(not np.allclose(a, b) for a, b in zip(jax.tree.leaves(out[0]),
                                                 jax.tree.leaves(moved)))
print("chunks equal")
"""


def test_warm_start_in_chunks_equals_one_step_per_call():
    """The warm start runs its steps in `lax.scan` chunks (`_sft_chunk`); the same draws one step
    per call give the same parameters (10 steps: chunks of 2). Compiled as a user's run is (a
    subprocess without the suite's XLA flags): the property is of that compile. Under the
    suite's loop emitters the two programs round differently, and ten Adam steps move 7 of one
    tensor's 32 weights apart by up to 4e-4 relative."""
    env = dict(ENV, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    out = subprocess.run([sys.executable, "-c", CHUNKS_EQUAL], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "chunks equal" in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------------------- evaluate
def test_evaluate_names_a_missing_checkpoint_step_or_workdir_inassert_one_line(tmp_path):
    assert_one_line(_cli("qurl_jax.evaluate", TINY, f"--workdir={tmp_path}", "--step=7"),
              "--step=7", "holds no checkpoint")
    assert_one_line(_cli("qurl_jax.evaluate", TINY, f"--workdir={tmp_path}/none"),
              "bad workdir", "does not exist")
    assert not os.listdir(tmp_path)


OWN_TASK = ("--config.data.task=math", "--config.data.train_files=examples/own_task/train.jsonl",
            "--config.eval.files=examples/own_task/test.jsonl", "--config.data.prompt_key=query",
            "--config.data.answer_key=solution", "--config.data.prompt_suffix=",
            "--config.reward.function=examples/own_task/reward.py:score")
SMALL = ("--config.sft.steps=40", "--config.model.tiny.num_layers=1",
         "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
         "--config.model.tiny.head_dim=16", "--config.data.prompts_per_step=4",
         "--config.rollout.n=4", "--config.eval.max_examples=16", "--config.train.num_steps=2",
         "--config.train.report_speed=False", "--config.train.progress=False")


@pytest.mark.slow  # ~2 min: a run, its rerun and an evaluation, from another directory
def test_own_task_run_rerun_appends_nothing_and_evaluate_reproduces_it(tmp_path):
    workdir = str(tmp_path / "w")
    args = (f"--config={REPO}/configs/arith_tiny.py", f"--workdir={workdir}", *OWN_TASK, *SMALL)
    out = _cli("qurl_jax.main", *args, cwd=str(tmp_path))
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    rows = read_metrics(workdir)
    steps = [r for r in rows if "rollout/reward_mean" in r]
    assert len(steps) == 2 and steps[-1]["verifier/errors"] == 0
    final = {k.removeprefix("eval/"): v for r in rows if r["step"] == 2 for k, v in r.items()
             if k.startswith("eval/")}
    assert final["test/num_examples"] == 16

    again = _cli("qurl_jax.main", *args, cwd=str(tmp_path))
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert "the run is complete at step 2" in again.stderr
    assert read_metrics(workdir) == rows

    evaluated = _cli("qurl_jax.evaluate", *args, cwd=str(tmp_path))
    assert evaluated.returncode == 0, (evaluated.stdout + evaluated.stderr)[-3000:]
    with open(os.path.join(workdir, "eval", "step_2.json"), encoding="utf-8") as f:
        record = json.load(f)
    assert record["step"] == 2 and record["metrics"] == final
    assert "test/avg@4" in evaluated.stdout
    assert read_metrics(workdir) == rows


def quarter_or_raise(responses, answers):
    """A Python reward function: 0.25, or an error for a response holding a '1'."""
    if "1" in responses[0]:
        raise ValueError("no ones")
    return [0.25]


@pytest.mark.slow  # ~1 min: one RL step
def test_trainer_takes_a_python_reward_function(tmp_path):
    from qurl_jax.train.trainer import Trainer

    data = _rows(tmp_path / "d.jsonl", [{"problem": f"{a}+{b}", "answer": str(a + b)}
                                        for a in range(5) for b in range(5)])
    c = _config(**{"data.task": "math", "data.train_files": (data,), "data.prompt_suffix": "",
                   "data.prompts_per_step": 2, "data.max_prompt_len": 32, "rollout.n": 4,
                   "rollout.max_new_tokens": 4, "train.num_steps": 1, "train.progress": False,
                   "model.tiny": dict(base_config().model.tiny, num_layers=1, hidden_size=32,
                                      intermediate_size=64, head_dim=16)})
    t = Trainer(c, str(tmp_path / "w"), reward_fn=quarter_or_raise)
    assert t.task.reward._pool is not None  # importable: in the verifier processes
    m = t.step()
    rows = 8
    assert m["rollout/reward_mean"] * rows == pytest.approx(0.25 * (rows - m["verifier/errors"]))
    t._close()
    with pytest.raises(ConfigError, match="reward_fn"):
        Trainer(c, str(tmp_path / "x"), reward_fn=lambda responses: [])
    assert not (tmp_path / "x").exists()
