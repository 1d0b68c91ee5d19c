"""The embedded default, a format-repair demo: RL on synthetic arithmetic with a tiny Qwen2-family
model, on a CPU.

Nothing is downloaded. A character-level tokenizer and a tiny Qwen2 model are built in code and
saved in Hugging Face format under the workdir; a short supervised warm start on "a+b=" / "a-b="
problems (cached in `<workdir>/sft_model`) imitates a sloppy teacher that appends a stray character
to half of its (correct) answers ("19." instead of "19"), which the exact-match verifier scores as
wrong; then GRPO with an INT8 rollout actor and the ACR objective has to discover, from verifier
rewards alone, that the clean answer is the rewarded one, and raises the sampled accuracy (Avg@4
at temperature 1). Ends with a summary table: eval accuracy before and after RL, rollout share of
step time, INT8 vs FP32 rollout speed and the behaviour/proximal mismatch metrics. The demo shows
the machinery learning a format from verifier rewards; it does not teach arithmetic.
`--config.train.apply_updates=False` is its control run (updates computed and discarded).
"""

from qurl_jax.config.base import base_config


def get_config():
    c = base_config()
    c.seed = 0
    c.model.source = "tiny"
    c.model.dtype = "float32"
    c.model.tiny.model_type = "qwen2"
    c.model.tiny.hidden_size = 128
    c.model.tiny.intermediate_size = 384
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 4
    c.model.tiny.num_kv_heads = 2
    c.model.tiny.head_dim = 32
    c.model.tiny.tie_word_embeddings = True
    c.data.task = "arithmetic"
    c.data.arith_digits = 2
    c.data.arith_ops = "+-"
    c.data.prompts_per_step = 16
    c.data.max_prompt_len = 32
    c.data.chat_template = True
    c.rollout.precision = "int8"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 8
    c.rollout.temperature = 1.0
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2
    c.rl.agg = "seq_mean_token_mean"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 2
    c.optim.learning_rate = 1e-4
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.sft.steps = 4000
    c.sft.format_noise = 0.5
    c.sft.learning_rate = 3e-3
    c.sft.batch_size = 64
    c.train.num_steps = 150
    # Packed learner rows in 2 sizes per doubling, not 8: a compile of this model's update
    # (~3 s) costs more than all the padding it would save.
    c.train.pack_buckets = 2
    c.train.checkpoint_every = 50
    c.train.keep_checkpoints = 2
    c.train.report_speed = True
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.max_new_tokens = 8
    return c
