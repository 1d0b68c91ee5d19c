"""LoRA GRPO of Qwen2.5-32B-Instruct on ONE H100-80GB (QeRL's setting): a frozen INT8 base shared by
the rollout and the learner, rank-16 adapters on every projection, an 8-bit KV cache.

The base (32.8B parameters) is quantized once, leaf by leaf from host memory, to per-channel int8
codes with the vocabulary tables weight-only int8 (`rollout.quantize_vocab`): 30.5 GiB on the GPU,
read by the rollout (W8A8, the recipe's product) and by the learner (weight-only, bf16
activations) alike. Only the adapters (134M float32 parameters) and their AdamW state train. The
rollout decodes 16 rows at a time (refilled: 16 prompts x 8 samples = 128 rows a step) with int8
keys and values in a paged pool (`rollout.kv_precision`, `rollout.kv_pages`), which JAX's GPU
paged kernel reads as codes (a dense 8-bit cache is dequantized to bf16 every step on GPU). At 32
rows the decode program planned 70.5 GiB, over the 67.2 GiB budget: besides the base and the
cache it holds 29.1 GiB of temporaries, the size of the int8 linear kernels. The learner takes one
packed 2,560-token row per micro-batch, every layer rematerialised, unrolled (`train.scan_layers`
would stack a copy of the base's layers). MATH train split, prompts up to 512 tokens, responses up
to 2,048.

`python -m qurl_jax.bench.memory --config=configs/grpo_qwen2p5_32b_lora_h100.py
--target=gpu:h100-1` compiles every program the run executes for one H100 (docs/lora.md has
the figures).
"""

from qurl_jax.config.base import base_config

MATH = "third_party/math_data/"


def get_config():
    c = base_config()
    c.model.source = "hf"
    c.model.path = "checkpoints/Qwen2.5-32B-Instruct"
    c.model.dtype = "bfloat16"
    c.model.lora.rank = 16
    c.model.lora.alpha = 32.0
    c.model.lora.base_precision = "int8"
    c.data.task = "math"
    c.data.train_files = (MATH + "train_math.json",)
    c.data.prompts_per_step = 16
    c.data.max_prompt_len = 512
    c.rollout.precision = "int8"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 2048
    c.rollout.temperature = 1.0
    c.rollout.max_concurrent_rows = 16
    c.rollout.kv_precision = "int8"
    c.rollout.kv_pages = 16 * (512 + 2048) // 16  # every slot's worst case, in 16-token pages
    c.rollout.kv_page_size = 16
    c.rollout.tensor = "1"
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.agg = "token_mean"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 1
    c.train.tokens_per_micro_batch = 2560
    c.train.remat = "full"
    c.train.scan_layers = False
    c.train.logprob_chunk = 256
    c.optim.learning_rate = 1e-5
    c.optim.weight_decay = 0.0
    c.mesh.data = 1
    c.mesh.fsdp = 1
    c.mesh.tensor = 1
    c.train.num_steps = 200
    c.train.checkpoint_every = 10
    c.eval.files = (MATH + "test_math.json",)
    c.eval.max_examples = 500
    c.eval.max_new_tokens = 2048
    return c
