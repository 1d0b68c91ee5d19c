"""Bad input ends `python -m qurl_jax.main` with one line naming the file, field or path, exit code
2, no traceback and nothing written; each case is the exact command a user would type. The errors
fire before JAX compiles anything, so each command takes seconds. Also --help and --print_config.
"""

import os
import subprocess
import sys

import pytest

from tests.cli import assert_one_line, cli_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "--config=configs/arith_tiny.py"


def _run(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qurl_jax.main", *args], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=timeout)


def _assert_nothing_written(workdir) -> None:
    assert not os.path.exists(os.path.join(workdir, "metrics.jsonl"))
    checkpoints = os.path.join(workdir, "checkpoints")
    assert not os.path.isdir(checkpoints) or not any(
        name.isdigit() for name in os.listdir(checkpoints))


def test_missing_config_file(tmp_path):
    assert_one_line(_run("--config=configs/nope.py", f"--workdir={tmp_path}"),
                     "bad config", "configs/nope.py", "no such file")


def test_config_file_with_a_syntax_error(tmp_path):
    config = tmp_path / "broken.py"
    config.write_text("def get_config(:\n    pass\n")
    assert_one_line(_run(f"--config={config}", f"--workdir={tmp_path / 'w'}"),
                     "bad config file", "broken.py:1", "syntax")


def test_config_file_whose_get_config_raises(tmp_path):
    config = tmp_path / "raises.py"
    config.write_text("def get_config():\n    return undefined_name\n")
    assert_one_line(_run(f"--config={config}", f"--workdir={tmp_path / 'w'}"),
                     "bad config file", "undefined_name")


def test_workdir_that_is_a_file(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    assert_one_line(_run(TINY, f"--workdir={path}"), "bad workdir", str(path), "is a file")


def test_workdir_that_cannot_be_written(tmp_path):
    # /proc/self is a directory nobody, root included, can create files in.
    assert_one_line(_run(TINY, "--workdir=/proc/self"), "bad workdir", "/proc/self",
                     "not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_read_only_workdir(tmp_path):
    workdir = tmp_path / "ro"
    workdir.mkdir()
    workdir.chmod(0o555)
    try:
        assert_one_line(_run(TINY, f"--workdir={workdir}"), "bad workdir", "not writable")
    finally:
        workdir.chmod(0o755)


def test_mesh_larger_than_the_devices(tmp_path):
    assert_one_line(_run(TINY, f"--workdir={tmp_path}", "--config.mesh.fsdp=4"),
                     "bad mesh", "'fsdp': 4", "needs 4 devices", "has 1 device")
    assert not os.listdir(tmp_path)


@pytest.mark.parametrize("content, words", [
    ('[{"problem": "1+1", "answer": "2"},', ("invalid JSON array",)),
    ('{"problem": "1+1", "answer": \n', ("no usable row", "invalid JSON line")),
    ('{"question_typo": "1+1"}\n', ("no usable row among 1",)),
])
def test_data_file_without_usable_rows(tmp_path, content, words):
    data = tmp_path / "train.json"
    data.write_text(content)
    workdir = tmp_path / "w"
    line = assert_one_line(_run(TINY, f"--workdir={workdir}", "--config.data.task=math",
                                 f"--config.data.train_files=('{data}',)"),
                            "bad data", "config.data.train_files", str(data), *words)
    assert "max_prompt_len" not in line
    _assert_nothing_written(workdir)


@pytest.mark.parametrize("override, field", [
    ("--config.sft.batch_size=0", "config.sft.batch_size=0 must be > 0"),
    ("--config.sft.batch_size=-4", "config.sft.batch_size=-4 must be > 0"),
    ("--config.reward.workers=0", "config.reward.workers"),
    ("--config.rollout.top_k=-1", "config.rollout.top_k"),
    ("--config.optim.end_lr_ratio=2.0", "config.optim.end_lr_ratio"),
    ("--config.model.tiny.num_layers=0", "config.model.tiny.num_layers"),
    ("--config.mesh.fsdp=0", "config.mesh.fsdp"),
    ("--config.mesh.dcn.data=0", "config.mesh.dcn.data"),
])
def test_out_of_range_numbers(tmp_path, override, field):
    assert_one_line(_run(TINY, f"--workdir={tmp_path}", override), "bad config", field)
    assert not os.listdir(tmp_path)


def test_model_path_ignored_by_the_tiny_source_is_named():
    from qurl_jax.config.base import ignored_fields, load_config_file

    c = load_config_file(os.path.join(REPO, "configs", "arith_tiny.py"))
    c.unlock()
    c.model.path = "/nonexistent"
    (warning,) = ignored_fields(c)
    assert "config.model.path='/nonexistent' is ignored" in warning


def test_help_exits_zero_and_points_to_print_config():
    out = _run("--help")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--print_config" in out.stdout and "--config.<section>.<field>" in out.stdout


def test_print_config_lists_every_field_with_its_doc():
    out = _run(TINY, "--print_config", "--config.rl.cap=3.5")
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert "rl.cap = 3.5  # truncation C of the importance weight pi_prox / pi_behav" in lines
    assert any(line.startswith("model.source = 'tiny'  # ") for line in lines)
    assert any(line.startswith("mesh.dcn.data = 1  # ") for line in lines)
    assert all(len(line) <= 100 for line in lines)
