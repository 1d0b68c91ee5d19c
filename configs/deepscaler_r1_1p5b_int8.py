"""QuRL's GRPO setting: DeepSeek-R1-Distill-Qwen-1.5B on DeepScaleR-style math, INT8 rollout + ACR.

Point `model.path` at a local copy of the model (`--config.model.path=/ckpt/R1-Distill-Qwen-1.5B`).
The MATH train split and AIME 1983-2023 in third_party/math_data stand in for the DeepScaleR set (a
DeepScaleR JSON/parquet file with problem/answer fields works the same: override data.train_files).
Evaluation: Avg@k on AIME24, AMC, MATH-500, Minerva and OlympiadBench (the QuRL table).

Learner memory targets one node of 8 x H100-80GB (mesh fsdp=8): each optimizer step's 256 sequences
of 1024 + 8192 tokens are packed into micro-batches of one 9216-token row per device (at most 32,
one sequence a row; about 11 at the configs' lengths: `train.tokens_per_micro_batch`), layers
rematerialised with the 'dots' policy, blockwise attention ('auto' at this length), log-probs in
chunks of 512 positions. `python -m qurl_jax.bench.memory --config=<this file>` compiles both
learner programs on 8 host devices: update 34.2 GiB, log-prob recomputation 3.2 GiB peak per
device (XLA:CPU's buffer assignment, which keeps the saved bf16 matmul outputs in f32; with
`train.remat='full'` the update takes 11.5 GiB). Those are the padded programs; the packed ones
(their worst case) on tpu:v5p-16: docs/targets.md.
"""

from qurl_jax.config.base import base_config

MATH = "third_party/math_data/"


def get_config():
    c = base_config()
    c.model.source = "hf"
    c.model.path = "checkpoints/DeepSeek-R1-Distill-Qwen-1.5B"
    c.model.dtype = "bfloat16"
    c.data.task = "math"
    c.data.train_files = (MATH + "train_math.json", MATH + "train_aime.json")
    c.data.prompts_per_step = 128
    c.data.max_prompt_len = 1024
    c.rollout.precision = "int8"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 8192
    # The whole rollout (1024 rows, 128 on each of the 8 one-chip replicas) decodes at once from
    # a paged KV pool with a page for every token a row may hold (1024 x 576 pages of 16 tokens:
    # 31.5 GiB per device, so it never preempts), read by JAX's paged kernels, which read each
    # row's live pages only. Fixed slots on TPU are read whole by XLA every step: 512 of them
    # read 3.65x the HBM bytes of this pool over a rollout (1.11x on H100, whose dense kernel
    # reads live slots too; `python -m qurl_jax.bench.paged reads`). Planned by the targets'
    # compilers: docs/targets.md.
    c.rollout.max_concurrent_rows = 1024
    c.rollout.kv_pages = 1024 * 576
    c.rollout.kv_page_size = 16
    c.rollout.temperature = 0.6
    c.rollout.invariant_scaling = 1.5
    c.rollout.invariant_scaling_targets = ("qkv",)
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.agg = "seq_mean_token_mean"
    c.rl.kl_coef = 1e-3
    c.rl.kl_estimator = "k3"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 4
    c.rl.num_micro_batches = 32  # 8 sequences: one per device
    # Packed learner rows (train.packing, on by default): micro-batches and log-prob slices of
    # one 9216-token row per device (the budget is per process, rounded up to its devices), as
    # many as the step's sequences fill: per-slice packing of one sequence per device saves
    # nothing. `python -m qurl_jax.bench.learner --flops --config=<this file>`: see
    # docs/performance.md.
    c.train.tokens_per_micro_batch = 9216
    c.train.remat = "dots"
    c.train.scan_layers = True
    c.optim.learning_rate = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.mesh.data = 1
    c.mesh.fsdp = -1  # every device: 8 on one H100 node or a v5p-16 slice (sized for 8)
    c.mesh.tensor = 1
    c.train.num_steps = 1200
    c.train.checkpoint_every = 20
    c.train.eval_every = 100
    c.eval.files = tuple(MATH + f for f in ("test_aime.json", "test_amc.json", "test_math.json",
                                            "test_minerva.json", "test_olympiad_bench.json"))
    c.eval.k = 32
    c.eval.temperature = 0.6
    c.eval.max_new_tokens = 8192
    return c
