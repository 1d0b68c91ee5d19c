"""The run's typed settings: the sections of a validated `ConfigDict` that the code below the
trainer reads, as frozen dataclasses.

The trainer validates the `ConfigDict` once (`config.validate`, which names a bad or unknown field
in one line) and converts it once with `RunSettings.from_config` (the other entry points, `study`
and the benchmarks' command lines, convert theirs the same way); everything below takes the typed
section it needs: `ModelSettings` to build the model, `DataSettings` for the prompts,
`RewardSettings` for the verifier, `SftSettings` for the embedded default's warm start,
`TrainSettings` for the learner, and `RolloutSettings`, `MeshSizes` (with the others) for the
memory plan of the run's programs. Each section has one converter, `from_config`, which copies
values; the typed configs the sections hold (objective, KV policy, optimizer, rollout sampler,
evaluation) are converted by `qurl_jax.config.base`, whose converters name a bad field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import ml_collections
from jax.sharding import Mesh

from qurl_jax import quant
from qurl_jax.data.arithmetic import ArithmeticConfig
from qurl_jax.data.chains import ChainConfig
from qurl_jax.data.datasets import PROMPT_SUFFIX
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.learner.packing import PER_DOUBLING
from qurl_jax.learner.prox import ProxSource, prox_source
from qurl_jax.lora import LoraConfig
from qurl_jax.models import ModelConfig
from qurl_jax.rl.objectives import ObjectiveConfig
from qurl_jax.runtime import paths
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.runtime.paths import data_path
from qurl_jax.sampling import KVPolicyConfig, SamplingParams
from qurl_jax.sampling.factory import RolloutSamplerSettings


def objective_from_config(rl: ml_collections.ConfigDict) -> ObjectiveConfig:
    """The `ObjectiveConfig` of the `rl` config section."""
    return ObjectiveConfig(
        mode=rl.loss_mode, eps_low=rl.eps_low, eps_high=rl.eps_high, cap=rl.cap, agg=rl.agg,
        kl_coef=rl.kl_coef, kl_estimator=rl.kl_estimator, entropy_coef=rl.entropy_coef,
        dual_clip=rl.dual_clip or None, logratio_clamp=rl.logratio_clamp, mis_lo=rl.mis_lo,
        mis_hi=rl.mis_hi, mis_level=rl.mis_level, veto_tau=rl.veto_tau or None,
        sparse_cap=rl.sparse_cap, sparse_mask_band=tuple(rl.sparse_mask_band) or None,
        sparse_base=rl.sparse_base, batch_normalize=rl.batch_normalize,
    ).validate()


# KVPolicyConfig field -> its rollout config field, so a bad value is reported by its config name.
_KV_FIELDS = {"policy": "kv_policy", "budget": "kv_budget", "interval": "kv_interval",
              "window": "kv_window", "pool_kernel": "kv_pool_kernel", "rkv_alpha": "rkv_alpha",
              "sinks": "kv_sinks", "selection": "kv_selection"}


def kv_policy_from_config(rollout: ml_collections.ConfigDict) -> KVPolicyConfig:
    """The rollout sampler's `KVPolicyConfig`; ValueError names the bad `config.rollout` field."""
    try:
        return KVPolicyConfig(**{f: rollout[name] for f, name in _KV_FIELDS.items()})
    except ValueError as e:
        message = str(e)
        for field, name in _KV_FIELDS.items():
            prefix = f"KVPolicyConfig.{field}:"
            if message.startswith(prefix):
                message = f"config.rollout.{name}:" + message[len(prefix):]
        raise ConfigError(message) from None


def optim_from_config(o: ml_collections.ConfigDict) -> OptimConfig:
    """The learner's `OptimConfig` of the `optim` config section (every field carried over)."""
    return OptimConfig(learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
                       decay_steps=o.decay_steps, end_lr_ratio=o.end_lr_ratio,
                       weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, eps=o.eps,
                       grad_clip=o.grad_clip)


def refill_enabled(c: ml_collections.ConfigDict) -> bool:
    """Whether the rollout uses the refilling sampler (`rollout.refill`; 'auto': when rows wait for
    a slot, the only case where refilling can help)."""
    return rollout_sampler_settings(c).refills


