"""Jet-RL's unified FP8 flow in QuRL's GRPO setting: DeepSeek-R1-Distill-Qwen-1.5B on math.

The deepscaler_r1_1p5b_int8.py setting (data, GRPO, k3 KL 1e-3, lr 1e-6, evaluation, mesh and
learner memory knobs) with one precision flow on both sides: the rollout and the learner run every
q/k/v/o/gate/up/down product in block-scaled FP8 E4M3 (DeepSeek-V3 scaling: 128x128 weight blocks,
1x128 activation and gradient groups, 128x1 weight-gradient groups), so the learner's pi_prox is
the policy the rollout sampled (KL(behav || prox) at float32 accumulation-order level) and the
plain PPO / GRPO loss (`on_policy`) needs no importance correction. No invariant scaling: Jet-RL
uses no calibration or rescaling. Master weights and optimizer state stay float32; attention,
norms, the embedding and the LM head are not quantized, on either side (`rollout.quantize_vocab`
off: int8 vocabulary tables in the rollout alone would make it off-policy by their rounding, which
`on_policy` does not correct; the reshard then moves them in bf16, about 1.5 bytes per quantized
parameter instead of 0.9).

`--config.train.precision=fp` is Jet-RL's baseline, BF16 training with the FP8 rollout (the
off-policy setting that degrades on long rollouts); pair it with `--config.rl.loss_mode=acr` for
QuRL's correction of the same mismatch. Point `model.path` at a local copy of the model.
The learner memory figures of the int8 config were not re-measured with FP8 training (the
backward keeps FP8 activation codes instead of the bf16 matmul inputs);
`python -m qurl_jax.bench.memory --config=<this file>` compiles both learner programs.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deepscaler_r1_1p5b_int8  # noqa: E402  (the setting this config changes)


def get_config():
    c = deepscaler_r1_1p5b_int8.get_config()
    c.rollout.precision = "fp8_block"
    c.train.precision = "fp8_block"
    c.rollout.quantize_vocab = False
    c.rollout.invariant_scaling = 1.0
    c.rl.loss_mode = "on_policy"
    return c
