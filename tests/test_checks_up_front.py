"""Checks before anything is written (`qurl_jax.config.checks`): the data (files, rows, prompt
lengths, a user's own file too) and prompt + response against the model's positions fail in one line
with exit code 2 before the workdir, compile_cache/ or checkpoints/ exist and before any INFO line;
settings under which nothing learns are errors, settings that only make the rollout slow are
warnings. Each subprocess case exits before JAX compiles anything (seconds)."""

import json
import os
import subprocess
import sys

import pytest

from qurl_jax.config import checks
from qurl_jax.config.base import load_config_file, validate
from qurl_jax.config.settings import RunSettings
from qurl_jax.runtime.errors import ConfigError, DataError
from qurl_jax.train import tasks
from tests.cli import cli_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = "configs/arith_tiny.py"


def _main(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qurl_jax.main", f"--config={TINY}", *args],
                          cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=120)


def _only_line(out: subprocess.CompletedProcess, workdir, *words: str) -> str:
    """The run failed with exactly one line (no INFO line before it) and created no workdir."""
    lines = (out.stdout + out.stderr).splitlines()
    assert out.returncode == 2, lines[-20:]
    assert len(lines) == 1 and lines[0].startswith("qurl_jax: "), lines[-20:]
    for word in words:
        assert word in lines[0], lines[0]
    assert not os.path.exists(workdir)  # so no compile_cache/, checkpoints/ or sft_model/
    return lines[0]


def _config(path: str = TINY, **fields):
    c = load_config_file(os.path.join(REPO, path))
    c.update_from_flattened_dict(fields)
    return c


def _user_file(tmp_path, rows, name: str = "mine") -> str:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


ROWS = [{"problem": "Tom has 3 apples and buys 4 more. How many apples?", "answer": "7"},
        {"problem": "A box holds 6 eggs. How many eggs are in 2 boxes?", "answer": "12"}]


def test_no_prompt_fits_a_users_file_before_the_workdir(tmp_path):
    # Before: the check fired in the task, after the warm start (2:21) and with the workdir,
    # compile_cache/ and checkpoints/ created, as a 26-line traceback.
    data = _user_file(tmp_path, ROWS)
    workdir = tmp_path / "w"
    _only_line(_main(f"--workdir={workdir}", "--config.data.task=math",
                     f"--config.data.train_files=('{data}',)", "--config.data.max_prompt_len=8"),
               workdir, "bad data", "config.data.max_prompt_len=8", "no training prompt fits",
               "the shortest of 2 has")


def test_no_prompt_fits_the_synthetic_task():
    with pytest.raises(DataError, match=r"config\.data\.max_prompt_len=2: no training prompt fits"):
        tasks.check_task_data(RunSettings.from_config(_config(**{"data.max_prompt_len": 2})))


def test_evaluation_prompts_must_fit_the_sampler(tmp_path):
    # The sampler refuses a prompt longer than data.max_prompt_len: before, at the evaluation.
    data = _user_file(tmp_path, ROWS)
    held_out = _user_file(tmp_path, ROWS + [{"problem": "x" * 300, "answer": "1"}], "held_out")
    c = _config(**{"data.task": "math", "data.train_files": (data,), "data.max_prompt_len": 200,
                   "eval.files": (held_out,)})
    with pytest.raises(DataError, match=r"config\.eval\.files: 1 of the 3 prompts of evaluation "
                                        r"set 'held_out' are longer than data\.max_prompt_len=200"):
        tasks.check_task_data(RunSettings.from_config(c))
    c.eval.max_examples = 2  # the evaluation reads the first two only: they fit
    tasks.check_task_data(RunSettings.from_config(c))


@pytest.mark.parametrize("content", ["{broken\n", ""])
def test_malformed_or_empty_file_before_any_info_line(tmp_path, content):
    # Before: the right line, but after two INFO lines and with the workdir, compile_cache/ and
    # checkpoints/ created.
    data = tmp_path / "train.jsonl"
    data.write_text(content)
    workdir = tmp_path / "w"
    _only_line(_main(f"--workdir={workdir}", "--config.data.task=math",
                     f"--config.data.train_files=('{data}',)"),
               workdir, "bad data", "config.data.train_files", "no usable row")