def rollout_sampler_settings(c: ml_collections.ConfigDict) -> RolloutSamplerSettings:
    """The typed settings `sampling.factory.build_rollout_sampler` builds the run's rollout
    sampler from."""
    return RolloutSamplerSettings(
        refill=c.rollout.refill, max_concurrent_rows=c.rollout.max_concurrent_rows,
        rows_per_step=c.data.prompts_per_step * c.rollout.n,
        kv_policy=kv_policy_from_config(c.rollout), decode_attention=c.model.decode_attention,
        kv_pages=c.rollout.kv_pages, kv_page_size=c.rollout.kv_page_size,
        kv_watermark_pages=None if c.rollout.kv_watermark_pages < 0
        else c.rollout.kv_watermark_pages,
        kv_precision=c.rollout.get("kv_precision", "bf16"),
        kv_scale=c.rollout.get("kv_scale", "token"))


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """The `eval` section, typed (`eval_settings`): the sets the task reads and what
    `Task.evaluate` needs.

    k: samples per problem for Avg@k / Pass@k; temperature: their sampling temperature;
    greedy_only: greedy accuracy only (no sampled Avg@k); max_new_tokens: response length limit;
    max_examples: problems per set (0 = all); files: the math evaluation sets, read by the task
    beside a synthetic task's own held-out set; kv_cache: 'dense', or 'rollout' (the evaluation
    sampler takes the rollout's compressed KV policy, `build_eval_sampler(compressed=True)`).
    """

    k: int = 1
    temperature: float = 0.6
    greedy_only: bool = False
    max_new_tokens: int = 1024
    max_examples: int = 0
    files: tuple[str, ...] = ()
    kv_cache: str = "dense"

    def sampling(self, eos_ids: Sequence[int], greedy: bool = False) -> SamplingParams:
        """The `SamplingParams` of an evaluation call (greedy, or at `temperature`)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              greedy=greedy, eos_ids=tuple(eos_ids))


def eval_settings(c: ml_collections.ConfigDict) -> EvalSettings:
    """The run's `EvalSettings` (`config.eval`)."""
    e = c.eval
    return EvalSettings(k=e.k, temperature=e.temperature, greedy_only=e.greedy_only,
                        max_new_tokens=e.max_new_tokens, max_examples=e.max_examples,
                        files=tuple(map(paths.data_path, e.files)), kv_cache=e.kv_cache)


def chain_config(data: ml_collections.ConfigDict) -> ChainConfig:
    """The `ChainConfig` of the `data` section's chain_* fields (not validated)."""
    return ChainConfig(min_steps=data.chain_min_steps, max_steps=data.chain_max_steps,
                       carry10_share=data.chain_carry10_share)


def _copy_fields(cls: type, section: ml_collections.ConfigDict) -> Any:
    """`cls` with each of its fields read from the config `section`'s field of the same name."""
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class TinyShape:
    """The in-code model's shape (`model.tiny`; its vocabulary is the character tokenizer's)."""

    model_type: str = "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 256

    @classmethod
    def from_config(cls, tiny: ml_collections.ConfigDict) -> TinyShape:
        return _copy_fields(cls, tiny)


