"""SmolLM2-135M-Instruct learns one-step word problems by RL with LoRA on a frozen INT8 base, on a
CPU: `configs/smollm2_135m_word.py` with rank-16 adapters on every projection instead of every
parameter.

The base is quantized once to the INT8 rollout recipe's codes (`model.lora.base_precision`); the
rollout samples it W8A8 plus the adapters, and the learner runs the rollout's own W8A8 product of
the same codes (`model.lora.learner_products='w8a8'`: int8 forward and input gradient, no weight
gradient of the base), keeping each projection's output for the backward (`train.remat=
'projections'`). The rollout's and the learner's programs still round differently, so ACR
corrects as in the full run. Only the adapters (float32, 4.9M parameters) and their AdamW state
train, move to the rollout and are checkpointed. The learning rate is LoRA's usual 10x the full
fine-tune's (alpha / rank = 2). The evaluation samples the learner's policy, greedy only (the
goal's figure; Avg@4 doubles its time: `--config.eval.greedy_only=False`).

Measured 2026-11-30 on a 2-core Intel Xeon with AMX-INT8 (docs/lora.md): held-out greedy 15.2% ->
58.2% in 30 steps, 19:32 wall from a fresh clone, 4.76 GB peak; each step 1.88x faster than the
full fine-tune's (`python -m qurl_jax.bench.lora_step`; 1.42x on an AMD EPYC without AMX).

    python -m qurl_jax.main --config=configs/smollm2_135m_word_lora.py --workdir=/tmp/word_lora \
        --export_hf=/tmp/word_lora/hf   # + the PEFT adapter in /tmp/word_lora/hf/lora_adapter
"""

import os

from qurl_jax.config.base import load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_135m_word.py")


def get_config():
    c = load_config_file(_BASE)
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.model.lora.base_precision = "int8"
    c.model.lora.learner_products = "w8a8"
    c.train.remat = "projections"
    c.optim.learning_rate = 2e-4
    c.train.num_steps = 30
    c.eval.greedy_only = True
    return c