def test_a_library_users_trainer_checks_the_data_before_writing(tmp_path):
    from qurl_jax.train.trainer import Trainer

    data = tmp_path / "train.jsonl"
    data.write_text("{broken\n")
    c = _config(**{"data.task": "math", "data.train_files": (str(data),)})
    with pytest.raises(DataError, match="no usable row"):
        Trainer(c, str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


@pytest.mark.parametrize("fields, match", [
    ({"rollout.max_new_tokens": 1000},
     r"config\.rollout\.max_new_tokens=1000: data\.max_prompt_len \+ rollout\.max_new_tokens = "
     r"32 \+ 1000 = 1032 tokens, more than the model's 256 positions "
     r"\(model\.tiny\.max_position_embeddings\)"),
    ({"eval.max_new_tokens": 300}, r"config\.eval\.max_new_tokens=300: .* = 332 tokens, more than "
     r"the model's 256 positions"),
    ({"data.max_prompt_len": 250}, r"config\.rollout\.max_new_tokens=8: .* 250 \+ 8 = 258"),
])
def test_prompt_and_response_must_fit_the_models_positions(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate(_config(**fields))
    validate(_config(**{**fields, "model.tiny.max_position_embeddings": 2048}))


def test_the_context_of_a_hugging_face_config(tmp_path):
    from qurl_jax.models import ModelConfig
    from qurl_jax.models.hf import config_to_hf

    model = ModelConfig(model_type="qwen2", attention_bias=True, vocab_size=64, hidden_size=32,
                        intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1,
                        head_dim=16,
                        max_position_embeddings=64)
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(model)))
    c = _config(**{"model.source": "hf", "model.path": str(tmp_path)})
    c.data.max_prompt_len = 60
    with pytest.raises(ConfigError, match=rf"64 positions \(max_position_embeddings of "
                                          rf"{tmp_path}/config.json\)"):
        validate(c)
    # A math run without evaluation files samples no evaluation: only the rollout must fit.
    c = _config(**{"model.source": "hf", "model.path": str(tmp_path), "data.task": "math",
                   "data.max_prompt_len": 32, "rollout.max_new_tokens": 32,
                   "eval.max_new_tokens": 1024, "eval.files": ()})
    validate(c)
    # model.max_positions runs past the checkpoint's positions knowingly (the 7B DAPO config), and
    # is then the limit the check names.
    c = _config(**{"model.source": "hf", "model.path": str(tmp_path), "model.max_positions": 96})
    c.data.max_prompt_len = 60
    validate(c)
    c.rollout.max_new_tokens = 40
    with pytest.raises(ConfigError, match=r"96 positions \(model\.max_positions\)"):
        validate(c)


@pytest.mark.parametrize("fields, match", [
    ({"rollout.n": 1}, r"config\.rollout\.n=1: rl\.advantage='grpo' .* every advantage 0"),
    ({"rollout.n": 1, "rl.advantage": "rloo", "rl.num_minibatches": 1},
     r"config\.rollout\.n=1: rl\.advantage='rloo'"),
    ({"rollout.top_k": 1}, r"config\.rollout\.top_k=1 samples greedily"),
    ({"rl.cap": 0.5}, r"config\.rl\.cap=0\.5 < 1 truncates every token's importance weight"),
    ({"rl.cap": 0.9, "rl.loss_mode": "tis"}, r"config\.rl\.cap=0\.9 < 1"),
    ({"rl.sparse_cap": 0.8, "rl.loss_mode": "sparse_rl"}, r"config\.rl\.sparse_cap=0\.8 < 1"),
    ({"rl.loss_mode": "mis", "rl.mis_lo": 1.2, "rl.mis_hi": 3.0},
     r"config\.rl\.mis_lo=1\.2, mis_hi=3\.0: the band excludes the on-policy weight 1"),
    ({"rl.loss_mode": "sparse_rl", "rl.sparse_mask_band": (0.2, 0.9)},
     r"config\.rl\.sparse_mask_band=\(0\.2, 0\.9\) excludes the on-policy weight 1"),
    ({"rl.loss_mode": "sparse_rl", "rl.veto_tau": 1.5}, r"config\.rl\.veto_tau=1\.5 >= 1 vetoes"),
])
def test_settings_under_which_nothing_learns_are_errors(fields, match):
    with pytest.raises(ConfigError, match=match):
        validate(_config(**fields))