def lora_config(model: ml_collections.ConfigDict) -> LoraConfig:
    """The `LoraConfig` of the `model` section's `lora` (not validated; absent: no LoRA)."""
    lora = model.get("lora")
    if lora is None:
        return LoraConfig()
    return LoraConfig(rank=int(lora.rank), alpha=float(lora.alpha), targets=tuple(lora.targets),
                      base_precision=str(lora.base_precision),
                      learner_products=str(lora.learner_products))


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Which policy to train (`model`).

    source: 'hf' loads the Hugging Face directory `path`; 'gguf' the llama.cpp file `path`;
    'tiny' builds `tiny` in code.
    dtype: compute dtype (master weights are float32). attention: the attention implementation.
    lora: the adapters a LoRA run trains on its frozen base (`lora.LoraConfig`; rank 0: none).
    """

    source: str = "hf"
    path: str = ""
    dtype: str = "float32"
    attention: str = "auto"
    tiny: TinyShape = TinyShape()
    lora: LoraConfig = LoraConfig()

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelSettings:
        return cls(source=model.source, path=model.path, dtype=model.dtype,
                   attention=model.attention, tiny=TinyShape.from_config(model.tiny),
                   lora=lora_config(model))


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """What the task trains on (`data`).

    task: 'math' (the `train_files`), 'arithmetic' or 'chain' (synthetic, shaped by `arith_digits`
    / `arith_ops` and `chain`); prompts_per_step: distinct prompts per RL step; max_prompt_len:
    longer prompts are skipped; chat_template: prompts through the tokenizer's chat template;
    split_seed: the synthetic train / held-out split's seed, -1 = the run's seed (`split_seed_of`);
    prompt_key / answer_key: the math files' row fields ('' = detect the layout); prompt_suffix:
    appended to every math problem. `train_files` are resolved (`paths.data_path`).
    """

    task: str = "math"
    train_files: tuple[str, ...] = ()
    prompts_per_step: int = 8
    max_prompt_len: int = 512
    chat_template: bool = True
    arith_digits: int = 2
    arith_ops: str = "+-"
    chain: ChainConfig = ChainConfig()
    split_seed: int = -1
    prompt_key: str = ""
    answer_key: str = ""
    prompt_suffix: str = PROMPT_SUFFIX

    @classmethod
    def from_config(cls, data: ml_collections.ConfigDict) -> DataSettings:
        return cls(task=data.task, train_files=tuple(map(data_path, data.train_files)),
                   prompts_per_step=data.prompts_per_step, max_prompt_len=data.max_prompt_len,
                   chat_template=data.chat_template, arith_digits=data.arith_digits,
                   arith_ops=data.arith_ops, chain=chain_config(data), split_seed=data.split_seed,
                   prompt_key=data.prompt_key, answer_key=data.answer_key,
                   prompt_suffix=data.prompt_suffix)

    @property
    def arithmetic(self) -> ArithmeticConfig:
        """The arithmetic task's `ArithmeticConfig`."""
        return ArithmeticConfig(max_digits=self.arith_digits, operators=tuple(self.arith_ops))

    def split_seed_of(self, seed: int) -> int:
        """The seed of the synthetic split in a run seeded with `seed`."""
        return seed if self.split_seed < 0 else self.split_seed


@dataclasses.dataclass(frozen=True)
class RewardSettings:
    """The math verifier (`reward`): `workers` threads, `timeout_s` per response, and the weight
    of the format term in the reward."""

    workers: int = 4
    timeout_s: float = 5.0
    format_weight: float = 0.0
    function: str = ""  # your own reward, 'module.path:name' ('' = the task's verifier)

    @classmethod
    def from_config(cls, reward: ml_collections.ConfigDict) -> RewardSettings:
        return cls(workers=reward.workers, timeout_s=reward.timeout_s,
                   format_weight=reward.format_weight, function=reward.function)


