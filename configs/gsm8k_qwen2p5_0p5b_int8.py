"""QuRL's small setting: Qwen2.5-0.5B-Instruct on GSM8K, INT8 rollout, TIS cap C = 2, no UAQ.

The paper runs PPO here; this config runs the GRPO equivalent (group advantages instead of a critic)
with lr 1e-5, where updates are large enough that invariant scaling is disabled (s = 1). Point
`model.path` at the local model and `data.train_files` / `eval.files` at GSM8K (verl parquet layout
or JSON with problem/answer); evaluation is greedy accuracy.

Learner memory targets 4 x H100-80GB (mesh fsdp=4): 8 micro-batches of 32 sequences (8 per device)
of 512 + 1024 tokens, decoder layers rematerialised with the 'dots' policy, blockwise attention
('auto' above 1024 keys), log-probs in chunks of 512 positions.
`python -m qurl_jax.bench.memory --config=configs/gsm8k_qwen2p5_0p5b_int8.py` on 4 host devices:
update 24.2 GiB, log-prob recomputation 3.7 GiB peak per device (XLA:CPU).
"""

from qurl_jax.config.base import base_config


def get_config():
    c = base_config()
    c.model.source = "hf"
    c.model.path = "checkpoints/Qwen2.5-0.5B-Instruct"
    c.model.dtype = "bfloat16"
    c.data.task = "math"
    c.data.train_files = ("data/gsm8k/train.parquet",)
    c.data.prompts_per_step = 256
    c.data.max_prompt_len = 512
    c.rollout.precision = "int8"
    c.rollout.n = 4
    c.rollout.max_new_tokens = 1024
    c.rollout.temperature = 1.0
    c.rollout.invariant_scaling = 1.0
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.agg = "seq_mean_token_mean"
    c.rl.kl_coef = 1e-3
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 4
    c.rl.num_micro_batches = 8
    c.train.remat = "dots"
    c.train.scan_layers = True
    c.optim.learning_rate = 1e-5
    c.optim.grad_clip = 1.0
    c.mesh.fsdp = 4
    c.train.num_steps = 300
    c.train.checkpoint_every = 20
    c.train.eval_every = 20
    c.eval.files = ("data/gsm8k/test.parquet",)
    c.eval.greedy_only = True
    c.eval.max_new_tokens = 1024
    return c
