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

import ml_collections
from jax.sharding import Mesh

from qurl_jax import quant
from qurl_jax.config.base import (
    EvalSettings,
    chain_config,
    eval_settings,
    objective_from_config,
    optim_from_config,
    rollout_sampler_settings,
)
from qurl_jax.data.arithmetic import ArithmeticConfig
from qurl_jax.data.chains import ChainConfig
from qurl_jax.data.datasets import PROMPT_SUFFIX
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig
from qurl_jax.rl.objectives import ObjectiveConfig
from qurl_jax.runtime.paths import data_path
from qurl_jax.sampling.factory import RolloutSamplerSettings


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
        return cls(**{f.name: tiny[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class ModelSettings:
    """Which policy to train (`model`).

    source: 'hf' loads the Hugging Face directory `path`; 'gguf' the llama.cpp file `path`;
    'tiny' builds `tiny` in code.
    dtype: compute dtype (master weights are float32). attention: the attention implementation.
    """

    source: str = "hf"
    path: str = ""
    dtype: str = "float32"
    attention: str = "auto"
    tiny: TinyShape = TinyShape()

    @classmethod
    def from_config(cls, model: ml_collections.ConfigDict) -> ModelSettings:
        return cls(source=model.source, path=model.path, dtype=model.dtype,
                   attention=model.attention, tiny=TinyShape.from_config(model.tiny))


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
        return cls(**{f.name: sft[f.name] for f in dataclasses.fields(cls)})


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

    @property
    def recipe(self) -> quant.Recipe:
        """The rollout actor's `quant.Recipe`: `precision`'s, with `quantize_vocab`."""
        return quant.get_recipe(self.precision, quantize_vocab=self.quantize_vocab)

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> RolloutSettings:
        """Of the whole config: the sampler's rows per step are `data.prompts_per_step * n`."""
        r = c.rollout
        return cls(precision=r.precision, n=r.n, max_new_tokens=r.max_new_tokens,
                   temperature=r.temperature, sampler=rollout_sampler_settings(c),
                   tensor=str(r.get("tensor", "auto")),
                   reshard_bucket_mib=int(r.get("reshard_bucket_mib", 1024)),
                   quantize_vocab=bool(r.get("quantize_vocab", True)))


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """The learner: its `objective` and `optim`, the rollout batch cut into `num_minibatches`
    optimizer steps of `num_micro_batches` accumulated micro-batches (`rl`), and its memory and
    precision knobs (`train`: remat, scan_layers, logprob_chunk, precision)."""

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

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> TrainSettings:
        """Of the whole config (its `rl`, `optim` and `train` sections)."""
        return cls(objective=objective_from_config(c.rl), optim=optim_from_config(c.optim),
                   num_minibatches=c.rl.num_minibatches, num_micro_batches=c.rl.num_micro_batches,
                   remat=c.train.remat, scan_layers=c.train.scan_layers,
                   logprob_chunk=c.train.logprob_chunk, precision=c.train.precision,
                   packing=c.train.packing, pack_length=c.train.pack_length,
                   tokens_per_micro_batch=c.train.tokens_per_micro_batch)

    def micro_batch_rows(self, rollout_rows: int) -> int:
        """Rows of one micro-batch of a rollout batch of `rollout_rows`."""
        return rollout_rows // (self.num_minibatches * self.num_micro_batches)

    def learner(self, model_config: ModelConfig, mesh: Mesh, *, temperature: float,
                rollout_rows: int) -> Learner:
        """The `Learner` of these settings for a rollout batch of `rollout_rows` sampled at
        `temperature` (its log-probs are computed in slices of one micro-batch)."""
        return Learner(model_config, self.objective, self.optim, mesh, temperature=temperature,
                       num_micro_batches=self.num_micro_batches, remat=self.remat,
                       scan_layers=self.scan_layers, logprob_chunk=self.logprob_chunk,
                       logprob_batch_size=self.micro_batch_rows(rollout_rows),
                       precision=self.precision, packing=self.packing,
                       pack_length=self.pack_length,
                       tokens_per_micro_batch=self.tokens_per_micro_batch)


@dataclasses.dataclass(frozen=True)
class MeshSizes:
    """Devices per mesh axis within one slice (`mesh`; -1: the devices the others leave)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @classmethod
    def from_config(cls, mesh: ml_collections.ConfigDict) -> MeshSizes:
        return cls(data=mesh.data, fsdp=mesh.fsdp, tensor=mesh.tensor)

    @classmethod
    def of(cls, mesh: Mesh) -> MeshSizes:
        """The total sizes of a built mesh's axes (-1 resolved, slices folded in)."""
        return cls(**{axis: int(size) for axis, size in mesh.shape.items()})


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
    mesh: MeshSizes = MeshSizes()

    @property
    def rollout_rows(self) -> int:
        """Rows of one step's rollout batch: prompts per step x samples per prompt."""
        return self.data.prompts_per_step * self.rollout.n

    @classmethod
    def from_config(cls, c: ml_collections.ConfigDict) -> RunSettings:
        """The settings of a validated config (`config.validate`); checks nothing itself."""
        return cls(seed=c.seed, model=ModelSettings.from_config(c.model),
                   data=DataSettings.from_config(c.data),
                   reward=RewardSettings.from_config(c.reward),
                   sft=SftSettings.from_config(c.sft), eval=eval_settings(c),
                   rollout=RolloutSettings.from_config(c), train=TrainSettings.from_config(c),
                   mesh=MeshSizes.from_config(c.mesh))