@dataclasses.dataclass(frozen=True)
class SftSettings:
    """The tiny model's supervised warm start (`sft`): `steps` (0 = none) at `learning_rate` on
    batches of `batch_size`; the noisy teacher's `format_noise` (arithmetic) and the buggy
    teacher's `bug_rate` (chain)."""

    steps: int = 0
    learning_rate: float = 3e-3
    batch_size: int = 64
    format_noise: float = 0.0
    bug_rate: float = 0.0

    @classmethod
    def from_config(cls, sft: ml_collections.ConfigDict) -> SftSettings:
        return _copy_fields(cls, sft)


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """The rollout actor (`rollout`): its quantization `precision` (a `quant.RECIPES` name), `n`
    samples per prompt of at most `max_new_tokens` at `temperature`, and the `sampler` that draws
    them (continuous batching, concurrent rows, KV policy, paged KV pool)."""

    precision: str = "int8"
    n: int = 8
    max_new_tokens: int = 1024
    temperature: float = 1.0
    sampler: RolloutSamplerSettings = RolloutSamplerSettings(rows_per_step=8 * 8)  # data's 8
    tensor: str = "auto"  # the rollout replicas' tensor degree (`qurl_jax.parallel.rollout_layout`)
    reshard_bucket_mib: int = 1024  # per device per reshard program (0 = the whole actor)
    quantize_vocab: bool = True  # embedding and LM head as int8 codes (`quant.Recipe`)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    behav_logp: str = "sampled"  # which log-prob of a sampled token is pi_behav
    invariant_scaling: float = 1.0  # QuRL's s (1.0 = off), applied once before the first step
    invariant_scaling_targets: tuple[str, ...] = ("qkv",)

    @property
    def recipe(self) -> quant.Recipe:
        """The rollout actor's `quant.Recipe`: `precision`'s, with `quantize_vocab`."""
        return quant.get_recipe(self.precision, quantize_vocab=self.quantize_vocab)

    def sampling(self, eos_ids: Sequence[int]) -> SamplingParams:
        """The rollout's `SamplingParams` with the task's EOS ids."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              top_k=self.top_k, top_p=self.top_p, eos_ids=tuple(eos_ids),
                              behav_logp=self.behav_logp)

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> RolloutSettings:
        """Of the whole config: the sampler's rows per step are `data.prompts_per_step * n`."""
        r = c.rollout
        return cls(precision=r.precision, n=r.n, max_new_tokens=r.max_new_tokens,
                   temperature=r.temperature, sampler=rollout_sampler_settings(c),
                   tensor=str(r.get("tensor", "auto")),
                   reshard_bucket_mib=int(r.get("reshard_bucket_mib", 1024)),
                   quantize_vocab=bool(r.get("quantize_vocab", True)), top_k=r.top_k,
                   top_p=r.top_p, behav_logp=r.behav_logp,
                   invariant_scaling=r.invariant_scaling,
                   invariant_scaling_targets=tuple(r.invariant_scaling_targets))


SHARE_PROMPTS = ("auto", "on", "off")  # train.share_prompts


def share_prompts_blockers(c: ml_collections.ConfigDict) -> list[str]:
    """Why the learner cannot share each group's prompt (`train.share_prompts`): the settings it
    needs, as they would have to be; empty when it can."""
    from qurl_jax.learner import packed_plan
    from qurl_jax.models.attention import AUTO_BLOCKWISE_MIN_KEYS

    out = [f"config.{field}={wanted!r} (it is {value!r})" for field, value, wanted in (
        ("train.packing", c.train.packing, True), ("rl.num_minibatches", c.rl.num_minibatches, 1),
        ("train.precision", c.train.precision, "fp"),
        # exact numerics: the learner attends as the rollout's cached decode does, whole rows
        ("train.on_policy_numerics", c.train.on_policy_numerics, "default")) if value != wanted]
    if c.rollout.n < 2:
        out.append(f"config.rollout.n > 1 (it is {c.rollout.n}: no prompt to share)")
    try:
        length = packed_plan.pack_length(c.train.pack_length,
                                         c.data.max_prompt_len + c.rollout.max_new_tokens)
    except ValueError:
        length = 0  # check_packing names it
    if length > AUTO_BLOCKWISE_MIN_KEYS:
        out.append(f"packed rows (config.train.pack_length) of at most "
                   f"{AUTO_BLOCKWISE_MIN_KEYS} tokens for dense attention (they are {length})")
    return out


