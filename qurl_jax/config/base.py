"""The run configuration: one documented `base_config()` and a validator that runs before compiling.

Every config file in `configs/` starts from `base_config()` and overrides fields, so each default
lives in exactly one place. The returned `ConfigDict` is locked and type-safe: an override of an
unknown field (`--config.rl.los_mode=...`) or of the wrong type (`--config.rollout.n=abc`) is
rejected by `ml_collections` while the flags are parsed; `validate` then checks the values (enums,
ranges, file paths) and raises `ConfigError` (a `ValueError`) naming the field, still before any
JAX compilation.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from typing import Any

import ml_collections

from qurl_jax.config.settings import (
    RunSettings,
    chain_config,
    kv_policy_from_config,
    objective_from_config,
)
from qurl_jax.data.chains import ChainConfig
from qurl_jax.data.datasets import PROMPT_SUFFIX
from qurl_jax.lora import PROJECTIONS, check_base_recipe
from qurl_jax.models.attention import Implementation as AttentionImplementation
from qurl_jax.models.config import NUMERICS, SUPPORTED_MODEL_TYPES, Remat
from qurl_jax.models.kv_quant import KVPrecision, KVScale
from qurl_jax.quant import RECIPES
from qurl_jax.rl.objectives import Aggregation, KLEstimator, Mode
from qurl_jax.runtime import paths
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.runtime.xla_cpu import CPU_DOTS
from qurl_jax.sampling.factory import DECODE_ATTENTION

# Choices owned by other modules are read from them: a new recipe or loss mode needs no edit here.
PRECISIONS = tuple(RECIPES)
KV_PRECISIONS = tuple(p.value for p in KVPrecision)  # rollout.kv_precision
KV_SCALES = tuple(g.value for g in KVScale)  # rollout.kv_scale
# Training precisions: the recipes the learner can run (`Learner(precision=...)`).
TRAIN_PRECISIONS = ("fp", "fp8_block")
# Other names `validate` accepts for a precision field's value, and what it replaces them with.
PRECISION_ALIASES = {"fp32": "fp"}
LOSS_MODES = tuple(m.value for m in Mode)
AGGREGATIONS = tuple(a.value for a in Aggregation)
KL_ESTIMATORS = tuple(k.value for k in KLEstimator)
ADVANTAGES = ("grpo", "dr_grpo", "rloo")
MODEL_SOURCES = ("hf", "gguf", "tiny")
TASKS = ("math", "arithmetic", "chain")
# Which log-prob of a sampled token the learner gets as pi_behav (see rollout.behav_logp).
BEHAV_LOGPS = ("sampled", "untruncated")
# Continuous batching of the rollout (see rollout.refill and `refill_enabled`).
REFILL = ("auto", "on", "off")
# The evaluation's KV cache (see eval.kv_cache).
EVAL_KV_CACHES = ("dense", "rollout")
# Metric sinks besides metrics.jsonl (see train.loggers).
LOGGERS = ("tensorboard", "wandb")
# What DAPO's dynamic sampling compares within a group (see rl.filter_metric).
FILTER_METRICS = ("accuracy", "reward")


def base_config() -> ml_collections.ConfigDict:
    """Every field with its default and meaning."""
    c = ml_collections.ConfigDict()
    c.seed = 0
    chain = ChainConfig()  # the chain task's problem-shape defaults live there

    c.model = ml_collections.ConfigDict()
    # 'hf': load model.path; 'gguf': load the llama.cpp file model.path (Llama family: weights,
    # tokenizer and chat template); 'tiny': build model.tiny in code (tests/demo)
    c.model.source = "hf"
    c.model.path = ""  # local Hugging Face directory (config.json + *.safetensors + tokenizer)
    c.model.dtype = "float32"  # compute dtype; master weights are always float32
    # Positions a row (prompt + response) may use; 0 = the checkpoint's max_position_embeddings
    # (model.tiny's for the tiny model). RoPE is computed at any position: set it to run past a
    # checkpoint's declared context knowingly, as long-response RL recipes on short-context
    # models do.
    c.model.max_positions = 0
    c.model.attention = "auto"  # auto (blockwise above 1024 keys) | dense | blockwise | cudnn
    # How rollout decode steps read the KV cache (docs/paged_kv.md): auto | xla | pallas. auto:
    # GPU the ragged Pallas kernel (only each row's live slots), TPU XLA, CPU the CPU kernel;
    # xla: dense masked attention over every slot (the reference); pallas: the Pallas kernel
    # (CPU: Pallas' interpreter, for tests). Compressed caches (rollout.kv_policy) keep the mask.
    c.model.decode_attention = "auto"
    # LoRA on a frozen base (docs/lora.md): rank > 0 trains low-rank adapters (a[in, r] random,
    # b[r, out] zero, output scaled by alpha / rank) on the decoder projections whose module path
    # a `targets` regular expression matches ('layers_3/self_attn/q_proj'), instead of every
    # parameter. The base is quantized once, in base_precision ('int8' | 'fp8': the
    # rollout.precision recipe's codes, which must be of that format; 'compute': model.dtype),
    # and the rollout and the learner read the same arrays; only the adapter (float32) and its
    # optimizer state train, are resharded and checkpointed. learner_products: how the learner
    # (and the evaluation) read the base's codes: 'weight_only' (float activations) or 'w8a8'
    # (the 'int8' rollout's own W8A8 product, with an int8 input gradient: pi_theta is the
    # policy the rollout samples).
    c.model.lora = ml_collections.ConfigDict(dict(rank=0, alpha=32.0, targets=PROJECTIONS,
                                                  base_precision="int8",
                                                  learner_products="weight_only"))
    c.model.tiny = ml_collections.ConfigDict(dict(  # used when source == 'tiny'
        model_type="qwen2", hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True,
        max_position_embeddings=256))

    c.data = ml_collections.ConfigDict()
    # 'math' (files + math-verify), 'arithmetic' (synthetic, exact match) or 'chain' (synthetic
    # running sums written step by step, checked on the final answer; qurl_jax.data.chains)
    c.data.task = "math"
    c.data.train_files = ("third_party/math_data/train_math.json",)
    c.data.prompts_per_step = 8  # distinct prompts per RL step (each sampled rollout.n times)
    c.data.max_prompt_len = 512  # prompts longer than this (in tokens) are skipped and counted
    c.data.chat_template = True
    c.data.arith_digits = 2
    c.data.arith_ops = "+-"
    c.data.chain_min_steps = chain.min_steps  # chain: one-digit steps per problem
    c.data.chain_max_steps = chain.max_steps
    c.data.chain_carry10_share = chain.carry10_share  # chain: share drawn with a carry-10 step
    # arithmetic / chain: seed of the train / held-out split; -1 = `seed`. A study that varies the
    # RL seed fixes it, so every seed is evaluated on the same held-out problems.
    c.data.split_seed = -1
    # math: the row fields of your own data files, '' = detect the DeepScaleR / DAPO / GSM8K
    # layout; a dotted path reads a nested field ('reward_model.ground_truth').
    c.data.prompt_key = ""  # math: each row's prompt field ('' = detect the layout)
    c.data.answer_key = ""  # math: each row's answer field ('' = detect the layout)
    # math: text appended to every problem before the chat template ('' = the problem alone)
    c.data.prompt_suffix = PROMPT_SUFFIX

    c.rollout = ml_collections.ConfigDict()
    c.rollout.precision = "int8"  # a quant.RECIPES name (fp = fp32 | int8 | fp8 | fp8_block | ...)
    c.rollout.n = 8  # samples per prompt (GRPO group size)
    c.rollout.max_new_tokens = 1024
    c.rollout.temperature = 1.0
    c.rollout.top_k = 0  # 0 = off
    c.rollout.top_p = 1.0
    c.rollout.max_concurrent_rows = 0  # rows decoded at once (bounds the KV cache); 0 = all
    # The rollout's replicas of the actor over the run's devices (`parallel.rollout_layout`):
    # each split over this many devices ('auto': the smallest power of two within one process's
    # devices at which a replica, its KV and the learner's state fit a device; 1 where it fits).
    c.rollout.tensor = "auto"
    # The once-per-step reshard of the quantized actor to those replicas moves it in buckets of
    # at most this many MiB per device (a larger tensor alone), one program each, so its
    # collectives' buffers hold one bucket, not the replica; 0 = the whole actor at once.
    c.rollout.reshard_bucket_mib = 1024
    # The vocabulary tables (token embedding, LM head) of a quantized actor as int8 codes with a
    # scale per entry, weight-only: the reshard then moves codes and scales only (about 0.9 bytes
    # per parameter instead of 1.5 for the 1.5B model) and each decode step reads the LM head at
    # 1 byte per weight. False keeps them in the compute dtype (Jet-RL's rollout, whose learner
    # does not quantize them either).
    c.rollout.quantize_vocab = True
    # Refill finished rows' slots with waiting rows (sampling.RefillSampler, continuous batching):
    # 'on', 'off' (the static chunked Sampler) or 'auto' = on when rows wait, i.e. when
    # max_concurrent_rows > 0 holds fewer rows than prompts_per_step * n. Both samplers draw the
    # same tokens for the same key, in one process or several.
    c.rollout.refill = "auto"
    # Paged KV pool of the refilling sampler (docs/paged_kv.md): 0 = fixed slots (every row
    # reserves prompt + max_new_tokens of KV); > 0 = a pool of this many pages, split evenly over
    # the batch shards (data x fsdp, a multiple of them), from which rows take pages as they grow,
    # so max_concurrent_rows bounds rows in flight and the pool their tokens. > 0 implies the
    # refilling sampler (refill 'auto' turns it on; 'off' is an error) and a dense kv_policy.
    # `python -m qurl_jax.bench.memory --kv_capacity` suggests a size for a target.
    c.rollout.kv_pages = 0
    c.rollout.kv_page_size = 16  # tokens per page of the rollout.kv_pages pool
    # The rollout's KV cache (dense, paged and Sparse-RL's compressed alike): 'bf16' = the compute
    # dtype; 'int8' / 'fp8' (e4m3) = 8-bit codes with a float32 scale per token and kv head,
    # quantized once as they are written (0.52x the bf16 bytes at head_dim 128), read by JAX's
    # paged kernels as they are on GPU and TPU and dequantized elsewhere. The error is part of
    # the sampler's logp_behav, so ACR / TIS correct it like the weights'; evaluation and the
    # learner keep full precision. Changes the math: a run resumes only with its own value.
    c.rollout.kv_precision = "bf16"
    # What one scale of an 8-bit cache covers: 'token' (per token and kv head) or 'sequence' (per
    # sequence and kv head, set from its prompt's keys / values; later tokens are clipped to it).
    # 'sequence' is what JAX's TPU paged kernel reads without a float32 scale array as large as
    # the pool, at an accuracy cost (both in docs/paged_kv.md). Changes the math.
    c.rollout.kv_scale = "token"
    # Free pages per batch shard an admission leaves while rows run (rollout.kv_pages); -1 = 1/16
    # of the shard's pages.
    c.rollout.kv_watermark_pages = -1
    # pi_behav handed to the learner: 'sampled' = the log-prob under the distribution that drew the
    # token (truncated and renormalised by top-k/top-p), the correct importance-sampling
    # denominator; 'untruncated' = under the full tempered softmax (too small by log Z on every
    # kept token when top-k/top-p truncate). Identical when nothing is truncated.
    c.rollout.behav_logp = "sampled"
    c.rollout.invariant_scaling = 1.0  # QuRL's s; 1.0 disables, 1.5 is the paper's value
    c.rollout.invariant_scaling_targets = ("qkv",)  # 'qkv' and/or 'gate_up'
    # Sparse-RL: the rollout sampler's KV cache (evaluation and the learner stay dense). A
    # compressed policy keeps kv_budget tokens, recompressing every kv_interval decode steps, in a
    # cache of kv_budget + kv_interval slots per row. Pair with rl.loss_mode = 'sparse_rl'.
    c.rollout.kv_policy = "dense"  # dense | streaming | snapkv | rkv
    c.rollout.kv_budget = 512  # tokens kept after each compression
    c.rollout.kv_interval = 128  # decode steps between compressions
    c.rollout.kv_window = 8  # observation window: last queries that score; last tokens always kept
    c.rollout.kv_pool_kernel = 7  # max-pool kernel over token scores (odd)
    c.rollout.rkv_alpha = 0.1  # R-KV: alpha * attention - (1 - alpha) * redundancy
    c.rollout.kv_sinks = 4  # StreamingLLM: first tokens always kept
    c.rollout.kv_selection = "shared"  # shared (layer 0 chooses for all, as Sparse-RL) | per_layer

    c.rl = ml_collections.ConfigDict()
    c.rl.loss_mode = "acr"  # on_policy | naive | tis | mis | acr | sparse_rl
    c.rl.eps_low = 0.2
    c.rl.eps_high = 0.2  # DAPO clip-higher: 0.28
    c.rl.cap = 2.0  # truncation C of the importance weight pi_prox / pi_behav
    c.rl.agg = "seq_mean_token_mean"  # token_mean (DAPO) | seq_mean_token_mean | ..._sum_norm
    c.rl.kl_coef = 0.0  # k3 KL to the initial policy; QuRL GRPO uses 1e-3
    c.rl.kl_estimator = "k3"
    c.rl.entropy_coef = 0.0
    c.rl.dual_clip = 0.0  # dual-clip constant c > 1 for negative advantages; 0 = off
    c.rl.logratio_clamp = 20.0  # safety clamp on |log w| and |log R|
    c.rl.mis_lo = 0.5  # mis: a token (or sequence) with weight outside [mis_lo, mis_hi] is rejected
    c.rl.mis_hi = 2.0
    c.rl.mis_level = "token"  # token | sequence | geometric
    c.rl.veto_tau = 1e-4  # sparse_rl: reject a sequence if any pi_prox / pi_behav < tau; 0 = off
    c.rl.sparse_cap = 1.5  # sparse_rl: truncation of the reweighting
    c.rl.sparse_mask_band = ()  # sparse_rl: e.g. (0.5, 1.5) rejects tokens outside the band
    c.rl.sparse_base = "tis"  # sparse_rl: 'acr' combines the corrections with ACR's clip bound
    c.rl.batch_normalize = False  # renormalise importance weights to batch mean 1
    c.rl.advantage = "grpo"  # grpo | dr_grpo | rloo
    c.rl.dynamic_sampling = False  # DAPO: drop groups whose filter_metric is all equal; regenerate
    # 'accuracy': the verifier's 0/1 outcome, as DAPO filters; 'reward': the shaped reward (with
    # the format and overlong terms), which keeps an all-wrong group if one response is overlong.
    c.rl.filter_metric = "accuracy"
    c.rl.max_gen_batches = 3  # most generation rounds a step runs with dynamic sampling
    c.rl.overlong_buffer = 0  # DAPO overlong shaping buffer L_c in tokens; 0 disables
    c.rl.overlong_factor = 1.0
    c.rl.ppo_epochs = 1  # passes over the rollout batch
    c.rl.num_minibatches = 1  # optimizer steps per pass
    c.rl.num_micro_batches = 1  # gradient accumulation inside one optimizer step

    c.optim = ml_collections.ConfigDict()
    c.optim.learning_rate = 1e-6  # 0 = a control run (see train.apply_updates)
    c.optim.warmup_steps = 0
    c.optim.decay_steps = 0  # cosine decay steps after warm-up; 0 = constant
    c.optim.end_lr_ratio = 0.0  # learning rate at the end of the cosine decay / learning_rate
    c.optim.weight_decay = 0.01
    c.optim.b1 = 0.9
    c.optim.b2 = 0.999
    c.optim.eps = 1e-8
    c.optim.grad_clip = 1.0

    # Devices per axis within one slice; -1 on one axis takes the devices the others leave (the
    # paper configs' fsdp could be -1 on any machine). A mesh smaller than the devices warns.
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
    # Slices (TPU) or processes (GPU hosts) each axis spans over the data-center network, e.g.
    # dcn.data=2 for 2 x v5p-128; an axis's total size is mesh.<axis> * mesh.dcn.<axis>.
    c.mesh.dcn = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))

    c.reward = ml_collections.ConfigDict()
    c.reward.workers = 4  # math task: verifier processes (a process pool), each under timeout_s
    c.reward.timeout_s = 5.0  # per-response verification timeout
    c.reward.format_weight = 0.0  # weight of the format reward (one \boxed{} answer)
    # Your own reward instead of data.task's verifier: 'module.path:name' or 'path/to/file.py:name',
    # a function (responses, answers[, prompts]) -> list of floats, run in the verifier processes
    # under reward.timeout_s (a call that fails scores 0 and is counted); '' = data.task's verifier.
    c.reward.function = ""

    c.train = ml_collections.ConfigDict()
    c.train.num_steps = 100
    c.train.checkpoint_every = 10
    c.train.keep_checkpoints = 3
    c.train.eval_every = 0  # 0 = only before and after training
    c.train.max_bad_steps = 3  # consecutive non-finite updates before the run stops
    c.train.export_hf = ""  # directory to export the final model to (Hugging Face format)
    c.train.progress = True  # a bar on a terminal; off one (or if False) a line every few steps
    # False: the control run. Every phase runs and is logged, but the update is computed and then
    # discarded, as with learning rate 0, so an evaluation gain cannot come from the updates.
    c.train.apply_updates = True
    c.train.report_speed = False  # end of run: time the quantized vs fp32 rollout on one batch
    # learner: per-layer rematerialisation, none | dots | projections | full (`models.Remat`)
    c.train.remat = "none"
    c.train.scan_layers = False  # learner: layers as one lax.scan (large models; pair with remat)
    c.train.logprob_chunk = 512  # learner: response positions per LM-head / log-softmax chunk
    # XLA:CPU's float matrix products (`qurl_jax.runtime.xla_cpu`): 'xla' (its choice: YNNPACK
    # fusions where they take the dot), 'learner' (Eigen's in the learner's update and log-prob
    # programs only), 'eigen' (YNNPACK off in every program: set by `python -m qurl_jax.main`
    # before JAX starts), 'auto' ('learner' on a CPU without AVX512, else 'xla'). CPU only.
    c.train.cpu_dots = "auto"
    # glibc malloc arenas the process's threads share (0: glibc's own, 8 per core); 2 takes
    # 0.7-1.0 GB off a 135M model's step on CPU (`qurl_jax.runtime.malloc`). Set by
    # `python -m qurl_jax.main` before JAX starts; a user's MALLOC_ARENA_MAX wins.
    c.train.malloc_arenas = 0
    # Hand the heap's freed pages back to the system before every update and after every step
    # (glibc's malloc_trim; CPU hosts): what the rollout and the update freed otherwise stays
    # resident and the next update's temporaries land beside it. Checkpoint saves trim regardless.
    c.train.malloc_trim_steps = False
    # Learner batches packed: each micro-batch's sequences, without padding, into rows of
    # train.pack_length tokens (0: the longest sequence the config allows, rounded up to the
    # attention block); False runs today's padded [rows, max_prompt_len + max_new_tokens] layout.
    c.train.packing = True
    c.train.pack_length = 0
    # With packing: update micro-batches of this many packed tokens (rows of pack_length), as many
    # as a minibatch needs (bucketed), instead of rl.num_micro_batches; the log-prob passes run
    # in slices of the same rows. Per process, rounded up to its devices; 0 = off.
    c.train.tokens_per_micro_batch = 0
    # With packing: sizes per doubling of the packed row (and token-budget micro-batch) counts
    # the learner's programs are compiled for, a power of two: 8 leaves at most 1/8 of the rows
    # padding; fewer compile fewer programs, for models whose compile costs more than the
    # padding (configs/arith_tiny.py: 2).
    c.train.pack_buckets = 8
    # The learner runs each group's prompt once, its rollout.n responses attending to it
    # (`learner.packing.pack_budget`), instead of once per sample: the same log-probs and
    # gradients up to float rounding. Needs packing, one minibatch, train.precision 'fp' and
    # packed rows of <= 1024 tokens (dense attention); micro-batches then hold whole groups, and
    # a train.pack_length that fits a prompt and several responses pays most. 'auto': where
    # those hold (the run's log says which), 'on': an error where they do not, 'off'.
    c.train.share_prompts = "off"
    # Learner matmul precision, independent of rollout.precision: 'fp' | 'fp8_block' (every linear
    # layer's forward and backward in block-scaled FP8). fp8_block with rollout.precision =
    # 'fp8_block' is Jet-RL's unified flow: pi_prox is the quantized policy the rollout sampled.
    c.train.precision = "fp"
    # 'exact': the rollout computes every value that feeds a quantizer or a log-prob in the
    # learner forward's order (fixed-order products, norms, attention and log-softmax, one model
    # on both sides: `models.exact`), so pi_behav equals pi_prox bit for bit when both run the
    # same precision (fp / fp, or Jet-RL's fp8_block / fp8_block). 'default': XLA's own orders.
    # CPU kernels (AVX2 + FMA); docs/jet_rl.md. Changes the math: a run resumes only with its own.
    c.train.on_policy_numerics = "default"
    # Before the first step, compile every program and stop if one needs more memory per device
    # than the device has (naming the knob to change): 'auto' when the programs are compiled for
    # an accelerator only, 'on' also for the CPU (then memory_limit_gib must be set), 'off'.
    c.train.preflight = "auto"
    # What the preflight compiles for (`qurl_jax.parallel.targets`): '' = this run's own devices, or
    # a machine this host need not have, by its compiler on compile-only devices (`tpu:v5p-16`,
    # `gpu:h100-8`; needs `pip install -e .[tpu-compile]` / `.[gpu-compile]`), e.g. to check on a
    # workstation that the run fits the slice it is meant for.
    c.train.preflight_target = ""
    # Per device; 0 = the device's own limit (a preflight target: 85% of its chip's memory).
    c.train.memory_limit_gib = 0.0
    # JAX's persistent compilation cache (`qurl_jax.runtime.compilation`), which `python -m
    # qurl_jax.main` turns on: 'auto' = <workdir>/compile_cache, '' = none, else a directory or URL
    # (share one across runs of the same shapes). A restarted run, and the first step after the
    # memory preflight, load their programs from it instead of compiling them again.
    c.train.compilation_cache_dir = "auto"
    # Metric sinks besides <workdir>/metrics.jsonl: 'tensorboard' (<workdir>/tensorboard) and/or
    # 'wandb' (Weights & Biases; skipped with a warning when not installed; WANDB_MODE=offline).
    c.train.loggers = ("tensorboard",)
    c.train.wandb_project = "qurl_jax"  # the W&B project of train.loggers 'wandb'
    # Stall watchdog (`qurl_jax.runtime.watchdog`): a step phase running past this many seconds ends
    # every process with its stacks in <workdir>/stall-<process>.txt and exit code 75, for a
    # restart from the last checkpoint. 0 = on in multi-process runs only, with the automatic
    # limit max(10 x the slowest phase seen, 600 s) (1800 s until the first step ends); > 0 = on
    # with this limit; < 0 = off.
    c.train.stall_timeout_s = 0.0
    # Debug: every step, compare across processes a fingerprint of the jitted programs each
    # dispatched (names, shapes, shardings); a difference stops the run naming the first one
    # (`qurl_jax.parallel.program_check`). Costs a hash per dispatch and a small collective per
    # step.
    c.train.check_collectives = False

    c.eval = ml_collections.ConfigDict()
    c.eval.files = ()  # math evaluation sets; empty = none
    c.eval.max_examples = 0  # per set; 0 = all
    c.eval.k = 1  # samples per problem for Avg@k / Pass@k
    c.eval.temperature = 0.6
    # True: greedy accuracy only; False: also Avg@k / Pass@k of eval.k samples at eval.temperature
    # (greedy accuracy is always reported)
    c.eval.greedy_only = False
    c.eval.max_new_tokens = 1024
    c.eval.before = True  # evaluate before the first RL step too (off: after training only)
    # The evaluation sampler's KV cache: 'dense', or 'rollout' = the rollout's compressed
    # rollout.kv_policy (budget, interval, ...) with full-precision weights: Sparse-RL's check of
    # a model under sparse inference (`python -m qurl_jax.evaluate` names its file by the policy).
    c.eval.kv_cache = "dense"

    c.sft = ml_collections.ConfigDict()  # supervised warm start (embedded default only)
    c.sft.steps = 0
    c.sft.learning_rate = 3e-3
    c.sft.batch_size = 64
    c.sft.format_noise = 0.0  # arithmetic: share of warm-start answers with a stray end character
    # chain: probability that the teacher forgets the carry of an addition whose units digits sum
    # to exactly ten (each time it meets one)
    c.sft.bug_rate = 0.0
    c.lock()
    return c


def field_docs() -> dict[str, str]:
    """Dotted field name -> its one-line doc: the comment on the field's line in `base_config`,
    else the comment lines just above it (first sentence-sized line)."""
    import inspect

    docs: dict[str, str] = {}
    above: list[str] = []
    for line in inspect.getsource(base_config).splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("# ").strip())
            continue
        match = re.match(r"c\.([\w.]+)\s*=", text)
        if match:
            comment = text.split("  # ", 1)[1].strip() if "  # " in text else " ".join(above)
            if comment:
                docs[match.group(1)] = comment
        above = []
    return docs


def _leaves(c: ml_collections.ConfigDict, prefix: str = "") -> list[tuple[str, object]]:
    out = []
    for key, value in c.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict):
            out.extend(_leaves(value, name + "."))
        else:
            out.append((name, value))
    return out


def format_config(c: ml_collections.ConfigDict, width: int = 100) -> str:
    """Every field as `name = value  # doc`, the whole doc wrapped at `width` columns onto
    indented `    # ...` lines, starting on the line below a value too long to leave it 20
    columns (a section's doc, e.g. `model.tiny`'s, stands for fields that have none of their
    own)."""
    import textwrap

    docs = field_docs()
    lines = []
    for name, value in _leaves(c):
        doc = docs.get(name) or docs.get(name.rsplit(".", 1)[0], "")
        line = f"{name} = {value!r}"
        if doc and width - len(line) - 4 < 20:  # a long value: the doc on the line below
            lines.append(line)
            line = "    "
        if doc:
            first = line + "  # " if line.strip() else "    # "
            line = textwrap.fill(doc, width, initial_indent=first,
                                 subsequent_indent="    # ", break_on_hyphens=False)
        lines.append(line)
    return "\n".join(lines)


def ignored_fields(c: ml_collections.ConfigDict) -> list[str]:
    """Warnings for set fields that this config's other choices ignore."""
    out = []
    if c.model.source == "tiny" and c.model.path:
        out.append(f"config.model.path={c.model.path!r} is ignored: model.source='tiny' builds "
                   "the model in code (set --config.model.source=hf to load model.path)")
    if c.data.task != "math" and tuple(c.data.train_files) != tuple(
            base_config().data.train_files):
        out.append(f"config.data.train_files is ignored: data.task={c.data.task!r} makes its "
                   "own problems")
    base = base_config().data
    for field in ("prompt_key", "answer_key", "prompt_suffix"):
        if c.data.task != "math" and c.data[field] != base[field]:
            out.append(f"config.data.{field} is ignored: data.task={c.data.task!r} makes its "
                       "own prompts")
    return out


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A validated config converted once: the typed `settings` the trainer and everything below it
    read, the resolved config's dotted leaves (`flat`) that `run_config` saves and compares on
    resume, and one line per setting that only makes the run slow (`checks.slow_settings`)."""

    settings: RunSettings
    flat: dict[str, Any]
    warnings: tuple[str, ...]


def resolve(c: ml_collections.ConfigDict) -> Resolved:
    """`validate`s `c` (one `ConfigError` line naming a bad field) and converts it once."""
    from qurl_jax.config import checks, run_config

    c = validate(c)
    return Resolved(RunSettings.from_config(c), run_config.flatten(c),
                    tuple(checks.slow_settings(c)))


def load_config_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of a config file, as `--config=` takes it (for tools that run configs)."""
    spec = importlib.util.spec_from_file_location("qurl_jax_config_file", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"config file {path!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


# Range of every numeric field that `validate` checks beyond its type (chain_*, kv_* and the
# objective's fields are checked by ChainConfig, KVPolicyConfig and ObjectiveConfig; the paged
# pool's by `_check_paging`, beyond these ranges).
_POSITIVE = (
    "data.prompts_per_step", "data.max_prompt_len", "data.arith_digits", "rollout.n",
    "rollout.max_new_tokens", "rollout.temperature", "rollout.invariant_scaling", "rl.cap",
    "rollout.kv_page_size", "rl.logratio_clamp", "rl.sparse_cap", "rl.max_gen_batches",
    "rl.ppo_epochs", "rl.num_minibatches", "rl.num_micro_batches", "optim.eps", "reward.workers",
    "reward.timeout_s", "train.num_steps", "train.checkpoint_every", "train.keep_checkpoints",
    "train.max_bad_steps", "train.logprob_chunk", "eval.k", "eval.max_new_tokens",
    "sft.learning_rate", "sft.batch_size", "model.tiny.hidden_size",
    "model.tiny.intermediate_size", "model.tiny.num_layers", "model.tiny.num_heads",
    "model.tiny.num_kv_heads", "model.tiny.head_dim", "model.tiny.rope_theta",
    "model.tiny.max_position_embeddings")
_NON_NEGATIVE = (
    "seed", "rollout.top_k", "rollout.max_concurrent_rows", "rollout.kv_pages", "rl.eps_low",
    "rl.eps_high", "rl.kl_coef", "rl.dual_clip", "rl.veto_tau", "rl.overlong_buffer",
    "rl.overlong_factor", "optim.learning_rate", "optim.weight_decay", "optim.grad_clip",
    "optim.warmup_steps", "optim.decay_steps", "sft.steps", "train.eval_every",
    "train.memory_limit_gib", "train.pack_length", "train.tokens_per_micro_batch",
    "eval.max_examples", "eval.temperature", "rollout.reshard_bucket_mib", "train.malloc_arenas")
# field -> (low, high, whether high is excluded)
_INTERVALS = {"optim.b1": (0.0, 1.0, True), "optim.b2": (0.0, 1.0, True),
              "optim.end_lr_ratio": (0.0, 1.0, False), "reward.format_weight": (0.0, 1.0, False),
              "sft.format_noise": (0.0, 1.0, False), "sft.bug_rate": (0.0, 1.0, False)}


def _field(c: ml_collections.ConfigDict, field: str) -> object:
    """The value of a dotted field ('model.tiny.head_dim', 'seed')."""
    value: object = c
    for part in field.split("."):
        value = value[part]
    return value


def _choice(value: str, choices: tuple[str, ...], field: str) -> None:
    if value not in choices:
        raise ConfigError(f"config.{field}={value!r} is not one of {choices}")


def _positive(value: float, field: str, strict: bool = True) -> None:
    if (value <= 0) if strict else (value < 0):
        raise ConfigError(f"config.{field}={value!r} must be {'> 0' if strict else '>= 0'}")


def _check_paging(c: ml_collections.ConfigDict) -> None:
    """The KV policy's fields, and the paged pool's (`rollout.kv_pages`) against the sampler,
    the KV policy, the mesh's batch shards (when no axis is -1) and the longest row."""
    r = c.rollout
    kv_policy = kv_policy_from_config(r)
    if r.kv_watermark_pages < -1:
        raise ConfigError(f"config.rollout.kv_watermark_pages={r.kv_watermark_pages} must be "
                          ">= 0 (or -1: 1/16 of a batch shard's pages)")
    if not r.kv_pages:
        return
    if r.refill == "off":
        raise ConfigError(f"config.rollout.kv_pages={r.kv_pages}: a paged KV pool needs the "
                          "refilling sampler; set rollout.refill to 'auto' or 'on' (or "
                          "kv_pages to 0)")
    if kv_policy.compresses:
        raise ConfigError(f"config.rollout.kv_pages={r.kv_pages}: a paged KV pool does not "
                          f"take the compressing rollout.kv_policy={r.kv_policy!r}; set one "
                          "of them to 0 / 'dense'")
    from qurl_jax.parallel.rollout_layout import parse_tensor

    tensor = parse_tensor(r.get("tensor", "auto"))
    if -1 in (c.mesh.data, c.mesh.fsdp, c.mesh.tensor) or tensor is None:
        return  # the batch shards are known once the mesh is built: the sampler checks
    # The rollout's batch shards are its replicas (`qurl_jax.parallel.rollout_layout`).
    shards = (c.mesh.data * c.mesh.dcn.data * c.mesh.fsdp * c.mesh.dcn.fsdp * c.mesh.tensor
              * c.mesh.dcn.tensor) // tensor
    if r.kv_pages % shards:
        raise ConfigError(f"config.rollout.kv_pages={r.kv_pages} must be a multiple of the "
                          f"batch shards (the rollout's replicas: mesh devices / "
                          f"rollout.tensor = {shards})")
    tokens = c.data.max_prompt_len + r.max_new_tokens
    need = -(-tokens // r.kv_page_size)
    if r.kv_pages // shards < need:
        raise ConfigError(f"config.rollout.kv_pages={r.kv_pages}: a batch shard's pool of "
                          f"{r.kv_pages // shards} pages of {r.kv_page_size} tokens holds no "
                          f"row of data.max_prompt_len + rollout.max_new_tokens = {tokens} "
                          f"tokens (needs {need} pages per shard, {need * shards} in all)")


def _check_lora(c: ml_collections.ConfigDict) -> None:
    """`model.lora`'s fields, and the settings a frozen base cannot take."""
    from qurl_jax.config.settings import lora_config

    try:
        cfg = lora_config(c.model).validate()
        if cfg.enabled:
            check_base_recipe(cfg, RunSettings.from_config(c).rollout.recipe)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if not cfg.enabled:
        return
    if c.train.precision != "fp":
        raise ConfigError(f"config.train.precision={c.train.precision!r}: a LoRA run "
                          "(model.lora.rank > 0) learns on the frozen base's codes; set it to 'fp'")
    if c.rollout.invariant_scaling != 1.0:
        raise ConfigError(f"config.rollout.invariant_scaling={c.rollout.invariant_scaling}: a "
                          "frozen base is never requantized, and a rescaled base would not be the "
                          "Hugging Face base a PEFT adapter is loaded onto; set it to 1.0 with "
                          "model.lora.rank > 0")


def validate(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks values; raises `ConfigError` (a ValueError) naming the first bad field. Returns `c`.

    Reads no data and touches no device: the numbers' ranges, the choices, the files' existence.
    A precision named by another accepted name (`PRECISION_ALIASES`: 'fp32') is replaced by the
    canonical one, so runs and their saved configs agree.
    """
    _choice(c.model.source, MODEL_SOURCES, "model.source")
    if c.model.source == "hf":
        if not c.model.path:
            raise ConfigError("config.model.path is empty; set it to a Hugging Face directory")
        if not paths.exists(c.model.path):
            raise ConfigError(f"config.model.path={c.model.path!r} does not exist")
        if not paths.isfile(paths.join(c.model.path, "config.json")):
            raise ConfigError(f"config.model.path={c.model.path!r} has no config.json")
    elif c.model.source == "gguf":
        if not c.model.path or not os.path.isfile(c.model.path):
            raise ConfigError(f"config.model.path={c.model.path!r} is not a local GGUF file "
                              "(model.source='gguf'; python -m qurl_jax.models.fetch gets one)")
    else:
        _choice(c.model.tiny.model_type, SUPPORTED_MODEL_TYPES, "model.tiny.model_type")
    _choice(c.data.task, TASKS, "data.task")
    if c.data.task == "math":
        for f in c.data.train_files:
            if not paths.exists(paths.data_path(f)):
                raise ConfigError(f"config.data.train_files: {f!r} does not exist")
    if c.data.task == "chain":
        try:
            chain_config(c.data).validate(prefix="config.data.chain_")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if c.data.split_seed < -1:
        raise ConfigError(f"config.data.split_seed={c.data.split_seed} must be >= 0 (or -1: seed)")
    if bool(c.data.prompt_key) != bool(c.data.answer_key):
        raise ConfigError(f"config.data.prompt_key={c.data.prompt_key!r} and config.data."
                          f"answer_key={c.data.answer_key!r}: set both (or neither, to detect "
                          "the layout)")
    if c.reward.function:
        from qurl_jax.data import reward_hook

        reward_hook.load(c.reward.function)  # imports it: ConfigError naming what is wrong
    for f in c.eval.files:
        if not paths.exists(paths.data_path(f)):
            raise ConfigError(f"config.eval.files: {f!r} does not exist")
    _choice(c.model.attention, tuple(i.value for i in AttentionImplementation), "model.attention")
    _choice(c.model.decode_attention, DECODE_ATTENTION, "model.decode_attention")
    _choice(c.train.remat, tuple(r.value for r in Remat), "train.remat")
    _choice(c.train.cpu_dots, CPU_DOTS, "train.cpu_dots")
    for section in (c.rollout, c.train):  # 'fp32' is 'fp' (full precision)
        section.precision = PRECISION_ALIASES.get(section.precision, section.precision)
    _choice(c.rollout.precision, PRECISIONS, "rollout.precision")
    _choice(c.rollout.kv_precision, KV_PRECISIONS, "rollout.kv_precision")
    _choice(c.rollout.kv_scale, KV_SCALES, "rollout.kv_scale")
    _choice(c.train.precision, TRAIN_PRECISIONS, "train.precision")
    _choice(c.train.on_policy_numerics, NUMERICS, "train.on_policy_numerics")
    _choice(c.rl.loss_mode, LOSS_MODES, "rl.loss_mode")
    _choice(c.rl.agg, AGGREGATIONS, "rl.agg")
    _choice(c.rl.advantage, ADVANTAGES, "rl.advantage")
    _choice(c.rl.kl_estimator, KL_ESTIMATORS, "rl.kl_estimator")
    _choice(c.rollout.behav_logp, BEHAV_LOGPS, "rollout.behav_logp")
    _choice(c.rollout.refill, REFILL, "rollout.refill")
    _choice(c.eval.kv_cache, EVAL_KV_CACHES, "eval.kv_cache")
    if c.eval.kv_cache == "rollout" and c.rollout.kv_policy == "dense":
        raise ConfigError("config.eval.kv_cache='rollout' evaluates with the rollout's compressed "
                          "KV cache, but rollout.kv_policy='dense'; name a policy (rkv, snapkv, "
                          "streaming) or set eval.kv_cache='dense'")
    from qurl_jax.parallel.rollout_layout import parse_tensor

    try:
        parse_tensor(c.rollout.tensor)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _choice(c.rl.filter_metric, FILTER_METRICS, "rl.filter_metric")
    _choice(c.train.preflight, ("auto", "on", "off"), "train.preflight")
    if c.train.preflight_target:
        from qurl_jax.parallel import targets

        try:
            targets.parse(c.train.preflight_target)
        except targets.TargetError as e:
            raise ConfigError(f"config.train.preflight_target: {e}") from None
    for field in _POSITIVE:
        _positive(_field(c, field), field)
    for field in _NON_NEGATIVE:
        _positive(_field(c, field), field, strict=False)
    for field, (lo, hi, hi_open) in _INTERVALS.items():
        value = _field(c, field)
        if not (lo <= value < hi if hi_open else lo <= value <= hi):
            raise ConfigError(
                f"config.{field}={value} must be in [{lo}, {hi}{')' if hi_open else ']'}")
    sizes = {axis: c.mesh[axis] for axis in ("data", "fsdp", "tensor")}
    for axis, size in sizes.items():
        if size < 1 and size != -1:
            raise ConfigError(f"config.mesh.{axis}={size} must be >= 1, or -1 (the devices the "
                              "other axes leave)")
    if list(sizes.values()).count(-1) > 1:
        raise ConfigError(f"config.mesh {sizes}: at most one axis may be -1")
    for axis in ("data", "fsdp", "tensor"):
        _positive(c.mesh.dcn[axis], f"mesh.dcn.{axis}")
    if c.rl.dual_clip and c.rl.dual_clip <= 1.0:
        raise ConfigError(f"config.rl.dual_clip={c.rl.dual_clip} must be 0 (off) or > 1")
    if not 0.0 < c.rollout.top_p <= 1.0:
        raise ConfigError(f"config.rollout.top_p={c.rollout.top_p} must be in (0, 1]")
    for logger in c.train.loggers:
        _choice(logger, LOGGERS, "train.loggers")
    for t in c.rollout.invariant_scaling_targets:
        _choice(t, ("qkv", "gate_up"), "rollout.invariant_scaling_targets")
    _check_paging(c)
    _check_lora(c)
    from qurl_jax.config.checks import check_context, check_learnable

    check_context(c)
    check_learnable(c)
    from qurl_jax.config.checks import check_packing

    check_packing(c)
    from qurl_jax.config.checks import check_exact_numerics

    check_exact_numerics(c)
    try:
        objective_from_config(c.rl)
    except ValueError as e:
        raise ConfigError(f"config.rl: {e}") from e
    batch = c.data.prompts_per_step * c.rollout.n
    if batch % c.rl.num_minibatches:
        raise ConfigError(f"config.rl.num_minibatches={c.rl.num_minibatches} does not divide the "
                          f"rollout batch data.prompts_per_step * rollout.n = {batch}")
    if (batch // c.rl.num_minibatches) % c.rl.num_micro_batches:
        raise ConfigError(f"config.rl.num_micro_batches={c.rl.num_micro_batches} does not divide "
                          f"the minibatch size {batch // c.rl.num_minibatches}")
    return c
