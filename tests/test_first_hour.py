"""A new user's first hour (issue 49): quiet good runs, messages that name what to fix."""

import glob
import os
import re
import subprocess
import sys

import pytest

from qurl_jax.train.trainer import Trainer
from tests.cli import cli_env
from tests.test_trainer import REPO, tiny_config

TINY = ("--config.sft.steps=0", "--config.model.tiny.num_layers=1",
        "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
        "--config.model.tiny.head_dim=16", "--config.model.tiny.num_heads=2",
        "--config.model.tiny.num_kv_heads=1", "--config.eval.max_examples=4",
        "--config.eval.max_new_tokens=4", "--config.rollout.max_new_tokens=4",
        "--config.data.max_prompt_len=32")
# The source tree (realpath: from Bazel's runfiles, the tree this file links to), for the docs and
# install files the runfiles do not carry.
SOURCE = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
OURS = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "qurl_jax", "**", "*.py"),
                                               recursive=True)}


def _library_info_lines(text: str) -> list[str]:
    """absl INFO lines ("I1127 09:14:35.8 123 file.py:139] ...") from files not of qurl_jax."""
    lines = []
    for line in text.splitlines():
        m = re.match(r"^I\d{4} [\d:.]+\s+\d+ (\S+?):\d+\]", line)
        if m and m.group(1) not in OURS:
            lines.append(line)
    return lines


@pytest.mark.slow  # kept out of the default suite's 15-minute budget
def test_evaluate_keeps_orbax_info_out_as_main_does(tmp_path):
    workdir = str(tmp_path / "run")
    c = tiny_config(**{"sft.steps": 0, "eval.max_examples": 4, "eval.max_new_tokens": 4})
    t = Trainer(c, workdir)
    t.step_count = 1  # a checkpoint to restore (its values do not matter here)
    t._save(force=True)
    t._close()
    evaluated = subprocess.run(
        [sys.executable, "-m", "qurl_jax.evaluate", f"--config={REPO}/configs/arith_tiny.py",
         f"--workdir={workdir}", *TINY],
        cwd=REPO, env=cli_env(),
        capture_output=True, text=True, timeout=600)
    text = evaluated.stdout + evaluated.stderr
    assert evaluated.returncode == 0, text[-3000:]
    assert "evaluation at step 1" in evaluated.stdout
    noisy = _library_info_lines(text)
    assert not noisy, "\n".join(noisy[:5])


def _main_line(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qurl_jax.main",
                           f"--config={REPO}/configs/arith_tiny.py", "--workdir=/nonexistent/w",
                           *args], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, JAX_PLATFORMS="cpu"))


def test_flag_messages_name_the_full_field_and_say_flag_once():
    from tests.cli import assert_one_line

    line = assert_one_line(_main_line("--config.rollout.presicion=int8"), "bad flag")
    assert "--config.rollout.presicion: no such field 'presicion'" in line
    assert "precision" in line  # the suggestion stays
    line = assert_one_line(_main_line("--config.rollout.n=abc"), "bad flag")
    assert line.startswith("qurl_jax: bad flag: --config.rollout.n=abc: ")
    assert "flag --" not in line.replace("bad flag: --", "")
    line = assert_one_line(_main_line("--config.model.source=hf",
                                      "--config.model.path=/nonexistent/model"), "bad config")
    assert "config.model.path='/nonexistent/model' does not exist" in line


