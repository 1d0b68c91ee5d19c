"""native_pick: the preflight names the native product where rollout.precision has none."""

import json

import pytest

from qurl_jax.config.base import base_config
from qurl_jax.config.settings import RunSettings
from qurl_jax.models import ModelConfig, hf
from qurl_jax.plan import memory_plan, native_pick
from tests.compile_only import compiler_or_skip

CFG = ModelConfig(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True)


@pytest.mark.parametrize("kind, chip", [
    ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v6 lite", "v6e"), ("TPU v5", "v5p"),
    ("TPU v5p", "v5p"), ("NVIDIA H100 80GB HBM3", "h100"), ("cpu", None), ("TPU v4", None)])
def test_chip_of_device_kind(kind: str, chip: str | None) -> None:
    assert native_pick.chip_of(kind) == chip


def test_fp8_on_a_tpu_names_int8_in_one_line() -> None:
    for chip in ("v5e", "v6e", "v5p"):
        for precision in ("fp8", "fp8_block"):
            note = native_pick.rollout_note(precision, chip)
            assert note is not None and "\n" not in note
            assert f"rollout.precision={precision!r} has no native product" in note
            assert "--config.rollout.precision=int8" in note
        for native in ("int8", "fp", "int8_weight_only"):
            assert native_pick.rollout_note(native, chip) is None
    for precision in ("fp8", "fp8_block", "int8"):
        assert native_pick.rollout_note(precision, "h100") is None
    assert native_pick.rollout_note("fp8", None) is None


def test_preflight_and_report_say_it_on_the_target(tmp_path, monkeypatch) -> None:
    target = compiler_or_skip("tpu:v5e-4")
    with open(tmp_path / "tiny.json", "w") as f:
        json.dump(hf.config_to_hf(CFG), f)
    c = base_config()
    c.model.path = "checkpoints/tiny"
    c.data.prompts_per_step, c.rollout.n = 4, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 16, 16
    c.mesh.fsdp = 4
    c.rollout.precision = "fp8"
    settings = RunSettings.from_config(c)
    lines: list[str] = []
    memory_plan.report(settings, str(tmp_path), target, log=lines.append,
                       programs=("requantize",))
    assert sum("has no native product on TPU v5e" in line for line in lines) == 1
    # the preflight, its programs cut to the cheap one
    monkeypatch.setattr(memory_plan, "PROGRAMS", {"requantize": memory_plan.requantize})
    setup = memory_plan.build_setup(settings, CFG, target.devices())
    lines.clear()
    memory_plan.preflight(setup, 1 << 40, log=lines.append)
    assert [line for line in lines if "native" in line] == [
        "preflight: " + native_pick.rollout_note("fp8", "v5e")]
