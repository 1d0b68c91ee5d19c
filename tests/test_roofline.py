"""bench.roofline: the counted decode-step flops, the table, and a compile for an H100 (skipped
without the CUDA plugin)."""

from __future__ import annotations

import pytest

from qurl_jax import targets
from qurl_jax.bench import roofline
from qurl_jax.models.config import ModelConfig

TINY = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=128, intermediate_size=256,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, dtype="bfloat16")


def test_step_flops_counts_every_matrix_parameter_and_the_cache() -> None:
    # per layer: q 128x128, k and v 128x64, o 128x128, MLP 3 x 128x256; LM head 128x512
    params = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 3 * 128 * 256) + 128 * 512
    attention = 4 * 2 * 4 * 32 * 100
    assert roofline.step_flops(TINY, 3, 100) == 3 * (2 * params + attention)


def test_table_gives_the_ratio_to_bf16_and_the_measurement() -> None:
    rows = [dict(target="gpu:h100-1", model="m", batch=64, actor=a, argument_bytes=2**30 * b,
                 bound="memory", predicted_step_ms=1.0, predicted_tokens_per_s=t,
                 measured_tokens_per_s=meas)
            for a, b, t, meas in (("bf16", 6.0, 1000.0, 900.0), ("int8", 4.8, 1250.0, None))]
    table = roofline.markdown_table(rows).splitlines()
    assert "| 1.00x | 900 |" in table[2]
    assert "| 1.25x |  |" in table[3]


@pytest.mark.slow
def test_h100_decode_compile_predicts_a_memory_bound_step() -> None:
    target = targets.parse("gpu:h100-1")
    try:
        target.devices()
    except targets.TargetError as e:
        pytest.skip(str(e))
    bf16 = roofline.predict(target, "tiny", 8, "bf16", config=TINY)
    int8 = roofline.predict(target, "tiny", 8, "int8", config=TINY)
    assert bf16["bound"] == "memory" and bf16["argument_bytes"] >= bf16["weight_bytes"]
    assert int8["weight_bytes"] < bf16["weight_bytes"]
    assert bf16["predicted_tokens_per_s"] == pytest.approx(
        8 / (bf16["argument_bytes"] / roofline.CHIPS["h100"]["bandwidth"]))
