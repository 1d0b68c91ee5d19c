"""Test configuration: the platform and devices the tests see, and their compute dtype.

Default suite: 8 host CPU devices for the sharding tests, float32 compute, XLA flags that
make its tiny programs compile faster (`tests.cli.SUITE_XLA_FLAGS`). Accelerator mode
(QURL_TEST_ACCELERATOR=1, set by `python -m tests.accelerator`): the platform and devices JAX
finds are left as they are, and the tests that take the `precision` fixture compute in
QURL_TEST_COMPUTE_DTYPE (bfloat16 by default) with the tolerances of tests/tolerances.py.
Both: float32 matmuls at full precision, so a float32 comparison never runs TF32 or bf16 passes.
"""

import os

ACCELERATOR = os.environ.get("QURL_TEST_ACCELERATOR") == "1"

# Must happen before JAX is imported anywhere in the test session.
if not ACCELERATOR:
    from tests.cli import SUITE_XLA_FLAGS

    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count=8 {SUITE_XLA_FLAGS}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

from tests.tolerances import Precision  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from qurl_jax.models.config import ModelConfig  # noqa: E402

# The tiny models the sampler and trainer tests run: two layers, 4 heads over 2 kv heads of 16,
# a 256-token vocabulary. 'qwen2' has biases on q/k/v and a tied LM head; 'llama' has neither.
TINY_MODELS = {
    "qwen2": dict(model_type="qwen2", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, attention_bias=True,
                  tie_word_embeddings=True, rope_theta=1e6),
    "llama": dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16),
}


def tiny_model(name: str = "qwen2", **overrides: object) -> ModelConfig:
    """A tiny model configuration (`TINY_MODELS[name]`, fields replaced by `overrides`); for
    module-level constants. Test functions take the `tiny_model_config` fixture instead."""
    return ModelConfig(**{**TINY_MODELS[name], **overrides})


@pytest.fixture(scope="session")
def tiny_model_config():
    """`tiny_model`: (name='qwen2', **overrides) -> ModelConfig."""
    return tiny_model

@pytest.fixture(scope="session")
def precision() -> Precision:
    """The compute dtype and tolerances of this run: float32 unless the accelerator runner asks."""
    dtype = os.environ.get("QURL_TEST_COMPUTE_DTYPE", "bfloat16") if ACCELERATOR else "float32"
    return Precision(dtype)
