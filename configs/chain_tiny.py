"""The reasoning-chain task: RL teaches a skill the warm start gets wrong, on a CPU.

    python -m qurl_jax.main --config=configs/chain_tiny.py --workdir=/tmp/chain_tiny

Nothing is downloaded. A tiny Qwen2-family model (64 wide, 2 layers) with the character tokenizer
is warm-started (1000 steps of 32, cached in `<workdir>/sft_model`) on the chains of a buggy
teacher: for "47+3*6=" it writes "6:47+3=50;5:50+3=53;...;1:62+3=65;answer:65", but with
probability `sft.bug_rate` = 0.8 forgets the carry of an addition whose units digits sum to exactly
ten ("47+3=40") and goes on from the wrong total (`qurl_jax.data.chains`). The warm-started model
inherits the slip: greedy decoding writes the teacher's wrong chain on nearly every problem of the
sub-case, sampling at temperature 1 finds the carry now and then. GRPO with full-precision
rollouts, rewarded only on the final answer, then has to teach the carry. Replies are 50-107
tokens, so a 64-token KV budget evicts part of every reply's history.

Evaluation before and after RL, on 256 held-out problems ("chain") and on those of them with a
carry-10 step ("chain_carry10", the sub-case): Avg@4 / Pass@4 at temperature 1 and greedy accuracy.
Measured results: docs/study.md, "The chain task" (the goal: greedy and Avg@4 each up >= 10 points).

This is the full-precision reference run of the rollout-precision study; the study runs it
unchanged under other rollout precisions, loss modes and a compressed KV cache. The learning rate
is the one that fixes the sub-case without wrecking the rest (2e-4 fixed the carry as well but cost
30 points of greedy accuracy off the sub-case).
"""

from qurl_jax.config.base import base_config


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
    c.data.task = "chain"  # chain_min_steps / chain_max_steps / chain_carry10_share: defaults
    c.data.prompts_per_step = 16
    c.data.max_prompt_len = 16  # "<bos><user>199+9*8=<assistant>" is 11 tokens
    c.data.chat_template = True
    c.rollout.precision = "fp"
    c.rollout.n = 8
    c.rollout.max_new_tokens = 120  # the longest correct reply is 107 tokens with EOS
    c.rollout.temperature = 1.0
    c.rl.loss_mode = "acr"  # with fp rollouts its weights are 1 up to rounding: plain GRPO
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
    c.sft.steps = 1000
    c.sft.bug_rate = 0.8
    c.sft.learning_rate = 3e-3
    c.sft.batch_size = 32
    c.train.num_steps = 60
    c.train.checkpoint_every = 30
    c.train.keep_checkpoints = 2
    c.eval.k = 4
    c.eval.temperature = 1.0
    c.eval.max_new_tokens = 120
    return c
