"""Draft."""

from qurl_jax.config import base_config


def get_config():
    c = base_config()
    c.seed = 0
    c.model.source = "tiny"
    c.model.dtype = "float32"
    c.model.tiny.model_type = "qwen2"
    c.model.tiny.hidden_size = 64
    c.model.tiny.intermediate_size = 192
    c.model.tiny.num_layers = 2
    c.model.tiny.num_heads = 4
    c.model.tiny.num_kv_heads = 2
    c.model.tiny.head_dim = 16
    c.model.tiny.tie_word_embeddings = True
    c.data.task = "chain"
    c.data.prompts_per_step = 16
    c.data.max_prompt_len = 16
    c.data.chat_template = True
    c.rollout.precision = "fp"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 120
    c.rollout.temperature = 1.0
    c.rl.loss_mode = "acr"
    c.rl.cap = 2.0
    c.rl.agg = "seq_mean_token_mean"
    c.rl.advantage = "grpo"
    c.rl.num_minibatches = 2
    c.optim.learning_rate = 2e-4
    c.optim.warmup_steps = 5
    c.optim.weight_decay = 0.0
    c.optim.grad_clip = 1.0
    c.sft.steps = 1000
    c.sft.bug_rate = 0.8
    c.sft.learning_rate = 3e-3
    c.sft.batch_size = 32
    c.train.num_steps = 60
    c.train.checkpoint_every = 50
    c.train.keep_checkpoints = 2
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.max_new_tokens = 120
    return c
