"""One GRPO step's cost on SmolLM2-135M-Instruct at a torch GRPO trainer's usual CPU settings:
32 samples (4 prompts x 8) of at most 64 new tokens, one optimizer step per RL step, one
micro-batch, KL off, an INT8 rollout actor and the ACR objective; no evaluation. A timing and
memory harness (docs/performance.md, "The whole RL step against main"), not a training recipe:
`configs/smollm2_135m_word.py` is the one that learns.

    python -m qurl_jax.main --config=configs/smollm2_135m_step.py --workdir=/tmp/step \
        --config.model.path=$(python -m qurl_jax.models.fetch)

The learner rematerialises its layers in a scan and takes the LM head 16 response positions at a
time (`train.remat=full`, `train.scan_layers`, `train.logprob_chunk=16`): measured, peak resident
memory 7.3 GB (weights from an HF directory) or 8.1-8.7 GB (from the GGUF file) instead of 14.0
with the library's defaults, the step no slower; with the learner's plain weight-gradient
products on CPU (2026-11-28) 23.8 s a step and 7.56 GB from the GGUF file. glibc's malloc arenas
are capped at 2 (`train.malloc_arenas`): measured on a 2-core AMD EPYC (AVX2), A B B A, peak
6.54-6.61 GB against 7.41-7.55 GB uncapped, the step 59.3 s against 57.6 s (pooled medians; its
rollout 14.7 s against 12.7 s; docs/performance.md).
CPU matrix products: the library's default (`train.cpu_dots='auto'`): on a CPU without AVX512
the learner's programs take Eigen's products and the rollout XLA's own; measured on a 2-core AMD
EPYC (AVX2), A B B A, steps 2-6 pooled: 54.0 s a step (update 38.6 s) against 57.0 s (42.1 s)
with XLA's own choice everywhere (`xla`, what an AVX512 CPU runs). `eigen` in every program
measured slower (32.8 s against 28.8-29.1 on a Xeon, 63.0 against 56.0 on an AVX2 EPYC: its
rollout loses; docs/performance.md).
"""

import os

from qurl_jax.config.base import load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_135m_word.py")


def get_config():
    c = load_config_file(_BASE)
    c.data.prompts_per_step = 4
    c.data.max_prompt_len = 64
    c.rollout.n = 8
    c.rollout.max_new_tokens = 64
    c.rl.num_minibatches = 1
    c.rl.num_micro_batches = 1
    c.rl.kl_coef = 0.0
    c.train.remat = "full"
    c.train.scan_layers = True
    c.train.logprob_chunk = 16
    c.train.malloc_arenas = 2
    c.train.num_steps = 6
    c.train.checkpoint_every = 1000
    c.train.report_speed = False
    c.eval.files = ()
    c.eval.before = False
    return c
