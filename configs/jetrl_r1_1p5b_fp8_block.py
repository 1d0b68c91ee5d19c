"""Jet-RL's unified FP8 flow in QuRL's GRPO setting: DeepSeek-R1-Distill-Qwen-1.5B on math.

The deepscaler_r1_1p5b_int8.py setting (data, GRPO, k3 KL 1e-3, lr 1e-6, evaluation, mesh and
learner memory knobs) with one precision flow on both sides: the rollout and the learner run every
q/k/v/o/gate/up/down product in block-scaled FP8 E4M3 (DeepSeek-V3 scaling: 128x128 weight blocks,
1x128 activation and gradient groups, 128x1 weight-gradient groups), so the learner's pi_prox is
the policy the rollout sampled (KL(behav || prox) at float32 accumulation-order level) and the
plain PPO / GRPO loss (`on_policy`) needs no importance correction. No invariant scaling: Jet-RL
uses no calibration or rescaling. Master weights and optimizer state stay float32; attention,
norms and the LM head are not quantized.

`--config.train.precision=fp` is Jet-RL's baseline, BF16 training with the FP8 rollout (the
off-policy setting that degrades on long rollouts); pair it with `--config.rl.loss_mode=acr` for
QuRL's correction of the same mismatch. Point `model.path` at a local copy of the model.
The learner memory figures of the int8 config were not re-measured with FP8 training (the
backward keeps FP8 activation codes instead of the bf16 matmul inputs);
`python -m qurl_jax.bench.memory --config=<this file>` compiles both learner programs.
"""

from qurl_jax.config import base_config

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
    c.rollout.precision = "fp8_block"
    c.train.precision = "fp8_block"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 8192
    c.rollout.temperature = 0.6
    c.rollout.invariant_scaling = 1.0
    c.rl.loss_mode = "on_policy"
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.agg = "seq_mean_token_mean"
    c.rl.kl_coef = 1e-3
    c.rl.kl_estimator = "k3"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 4
    c.rl.num_micro_batches = 32  # 8 sequences: one per device
    c.train.remat = "dots"
    c.train.scan_layers = True
    c.optim.learning_rate = 1e-6
    c.optim.weight_decay = 0.01
    c.optim.grad_clip = 1.0
    c.mesh.data = 1
    c.mesh.fsdp = 8
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