def shares_prompts(c: ml_collections.ConfigDict) -> bool:
    """Whether the learner shares each group's prompt: `train.share_prompts` 'on', or 'auto'
    with nothing in the way (`share_prompts_blockers`)."""
    return c.train.share_prompts == "on" or (c.train.share_prompts == "auto"
                                             and not share_prompts_blockers(c))


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The learner: its `objective` and `optim`, the rollout batch cut into `num_minibatches`
    optimizer steps of `num_micro_batches` accumulated micro-batches (`rl`), and its memory and
    precision knobs (`train`: remat, scan_layers, logprob_chunk, precision, cpu_dots,
    on_policy_numerics: the `ModelConfig.numerics` of the learner and the rollout)."""

    objective: ObjectiveConfig = ObjectiveConfig()
    optim: OptimConfig = OptimConfig()
    num_minibatches: int = 1
    num_micro_batches: int = 1
    remat: str = "none"
    scan_layers: bool = False
    logprob_chunk: int = 512
    precision: str = "fp"
    packing: bool = True
    pack_length: int = 0
    tokens_per_micro_batch: int = 0
    pack_buckets: int = PER_DOUBLING
    cpu_dots: str = "auto"
    on_policy_numerics: str = "default"
    share_prompts: int = 1  # sequences per shared prompt in the learner (`train.share_prompts`)

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> TrainSettings:
        """Of the whole config (its `rl`, `optim` and `train` sections)."""
        return cls(objective=objective_from_config(c.rl), optim=optim_from_config(c.optim),
                   num_minibatches=c.rl.num_minibatches, num_micro_batches=c.rl.num_micro_batches,
                   remat=c.train.remat, scan_layers=c.train.scan_layers,
                   logprob_chunk=c.train.logprob_chunk, precision=c.train.precision,
                   packing=c.train.packing, pack_length=c.train.pack_length,
                   tokens_per_micro_batch=c.train.tokens_per_micro_batch,
                   pack_buckets=c.train.pack_buckets, cpu_dots=c.train.cpu_dots,
                   on_policy_numerics=c.train.on_policy_numerics,
                   share_prompts=c.rollout.n if shares_prompts(c) else 1)

    def micro_batch_rows(self, rollout_rows: int) -> int:
        """Rows of one micro-batch of a rollout batch of `rollout_rows`."""
        return rollout_rows // (self.num_minibatches * self.num_micro_batches)

    def learner(self, model_config: ModelConfig, mesh: Mesh, *, temperature: float,
                rollout_rows: int, update_capture: Any = None,
                lora: LoraConfig | None = None) -> Learner:
        """The `Learner` of these settings for a rollout batch of `rollout_rows` sampled at
        `temperature` (its log-probs are computed in slices of one micro-batch); with
        `update_capture` (a rollout recipe) its update reports `quant.update_capture`; with an
        enabled `lora` it trains that adapter on a frozen base."""
        return Learner(model_config, self.objective, self.optim, mesh, temperature=temperature,
                       num_micro_batches=self.num_micro_batches, remat=self.remat,
                       scan_layers=self.scan_layers, logprob_chunk=self.logprob_chunk,
                       logprob_batch_size=self.micro_batch_rows(rollout_rows),
                       precision=self.precision, packing=self.packing,
                       pack_length=self.pack_length,
                       tokens_per_micro_batch=self.tokens_per_micro_batch,
                       pack_buckets=self.pack_buckets, update_capture=update_capture,
                       cpu_dots=self.cpu_dots, share_prompts=self.share_prompts,
                       lora=lora if lora is not None and lora.enabled else None)


@dataclasses.dataclass(frozen=True)
class MeshSizes:
    """Devices per mesh axis within one slice (`mesh`; -1: the devices the others leave)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    dcn: tuple[int, int, int] = (1, 1, 1)  # slices per axis (data, fsdp, tensor) across DCN

    @classmethod
    def from_config(cls, mesh: ml_collections.ConfigDict) -> MeshSizes:
        dcn = mesh.get("dcn") or {}
        return cls(data=mesh.data, fsdp=mesh.fsdp, tensor=mesh.tensor,
                   dcn=tuple(int(dcn.get(a, 1)) for a in ("data", "fsdp", "tensor")))

    @property
    def spec(self) -> dict[str, Any]:
        """The `mesh` section as `sharding.mesh_from_config` takes it."""
        return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
                "dcn": dict(zip(("data", "fsdp", "tensor"), self.dcn, strict=True))}

    @classmethod
    def of(cls, mesh: Mesh) -> MeshSizes:
        """The total sizes of a built mesh's axes (-1 resolved, slices folded in)."""
        return cls(**{axis: int(size) for axis, size in mesh.shape.items()})


