"""The memory report answers "does it fit": a config mesh smaller than the target is planned as a
run there would use it (not a libtpu traceback), the last line is a verdict with the largest
program's margin or each program over the budget with its knobs, the compiler's own refusal is a
verdict too, and the exit code is non-zero when anything does not fit."""

import importlib.util
import os
import subprocess
import sys

import pytest

from qurl_jax.plan import memory_plan

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = memory_plan.GIB
needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu not installed")


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([sys.executable, "-m", "qurl_jax.bench.memory", *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)


def test_the_verdict_names_the_largest_program_or_each_one_over_with_its_knobs():
    figures = {"budget_bytes_per_device": 10 * GIB,
               "programs": {"requantize": {"peak_bytes": 1 * GIB},
                            "learner_update": {"peak_bytes": 8 * GIB}},
               "fits": {"requantize": True, "learner_update": True}}
    line = memory_plan.verdict(figures, "tpu:v5e-4", lambda n: f"<knobs of {n}>")
    assert line == ("verdict: FITS on tpu:v5e-4: all 2 programs within 10.00 GiB per device; "
                    "the largest, learner_update, peaks at 8.00 GiB (2.00 GiB to spare)")
    figures["programs"]["learner_update"]["peak_bytes"] = 12 * GIB
    figures["fits"].update(learner_update=False, rollout_decode=False)  # refused: no figures
    line = memory_plan.verdict(figures, "tpu:v5e-4", lambda n: f"<knobs of {n}>")
    assert line.startswith("verdict: DOES NOT FIT on tpu:v5e-4 (10.00 GiB per device): ")
    assert "learner_update needs 12.00 GiB (2.00 over): change <knobs of learner_update>" in line
    assert "rollout_decode was refused by the compiler: change <knobs of rollout_decode>" in line


@needs_libtpu
@pytest.mark.slow  # kept out of the default suite's 15-minute budget
def test_a_config_mesh_smaller_than_the_target_is_planned_not_a_traceback():
    """gsm8k's config fixes mesh.fsdp=4; on the 8 chips of tpu:v5e-8 libtpu refused the program
    over half its devices with a 78-line RET_CHECK traceback."""
    out = _bench("--config=configs/gsm8k_qwen2p5_0p5b_int8.py", "--target=tpu:v5e-8",
                 "--programs=requantize")
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "Traceback" not in text
    assert "uses 4 of the 8 devices of tpu:v5e-8" in out.stdout and "as tpu:v5e-4" in out.stdout
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("verdict: FITS on tpu:v5e-4: all 1 programs within 13.60 GiB")
    assert "the largest, requantize, peaks at" in last


@needs_libtpu
@pytest.mark.slow  # a 7B learner update handed to the TPU compiler (about a minute)
def test_the_compilers_refusal_is_a_verdict_and_exit_3():
    out = _bench("--config=configs/dapo_qwen2p5_7b_fp8.py", "--target=tpu:v5e-4",
                 "--config.mesh.fsdp=-1", "--config.mesh.tensor=1", "--config.mesh.data=1",
                 "--programs=learner_update")
    text = out.stdout + out.stderr
    assert out.returncode == 3, text[-3000:]
    assert "Traceback" not in text
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("verdict: DOES NOT FIT on tpu:v5e-4")
    assert "learner_update was refused by the compiler: change" in last
    assert "RESOURCE_EXHAUSTED" in out.stdout
