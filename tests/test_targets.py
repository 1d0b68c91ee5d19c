"""Compile targets (`qurl_jax.parallel.targets`): target strings, and a run's programs compiled by a
TPU's and an H100's own compilers on compile-only devices, so a lowering that only one platform
refuses fails here, on a machine without either. Installs nothing: the TPU case is skipped without
libtpu (`pip install -e .[tpu-compile]`, which setup.sh installs), the GPU matrix without the CUDA
plugin (`.[gpu-compile]`)."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from jax._src import hardware_utils

from qurl_jax.config.base import base_config, validate
from qurl_jax.config.settings import RunSettings
from qurl_jax.models import ModelConfig, hf
from qurl_jax.parallel import targets
from qurl_jax.plan import memory_plan

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = targets.compiler_installed("gpu")
# A Qwen2-shaped model small enough to compile in seconds, with an untied LM head and a head
# size of 64 (TPU and GPU lay heads out in lanes of 128 and 64).
SHAPE = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                    num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                    attention_bias=True, tie_word_embeddings=False)


def test_target_strings_name_their_slice():
    t = targets.parse("tpu:v5p-16")  # v5p slices count TensorCores, two per chip
    assert (t.platform, t.num_devices, t.topology) == ("tpu", 8, "v5p:2x2x2")
    assert targets.parse("tpu:v5p-32").topology == "v5p:2x2x4"
    assert targets.parse("tpu:v5p-256").topology == "v5p:4x4x8"
    assert targets.parse("tpu:v5e-4").topology == "v5e:2x2"
    assert targets.parse("tpu:v6e-32").topology == "v6e:4x8"
    assert targets.parse("gpu:h100-8").topology == "1x1x8"
    assert targets.parse("gpu:h100-16").topology == "1x2x8"
    assert targets.parse("tpu:v5e-4").memory_bytes == 16 << 30
    assert targets.parse("cpu").memory_bytes is None
    for bad in ("tpu:v4-8", "tpu:v5p-12", "tpu:v5p-4", "gpu:h100-12", "gpu:v5e-4", "h100"):
        with pytest.raises(targets.TargetError, match=f"target '{bad}'"):
            targets.parse(bad)


def test_missing_compiler_is_one_line_naming_the_extra():
    if HAS_LIBTPU:
        pytest.skip("libtpu is installed")
    with pytest.raises(targets.TargetError, match=r"pip install -e \.\[tpu-compile\]"):
        targets.parse("tpu:v5e-4").devices()


def _step_config(tmp_path, rollout_precision: str, train_precision: str, kv_policy: str,
                 refill: bool):
    """A run of the tiny shape on a 4-device mesh (2-way data x 2-way FSDP): 4 prompts x 4 samples,
    16-token prompts, 32 new tokens; with `refill` 8 slots refilled from the 16 rows."""
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(SHAPE), f)
    c = base_config()
    c.model.path, c.model.dtype = "checkpoints/tiny", "bfloat16"
    c.data.prompts_per_step, c.rollout.n = 4, 4
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 32
    c.rl.num_minibatches, c.rl.num_micro_batches = 2, 2
    c.mesh.data, c.mesh.fsdp = 2, 2
    c.train.precision, c.rollout.precision = train_precision, rollout_precision
    c.rollout.kv_policy, c.rollout.kv_budget, c.rollout.kv_interval = kv_policy, 16, 8
    c.rollout.max_concurrent_rows = 8 if refill else 0
    c.rl.kl_coef = 1e-3  # the update also reads the reference log-probs
    return c


def _compiles_for(target: str, tmp_path, programs: tuple[str, ...] = tuple(memory_plan.PROGRAMS),
                  **settings) -> dict:
    figures = memory_plan.report(RunSettings.from_config(_step_config(tmp_path, **settings)),
                                 str(tmp_path), target, log=lambda _: None, programs=programs)
    assert set(figures["programs"]) == set(programs)
    for program in figures["programs"].values():
        assert program["peak_bytes"] >= program["temp_bytes"] >= 0 and program["peak_bytes"] > 0
    return figures


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install -e .[tpu-compile])")
def test_full_step_compiles_for_tpu(tmp_path):
    # The learner update in block-scaled FP8, requantize to int8, and the refilling sampler's
    # insert and decode with a compressed KV cache (R-KV), compiled by libtpu for a v5e-4 slice.
    figures = _compiles_for("tpu:v5e-4", tmp_path, rollout_precision="int8",
                            train_precision="fp8_block", kv_policy="rkv", refill=True)
    assert (figures["platform"], figures["device_kind"], figures["devices"]) == (
        "tpu", "TPU v5 lite", 4)


ROLLOUT_PROGRAMS = ("requantize", "rollout_prefill", "rollout_decode")
ROLLOUTS = [dict(rollout_precision=r, kv_policy=k, refill=refill)
            for r in ("fp", "int8", "fp8", "fp8_block")
            for k in ("dense", "streaming", "snapkv", "rkv") for refill in (False, True)]
SLOW_TARGETS = [
    pytest.param("tpu:v5e-4", marks=pytest.mark.skipif(not HAS_LIBTPU, reason="no libtpu")),
    pytest.param("gpu:h100-4", marks=pytest.mark.skipif(not HAS_CUDA_PLUGIN,
                                                        reason="no CUDA plugin"))]


@pytest.mark.slow
@pytest.mark.parametrize("target", SLOW_TARGETS)
@pytest.mark.parametrize("settings", ROLLOUTS, ids=lambda s: "-".join(
    (v if isinstance(v, str) else ("refill" if v else "static")) for v in s.values()))
def test_every_rollout_precision_policy_and_sampler_compiles(target, settings, tmp_path):
    _compiles_for(target, tmp_path, train_precision="fp", programs=ROLLOUT_PROGRAMS, **settings)


@pytest.mark.slow
@pytest.mark.parametrize("target", SLOW_TARGETS)
@pytest.mark.parametrize("train_precision", ["fp", "fp8_block"])
def test_every_training_precision_compiles(target, train_precision, tmp_path):
    _compiles_for(target, tmp_path, train_precision=train_precision, rollout_precision="fp",
                  kv_policy="dense", refill=False, programs=("learner_update", "learner_logprobs"))


@pytest.mark.skipif(bool(hardware_utils.num_available_tpu_chips_and_device_id()[0])
                    or hardware_utils.has_visible_nvidia_gpu(), reason="an accelerator is attached")
def test_cli_start_up_stays_on_cpu_without_an_accelerator():
    # With libtpu installed and no TPU attached, an entry point must not start the TPU backend
    # (libtpu's warnings, its start-up time): JAX_PLATFORMS unset, the CLI runs on the CPU.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = ("from qurl_jax.parallel import targets; targets.use_cpu_unless_accelerator_attached(); "
            "import jax; print(jax.devices()[0].platform)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "cpu"
    assert "libtpu" not in out.stderr and "TPU" not in out.stderr, out.stderr


def test_bad_target_is_one_line_naming_it():
    out = subprocess.run([sys.executable, "-m", "qurl_jax.bench.memory",
                          "--config=configs/arith_tiny.py", "--target=tpu:v4-8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1].startswith("qurl_jax: bad flag --target: target "
                                                          "'tpu:v4-8'"), out.stderr
    from test_trainer import tiny_config

    c = tiny_config()
    c.train.preflight_target = "gpu:a100-8"
    with pytest.raises(ValueError, match=r"^config\.train\.preflight_target: target 'gpu:a100-8'"):
        validate(c)


@pytest.mark.skipif(not HAS_LIBTPU, reason="libtpu not installed (pip install -e .[tpu-compile])")
def test_preflight_compiles_for_its_target(tmp_path):
    # A CPU run's preflight with train.preflight_target checks the programs the TPU compiler
    # plans for that slice, and stops before anything is written.
    from test_trainer import tiny_config

    from qurl_jax.train.trainer import Trainer

    c = tiny_config()
    c.train.preflight_target, c.train.memory_limit_gib = "tpu:v5e-4", 1e-6
    with pytest.raises(memory_plan.MemoryPlanError, match=r"learner_update needs .*"
                       r"rl\.num_micro_batches"):
        Trainer(c, str(tmp_path / "run"))
    assert not [p for p in (tmp_path / "run").glob("**/*") if p.is_file()]
