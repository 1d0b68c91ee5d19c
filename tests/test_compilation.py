"""The persistent compilation cache of `python -m qurl_jax.main` and the run's compile figures."""

import os

import jax
import jax.numpy as jnp
from test_trainer import _main

from qurl_jax.runtime import compilation
from qurl_jax.runtime.metrics import read_metrics


def test_cache_dir_setting(tmp_path) -> None:
    workdir = str(tmp_path / "run")
    assert compilation.cache_dir("auto", workdir) == os.path.join(workdir, "compile_cache")
    assert compilation.cache_dir("", workdir) is None
    assert compilation.cache_dir("rel/cache", workdir) == os.path.abspath("rel/cache")
    assert compilation.cache_dir("gs://bucket/cache", workdir) == "gs://bucket/cache"
    assert compilation.cache_dir("auto", "gs://bucket/run") == "gs://bucket/run/compile_cache"


def test_compile_stats_count_this_process_compilations() -> None:
    before = compilation.compile_stats()
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.0)(jnp.arange(7.0)).block_until_ready()
    spent = compilation.compile_stats().since(before)
    assert spent.programs >= 1 and spent.seconds > 0
    assert spent.metrics() == {"compile/programs": spent.programs,
                               "compile/seconds": spent.seconds,
                               "compile/cache_hits": spent.cache_hits,
                               "compile/saved_s": spent.saved_s}


def _run(workdir: str, *overrides: str) -> str:
    proc = _main(workdir, "--config.eval.before=False", "--config.train.report_speed=False",
                 *overrides, env={"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"})
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def _compile_line(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("compile:")]
    assert len(lines) == 1, out[-3000:]
    return lines[0]


def test_restarted_run_loads_its_programs_from_the_cache(tmp_path) -> None:
    """The default cache is <workdir>/compile_cache: a run fills it, and the same command
    restarted from the run's checkpoint loads its programs instead of compiling them (JAX's
    store threshold is lowered to 0 s, so the tiny model's programs are stored too)."""
    workdir = str(tmp_path / "run")
    first = _run(workdir, "--config.train.num_steps=1")
    cache = os.path.join(workdir, "compile_cache")
    assert len(os.listdir(cache)) >= 5  # sampler, learner, requantize, ... programs
    assert "persistent cache: 0 loaded" in _compile_line(first)
    rows = [r for r in read_metrics(workdir) if "rollout/reward_mean" in r]
    assert rows[0]["compile/programs"] > 0 and rows[0]["compile/cache_hits"] == 0

    second = _run(workdir, "--config.train.num_steps=2")  # resumes at step 1
    assert "persistent cache: 0 loaded" not in _compile_line(second), _compile_line(second)
    step2 = [r for r in read_metrics(workdir) if r.get("step") == 2 and "compile/programs" in r]
    assert step2[0]["compile/cache_hits"] > 0, step2


def test_no_cache_setting_leaves_jax_alone(tmp_path) -> None:
    """train.compilation_cache_dir = '' turns nothing on (JAX's own setting stays as it is)."""
    before = jax.config.jax_compilation_cache_dir
    compilation.enable_persistent_cache(compilation.cache_dir("", str(tmp_path)))
    assert jax.config.jax_compilation_cache_dir == before
