"""SmolLM2-135M-Instruct learns one-step word problems by RL with LoRA on a frozen INT8 base, on a
CPU: `configs/smollm2_135m_word.py` with rank-16 adapters on every projection instead of every
parameter.

The base is quantized once to the INT8 rollout recipe's codes (`model.lora.base_precision`); the
rollout samples it W8A8 plus the adapters, the learner differentiates the same codes (read
weight-only, float activations) plus the adapters, so ACR still corrects the activations'
quantization. Only the adapters (float32, 4.9M parameters) and their AdamW state train, move to
the rollout and are checkpointed. The learning rate is LoRA's usual 10x the full fine-tune's
(alpha / rank = 2); 30 steps instead of 40 keep the run within 40 minutes on a
loaded 2-core CPU. The evaluation samples the adapters on the base read weight-only, greedy only
(the goal's figure; Avg@4 doubles its time: `--config.eval.greedy_only=False`).

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
    c.optim.learning_rate = 2e-4
    c.train.num_steps = 30
    c.eval.greedy_only = True
    # The base config's later additions (warm-up, overlong punishment, remat in a scan, malloc
    # cap and trim) are left out: the figures in docs/lora.md were measured without them.
    c.optim.warmup_steps = 0
    c.rl.overlong_buffer = 0
    c.train.remat = "none"
    c.train.scan_layers = False
    c.train.malloc_arenas = 0
    c.train.malloc_trim_steps = False
    return c
