"""QuRL's DAPO setting (`configs/dapo_qwen2p5_7b_fp8.py`) with LoRA on a frozen 8-bit base, sized
toward one TPU v5e-8 (8 chips of 16 GiB) instead of two 8 x H100 nodes. Its learner does NOT fit
a v5e chip (below): a plan to start from, not a working v5e recipe.

The base is quantized once to per-channel int8 codes (v5e multiplies int8 natively and FP8 not at
all, so the FP8 config's codes become int8 here, the same bytes; `model.lora.base_precision=fp8`
with `rollout.precision=fp8` is the FP8 variant), vocabulary tables weight-only int8, placed once
on the rollout's replicas (`rollout.tensor=4`: two replicas of four chips); the rollout reads it
W8A8 and the learner weight-only, so no float32 master, no requantization, and a reshard of the
adapters alone. Rank-32 adapters on every projection (80.7M float32 parameters), LoRA's usual 10x
the full fine-tune's learning rate. The same DAPO recipe (clip-higher, token-mean, dynamic
sampling, overlong shaping, no KL, C = 5, responses up to 20,480 tokens) except QuRL's invariant
scaling, which a frozen base cannot use. The rollout decodes 16 rows per replica with int8 keys
and values. The learner runs on the same four-chip groups (`mesh.tensor=4` over `mesh.fsdp=2`),
so each chip's products read its own quarter of the base where the rollout placed it, one packed
22,528-token row per group and micro-batch, layers rematerialised and unrolled.

`python -m qurl_jax.bench.memory --config=configs/dapo_qwen2p5_7b_fp8_lora.py --target=tpu:v5e-8`:
the rollout, evaluation and log-prob programs fit (<= 7.92 GiB per chip); libtpu refuses the
learner's update (25.4 GiB of temporaries; docs/lora.md). With `--config.mesh.fsdp=1
--target=tpu:v5p-8` every program fits, the largest the update at 47.68 of 80.75 GiB per chip:
the smallest slice this step plans on is one v5p-8.
"""

import os

from qurl_jax.config.base import load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dapo_qwen2p5_7b_fp8.py")


def get_config():
    c = load_config_file(_BASE)
    c.model.lora.rank = 32
    c.model.lora.alpha = 64.0
    c.model.lora.base_precision = "int8"
    c.rollout.precision = "int8"
    c.rollout.invariant_scaling = 1.0
    c.rollout.tensor = "4"
    c.rollout.max_concurrent_rows = 32
    c.rollout.kv_precision = "int8"
    c.optim.learning_rate = 1e-5
    c.rl.num_micro_batches = 64
    c.train.tokens_per_micro_batch = 2 * 22528
    c.train.scan_layers = False
    c.mesh.data = 1
    c.mesh.fsdp = 2
    c.mesh.tensor = 4
    return c