def test_caps_a_mode_does_not_read_are_not_errors():
    validate(_config(**{"rl.cap": 0.5, "rl.loss_mode": "sparse_rl"}))  # reads sparse_cap
    validate(_config(**{"rl.cap": 0.5, "rl.loss_mode": "on_policy"}))
    validate(_config(**{"rollout.top_k": 2, "rl.cap": 1.0}))
    validate(_config(**{"rl.loss_mode": "acr", "rl.mis_lo": 1.2, "rl.mis_hi": 3.0}))
    validate(_config(**{"rl.loss_mode": "sparse_rl", "rl.sparse_mask_band": (0.5, 1.5)}))


def test_a_rollout_of_one_row_at_a_time_is_a_warning():
    assert checks.slow_settings(validate(_config())) == []
    c = validate(_config(**{"rollout.max_concurrent_rows": 1}))
    assert [w.split(":")[0] for w in checks.slow_settings(c)] == [
        "config.rollout.max_concurrent_rows=1"]
    # Rows of 32 + 8 tokens take 3 pages of 16: a pool of 4 pages holds one row, 6 hold two.
    c = validate(_config(**{"rollout.kv_pages": 4, "rollout.max_concurrent_rows": 16}))
    (line,) = checks.slow_settings(c)
    assert line.startswith("config.rollout.kv_pages=4: a batch shard's pool of 4 pages of 16 "
                           "tokens holds one row") and "at least 6 pages" in line
    c = validate(_config(**{"rollout.kv_pages": 6, "rollout.max_concurrent_rows": 16}))
    assert checks.slow_settings(c) == []


def test_the_check_and_the_task_read_a_file_once_and_a_changed_file_again(tmp_path, monkeypatch):
    from qurl_jax.train import tasks

    reads = []
    real = tasks.load_math_file
    monkeypatch.setattr(tasks, "load_math_file",
                        lambda path, **kw: reads.append(path) or real(path, **kw))
    data = _user_file(tmp_path, ROWS)
    s = RunSettings.from_config(_config(**{"data.task": "math", "data.train_files": (data,),
                                           "data.max_prompt_len": 256}))
    tasks.check_task_data(s)
    train, _, _ = tasks.task_examples(s)
    assert reads == [data] and [ex.answer for ex in train] == ["7", "12"]
    train.clear()  # a caller's list is its own
    assert len(tasks.task_examples(s)[0]) == 2 and reads == [data]
    _user_file(tmp_path, ROWS[:1])  # rewritten: another size, so read again
    assert len(tasks.task_examples(s)[0]) == 1 and reads == [data, data]