def test_a_compile_only_tpu_target_keeps_libtpus_off_vm_lines_out_of_the_terminal():
    import importlib.util

    if importlib.util.find_spec("libtpu") is None:
        pytest.skip("libtpu not installed")
    code = ("from qurl_jax.parallel import targets; import sys; "
            "t = targets.parse('tpu:v5e-8'); print(len(t.devices()), t.device_kind()); "
            "print('after', file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=dict(env, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("8 TPU v5")
    assert "E0000" not in out.stderr and "unexpected worker hostname" not in out.stderr, out.stderr
    assert "Failed to find host bounds" not in out.stderr
    assert "after" in out.stderr  # stderr itself is back


def _documented_word_problem_flags() -> list[str]:
    """The `--config.*` flags of usage.md's "Word problems" block, as written there."""
    with open(os.path.join(SOURCE, "docs", "usage.md"), encoding="utf-8") as f:
        text = f.read()
    block = text.split("**Word problems", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return re.findall(r"--config\.\S+=\S+", block)


def test_the_documented_word_problem_flags_take_word_problems(tmp_path):
    """The own-task command with the section's additions accepts natural-language prompts
    (without them: the one-line error about data.max_prompt_len), and the warm start is short."""
    import json

    from qurl_jax.config.base import validate
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.runtime.errors import DataError
    from qurl_jax.train.tasks import check_task_data
    from tests.test_own_task import OWN_TASK

    rows = [{"query": f"Tom has {a} apples and buys {b} more at the market. How many apples does "
                      "he have now?", "solution": str(a + b)} for a in range(9) for b in range(9)]
    data = tmp_path / "words.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    own = [f for f in OWN_TASK if "train_files" not in f and "eval.files" not in f] + [
        f"--config.data.train_files={data}", f"--config.eval.files={data}"]

    def settings(flags):
        import importlib.util

        path = os.path.join(SOURCE, "configs", "arith_tiny.py")
        spec = importlib.util.spec_from_file_location("arith_tiny", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        c = module.get_config()
        for flag in flags:
            key, value = flag.removeprefix("--config.").split("=", 1)
            section, name = key.split(".")
            old = c[section][name]
            c[section][name] = (value if isinstance(old, str) else (value,)
                                if isinstance(old, tuple) else type(old)(value))
        return RunSettings.from_config(validate(c))

    documented = _documented_word_problem_flags()
    assert documented, "usage.md lost its word-problem flags"
    s = settings(own + documented)
    check_task_data(s)  # every prompt fits
    assert s.sft.steps <= 500
    with pytest.raises(DataError, match="max_prompt_len"):  # as written before: no prompt fits
        check_task_data(settings(own))


def _pinned_jax() -> str:
    with open(os.path.join(SOURCE, "requirements.txt"), encoding="utf-8") as f:
        return re.search(r"^jax==(\S+)$", f.read(), re.M).group(1)


def test_documented_install_lines_name_the_pinned_jax():
    """Every `pip install ... jax[...]` line of the docs, the launch README and pyproject's extras
    installs the jax that requirements.txt pins; the one-accelerator page has a GPU and a TPU
    line."""
    pin = _pinned_jax()
    files = [os.path.join(SOURCE, "README.md"), os.path.join(SOURCE, "launch", "README.md"),
             *glob.glob(os.path.join(SOURCE, "docs", "*.md"))]
    lines = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                command = re.match(r"^\s*(\$ )?(python3? -m )?pip install", line)
                if command and "jax[" in line:  # a command, not prose about one
                    lines.append((os.path.relpath(path, SOURCE), line.strip()))
    assert len(lines) >= 3, lines
    for where, line in lines:
        for _extra, version in re.findall(r"jax\[([a-z0-9]+)\](?:==([\w.]+))?", line):
            assert version == pin, f"{where}: {line}"
    with open(os.path.join(SOURCE, "pyproject.toml"), encoding="utf-8") as f:
        extras = re.findall(r'"jax\[[a-z0-9]+\]==([\w.]+)"', f.read())
    assert extras and set(extras) == {pin}
    page = open(os.path.join(SOURCE, "docs", "one_accelerator.md"), encoding="utf-8").read()
    assert f'"jax[cuda12]=={pin}"' in page and f'"jax[tpu]=={pin}"' in page
    with open(os.path.join(SOURCE, "launch", "install.sh"), encoding="utf-8") as f:
        install = f.read()
    # The launch script installs the same two from the same pin.
    assert '"jax[cuda12]==${JAX_VERSION}"' in install and '"jax[tpu]==${JAX_VERSION}"' in install