@dataclasses.dataclass(frozen=True)
class RLSettings:
    """The RL algorithm around the objective (`rl`): the `advantage` estimator, `ppo_epochs` passes
    of `TrainSettings.num_minibatches` optimizer steps, DAPO's dynamic sampling (`dynamic_sampling`,
    `max_gen_batches` rounds, groups compared on `filter_metric`) and overlong shaping
    (`overlong_buffer` tokens, `overlong_factor`), and the reference policy's `kl_coef`."""

    advantage: str = "grpo"
    ppo_epochs: int = 1
    kl_coef: float = 0.0
    dynamic_sampling: bool = False
    max_gen_batches: int = 3
    filter_metric: str = "accuracy"
    overlong_buffer: int = 0
    overlong_factor: float = 1.0

    @classmethod
    def from_config(cls, rl: ml_collections.ConfigDict) -> RLSettings:
        return _copy_fields(cls, rl)


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """The run around its steps (`train`, `eval.before`): `num_steps`; checkpoints every
    `checkpoint_every` steps, `keep_checkpoints` kept; evaluation before the first step
    (`eval_before`) and every `eval_every`; metric `loggers` (and `wandb_project`); a progress
    bar; the end-of-run speed report and Hugging Face export; `max_bad_steps` non-finite updates
    in a row before stopping; `apply_updates` (False: the control run); the memory preflight
    (`preflight`, `preflight_target`, `memory_limit_gib`); the heap trimmed before every update
    and after every step (`malloc_trim_steps`)."""

    num_steps: int = 100
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0
    eval_before: bool = True
    loggers: tuple[str, ...] = ("tensorboard",)
    wandb_project: str = "qurl_jax"
    progress: bool = True
    report_speed: bool = False
    export_hf: str = ""
    max_bad_steps: int = 3
    apply_updates: bool = True
    preflight: str = "auto"
    preflight_target: str = ""
    memory_limit_gib: float = 0.0
    malloc_trim_steps: bool = False

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> LoopSettings:
        """Of the whole config (its `train` section and `eval.before`)."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"eval_before"}
        return cls(eval_before=c.eval.before,
                   **{name: tuple(v) if isinstance(v := c.train[name], list | tuple) else v
                      for name in fields})


@dataclasses.dataclass(frozen=True)
class RunSettings:
    """The typed sections of one run's config, converted once (`from_config`)."""

    seed: int = 0
    model: ModelSettings = ModelSettings()
    data: DataSettings = DataSettings()
    reward: RewardSettings = RewardSettings()
    sft: SftSettings = SftSettings()
    eval: EvalSettings = EvalSettings()
    rollout: RolloutSettings = RolloutSettings()
    train: TrainSettings = TrainSettings()
    rl: RLSettings = RLSettings()
    loop: LoopSettings = LoopSettings()
    mesh: MeshSizes = MeshSizes()

    @property
    def rollout_rows(self) -> int:
        """Rows of one step's rollout batch: prompts per step x samples per prompt."""
        return self.data.prompts_per_step * self.rollout.n

    @property
    def prox(self) -> ProxSource:
        """Where pi_prox comes from (`learner.prox.prox_source`): a separate log-prob pass, or
        the update's own forward."""
        return prox_source(num_minibatches=self.train.num_minibatches,
                           ppo_epochs=self.rl.ppo_epochs, precision=self.train.precision)

    @property
    def capture_in_update(self) -> bool:
        """Whether the update program computes the quantized actor's update capture
        (`quant.update_capture`) itself: with one optimizer step per RL step that applies, the
        parameters before and after it are the step's, so no copy of the old parameters is
        kept beside the update (else the trainer keeps one and compares after the step)."""
        return (self.rollout.recipe.quantizes and self.loop.apply_updates
                and self.train.num_minibatches * self.rl.ppo_epochs == 1
                and not self.model.lora.enabled)

    @property
    def update_capture(self) -> Any:
        """The rollout recipe the learner's update reports `quant.update_capture` of, or None
        (`capture_in_update`)."""
        return self.rollout.recipe if self.capture_in_update else None

    @property
    def learner_logprobs(self) -> bool:
        """Whether a step runs `Learner.logprobs` at all: for pi_prox (`prox`) or for the
        reference policy of `rl.kl_coef` > 0."""
        return self.prox.recompute or bool(self.rl.kl_coef)

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> RunSettings:
        """The settings of a validated config (`config.validate`); checks nothing itself."""
        return cls(seed=c.seed, model=ModelSettings.from_config(c.model),
                   data=DataSettings.from_config(c.data),
                   reward=RewardSettings.from_config(c.reward),
                   sft=SftSettings.from_config(c.sft), eval=eval_settings(c),
                   rollout=RolloutSettings.from_config(c), train=TrainSettings.from_config(c),
                   rl=RLSettings.from_config(c.rl), loop=LoopSettings.from_config(c),
                   mesh=MeshSizes.from_config(c.mesh))