def test_cpu_dots_is_validated_and_applied_before_jax_starts(monkeypatch) -> None:
    """`train.cpu_dots`: a bad value is one ConfigError naming the field; 'eigen' adds XLA's flag
    to XLA_FLAGS only before JAX starts a backend (after, a line says it was not applied), and a
    user's own setting of the flag wins."""
    import jax

    from qurl_jax.runtime import xla_cpu

    c = load_config_file(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                      "arith_tiny.py"))
    c.train.cpu_dots = "mkl"
    with pytest.raises(ConfigError, match="train.cpu_dots"):
        validate(c)
    with pytest.raises(ValueError, match="cpu_dots"):
        xla_cpu.apply("mkl")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    assert xla_cpu.apply("xla") is None
    jax.devices()  # this process's backends have started
    assert "not applied" in xla_cpu.apply("eigen")
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=8"
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_experimental_ynn_fusion_type=dot")
    assert xla_cpu.apply("eigen") is None
    assert os.environ["XLA_FLAGS"] == "--xla_cpu_experimental_ynn_fusion_type=dot"
    # A fresh process: set before its backend starts and read by XLA (it aborts on a flag it
    # does not know), the product computed.
    monkeypatch.delenv("XLA_FLAGS")
    code = ("import os, jax; from qurl_jax.runtime import xla_cpu; "
            "assert xla_cpu.apply('eigen') is None; print(os.environ['XLA_FLAGS']); "
            "x = jax.numpy.ones((64, 64)); print(float((x @ x.T).sum()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["--xla_cpu_experimental_ynn_fusion_type=", "262144.0"]


_ARENAS = """
import ctypes, sys, threading
from qurl_jax.runtime import malloc
print(malloc.cap_arenas(int(sys.argv[1])), flush=True)
libc = ctypes.CDLL(None)
barrier = threading.Barrier(6)
def allocate():
    barrier.wait(); libc.malloc(1000); barrier.wait()  # five threads alive at once, each allocating
threads = [threading.Thread(target=allocate) for _ in range(5)]
for t in threads: t.start()
barrier.wait(); barrier.wait(); libc.malloc_stats()  # one 'Arena i:' block per arena, on stderr
for t in threads: t.join()
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc arenas")
def test_malloc_arenas_is_validated_and_caps_the_arenas_threads_get() -> None:
    """`train.malloc_arenas`: a negative value is one ConfigError naming the field; set in a
    running process (as `main` does, before JAX starts its threads), glibc gives five threads
    that allocate at once no more arenas than the cap; 0 leaves glibc's one per thread; a user's
    MALLOC_ARENA_MAX wins."""
    import platform

    from qurl_jax.runtime import malloc

    c = load_config_file(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                      "arith_tiny.py"))
    c.train.malloc_arenas = -1
    with pytest.raises(ConfigError, match="train.malloc_arenas"):
        validate(c)
    with pytest.raises(ValueError, match="malloc_arenas"):
        malloc.cap_arenas(-1)
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")

    def arenas(cap: int, **env: str) -> int:
        environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
        out = subprocess.run([sys.executable, "-c", _ARENAS, str(cap)], capture_output=True,
                             text=True, timeout=60, env={**environ, **env})
        assert out.returncode == 0 and out.stdout.strip() == "None", out.stderr[-2000:]
        return sum(line.startswith("Arena ") for line in out.stderr.splitlines())

    assert arenas(0) == 6  # the main thread's and one per thread
    assert arenas(1) == 1
    assert arenas(2) == 2
    assert arenas(1, MALLOC_ARENA_MAX="3") == 3


def test_an_evaluation_under_the_rollouts_cache_needs_a_compressing_policy():
    c = load_config_file(os.path.join(REPO, TINY))
    c.eval.kv_cache = "sparse"
    with pytest.raises(ConfigError, match=r"config.eval.kv_cache='sparse' is not one of"):
        validate(c)
    c.eval.kv_cache = "rollout"
    with pytest.raises(ConfigError, match=r"eval.kv_cache='rollout' .* rollout.kv_policy='dense'"):
        validate(c)
    c.rollout.kv_policy = "rkv"
    assert RunSettings.from_config(validate(c)).eval.kv_cache == "rollout"


def test_every_shipped_config_builds_and_validates():
    """Each configs/*.py builds (every field it sets exists: a renamed field fails here, as
    `eval.greedy` once did in the LoRA config) and validates, but for a model directory that is
    not on this machine."""
    # Bazel's runfiles add an empty configs/__init__.py: a package marker, not a config.
    names = sorted(
        f
        for f in os.listdir(os.path.join(REPO, "configs"))
        if f.endswith(".py") and not f.startswith("_")
    )
    assert "smollm2_135m_word_lora.py" in names
    for name in names:
        c = load_config_file(os.path.join(REPO, "configs", name))
        try:
            validate(c)
        except ConfigError as e:
            assert "config.model.path=" in str(e) and "does not exist" in str(e), (name, e)


_TRIM = """
import ctypes, sys
from qurl_jax.runtime import malloc
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open('/proc/self/status').read().split('VmRSS:')[1].split()[0]) * 1024
chunks = [libc.malloc(64 * 1024) for _ in range(3200)]  # 200 MiB of heap chunks (not mmapped)
for c in chunks:
    ctypes.memset(c, 1, 64 * 1024)
keep = libc.malloc(64 * 1024)  # above them: the heap's top is in use, so free() cannot trim it
ctypes.memset(keep, 1, 64 * 1024)
for c in chunks:
    libc.free(c)
before = rss()
trimmed = malloc.trim()
print(trimmed, (before - rss()) / 2**20)
"""


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's malloc_trim")
def test_trim_returns_freed_heap_memory_and_each_checkpoint_save_trims(tmp_path,
                                                                       monkeypatch) -> None:
    """`malloc.trim`: freed heap chunks below one still in use stay resident until it runs (a
    checkpoint save left 1.4-2.2 GB so); after it they are gone. `Checkpointer.save` calls it."""
    import platform

    import jax

    from qurl_jax.runtime import checkpoint, malloc

    calls = []
    monkeypatch.setattr(malloc, "trim", lambda: calls.append(1) or True)
    saver = checkpoint.Checkpointer(str(tmp_path / "ck"), interval=1, keep=1)
    assert saver.save(1, {"w": jax.numpy.ones(3)}, {"step": 1})
    saver.close()
    assert calls == [1]
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _TRIM], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    trimmed, freed_mib = out.stdout.split()
    assert trimmed == "True" and float(freed_mib) > 150, out.stdout
