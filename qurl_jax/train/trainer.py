"""The RL trainer: one step reads like QuRL's algorithm.

    params --requantize--> codes on the learner's FSDP layout --reshard--> rollout_params on the
           rollout's replicas (parallel.rollout_layout) --sample(n per prompt)--> tokens, logp_behav
           --verify--> rewards, accuracy --group--> advantages
           (DAPO: drop groups whose accuracy is all equal, regenerate from more rounds)
           --learner forward (fp32, packed rows)--> logp_prox (and logp_ref for the KL); with one
             optimizer step per RL step, logp_prox is the update's own forward instead
             (`qurl_jax.learner.prox`)
           --policy_loss(acr | tis | ...) x minibatches--> AdamW update of params

Invariant scaling (QuRL's UAQ) is applied once to the learner's parameters before the first step;
the rollout actor is re-quantized from the full-precision learner every step. With LoRA
(`model.lora`) the base is quantized once instead, the rollout and the learner read the same base
arrays, and only the adapter is trained, moved to the rollout (its fingerprint checked against the
learner's) and checkpointed. `Trainer(config, workdir).train()` is the whole run and is what
`python -m qurl_jax.main` calls (it ends by writing the run's plots to `<workdir>/plots/`,
`qurl_jax.runtime.report`); other JAX code can drive `Trainer.step()` itself. State (params,
optimizer, step, data position, seed) is checkpointed with orbax every `train.checkpoint_every`
steps and a workdir with a checkpoint resumes from it; a checkpoint of another model or optimizer
stops the run before anything is written.

Random streams: every key of a run comes from `stream_key(seed, purpose, step, index)`, which
folds a distinct tag per purpose (rollout round, minibatch permutation, evaluation, speed check),
then the step, then an index (the round or epoch) into `key(seed)`; no two purposes, steps or
rounds share a key, and no stream of one seed is a stream of another.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax import lora, quant
from qurl_jax.config import run_config
from qurl_jax.config.base import resolve
from qurl_jax.cpu_kernels import decode_attention as cpu_attention
from qurl_jax.data import reward_hook
from qurl_jax.learner import packing
from qurl_jax.lora import peft
from qurl_jax.models import init_params, param_logical_axes, positions_from_mask
from qurl_jax.parallel import distributed as dist
from qurl_jax.parallel import rollout_layout, targets
from qurl_jax.parallel import sharding as shd
from qurl_jax.plan import memory_plan
from qurl_jax.plan.rollout_speed import compare_rollout_speed
from qurl_jax.rl import advantages as adv_lib
from qurl_jax.rl import objectives
from qurl_jax.runtime import compilation, malloc, report, sizes, xla_cpu
from qurl_jax.runtime.checkpoint import Checkpointer
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.runtime.metrics import (
    MetricWriter,
    PhaseTimer,
    eval_at,
    local_abspath,
    read_metrics,
    rollout_share,
    to_floats,
)
from qurl_jax.runtime.progress import clock
from qurl_jax.sampling import SamplingParams
from qurl_jax.sampling.factory import build_eval_sampler, build_rollout_sampler
from qurl_jax.train.preemption import PreemptionGuard
from qurl_jax.train.rollout import Rollout, regenerate_groups
from qurl_jax.train.tasks import (
    build_model_and_task,
    check_task_data,
    model_config_for,
    result_line,
)

# Per-step metrics averaged over the run for the end-of-run summary.
SUMMARY_KEYS = ("time/rollout_share", "time/step_s", "rollout/tokens_per_s", "rollout/reward_mean",
                "rollout/logp_truncation_gap", "kl_behav_prox_k1", "kl_behav_prox_k3",
                "logp_gap_abs_mean", "raw_is_weight_max", "truncated_frac", "clipfrac_upper",
                "clipfrac_lower", "quant/code_change_fraction", "quant/update_to_step_ratio")

# What a checkpoint's top-level state is, for the message that refuses to resume a LoRA run
# from a full fine-tune's checkpoint and vice versa.
STATE_KINDS = {"params": "a full fine-tune's parameters (model.lora.rank = 0)",
               "adapter": "a LoRA adapter (model.lora.rank > 0)"}

_ADVANTAGES = {"grpo": adv_lib.grpo_advantages, "dr_grpo": adv_lib.dr_grpo_advantages,
               "rloo": adv_lib.rloo_advantages}


class Stream(enum.IntEnum):
    """What a random key is for; each purpose is a distinct tag folded into the run's root key."""

    ROLLOUT = 1  # index: the generation round of the step (0, then DAPO's further rounds)
    MINIBATCH = 2  # index: the PPO epoch whose minibatch permutation it draws
    EVAL = 3  # index: unused (the evaluation folds in its own call counter)
    SPEED = 4  # index: unused
    LORA = 5  # step 0, index 0: the LoRA adapter's initialisation


def stream_key(seed: int, purpose: Stream, step: int, index: int = 0) -> jax.Array:
    """The key of `purpose` at `step` (and round/epoch `index`) of the run seeded with `seed`."""
    root = jax.random.key(seed)
    return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(root, int(purpose)), step),
                              index)


class Trainer:
    """Owns the model, the actor's recipe, the sampler, the learner and the run state."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str,
                 reward_fn: Any = None) -> None:
        """`reward_fn`: your own reward function (responses, answers[, prompts]) -> list of
        floats, in place of `reward.function` or the task's verifier (`qurl_jax.data.reward_hook`;
        checked before anything is written)."""
        resolved = resolve(config)  # validated and converted once: nothing below reads `config`
        self._flat_config = resolved.flat  # saved and compared on resume (`run_config`)
        if reward_fn is not None:
            reward_hook.takes_prompts(reward_fn, "reward_fn")
        # The typed sections the code below reads (the tasks, the model, the warm start).
        self.settings = resolved.settings
        self.workdir = local_abspath(workdir)
        s = self.settings
        self.mesh = shd.mesh_from_config(s.mesh.spec)
        # Multi-process runs: this process reads, samples and verifies block `_block` of
        # `_blocks` of every step's prompts (`qurl_jax.parallel.distributed`); GRPO groups stay
        # whole.
        self._block, self._blocks = dist.row_block(self.mesh)
        if s.data.prompts_per_step % self._blocks:
            raise ConfigError(f"config.data.prompts_per_step={s.data.prompts_per_step} must be "
                              f"divisible by the {self._blocks} processes' blocks of the batch")
        self.recipe = self.settings.rollout.recipe
        self.objective = self.settings.train.objective
        numerics = s.train.on_policy_numerics  # `models.exact`: both sides, one setting
        self.model_config = model_config_for(self.settings.model).replace(numerics=numerics)
        # LoRA (`model.lora`): `self.params` is the adapter, trained on the frozen `self.base`.
        self.lora = s.model.lora if s.model.lora.enabled else None
        self._state_key = "adapter" if self.lora else "params"
        self.learner = self.settings.train.learner(self.model_config, self.mesh,
                                                   temperature=s.rollout.temperature,
                                                   rollout_rows=self.settings.rollout_rows,
                                                   update_capture=self.settings.update_capture,
                                                   lora=s.model.lora)
        # pi_prox: a separate log-prob pass, or the update's own forward (`learner.prox`).
        self.prox = self.settings.prox
        logging.info("%s", self.prox.describe())
        if s.train.share_prompts > 1:
            logging.info("learner: each prompt runs once for its %d samples, their responses "
                         "attending to it (train.share_prompts)", s.train.share_prompts)
        if targets.platform_of(self.mesh) == "cpu":
            logging.info("%s", xla_cpu.describe(s.train.cpu_dots))
            int8 = quant.int8_kernel_isa()
            logging.info("CPU kernels (%s=%s): int8 products %s, decode attention %s",
                         xla_cpu.ISA_ENV, xla_cpu.isa_cap(),
                         f"{int8} up to {quant.int8_kernel_rows()} rows" if int8
                         else "off (XLA's)", cpu_attention.kernel_isa() or "off (XLA's)")
        check_task_data(self.settings)  # the data files and prompt lengths, before any write
        for warning in resolved.warnings:
            logging.warning("%s", warning)
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                         interval=s.loop.checkpoint_every,
                                         keep=s.loop.keep_checkpoints, kinds=STATE_KINDS)
        # A changed field that changes the math, or a checkpoint of another model or optimizer,
        # stops the run here, before the warm-start cache, metrics or a checkpoint are written.
        abstract = self._abstract_state()  # also sizes the rollout layout below
        self.checkpointer.check_compatible(abstract)
        if warning := self.checkpointer.check_space(abstract):
            logging.warning("%s", warning)
        if self.checkpointer.steps():
            run_config.check(self._flat_config, self.workdir)
        self._compiled_before = compilation.compile_stats()  # the run's compiles from here on
        # The rollout's own layout: replicas of the quantized actor over the same devices
        # (`qurl_jax.parallel.rollout_layout`); the learner, its log-probs and the optimizer stay on
        # `self.mesh`.
        memory = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
        self.rollout_mesh = rollout_layout.rollout_mesh(self.mesh, rollout_layout.plan_tensor(
            self.settings, self.model_config, self.mesh, self._param_shapes(),
            abstract["opt_state"], memory and int(memory * memory_plan.FIT_FRACTION),
            resident=abstract))
        rollout_layout.check_concurrent_rows(self.settings, self.rollout_mesh,
                                             self.model_config.num_kv_heads)
        self._reshard = rollout_layout.Reshard(
            param_logical_axes(self.model_config), self.rollout_mesh,
            bucket_bytes=self.settings.rollout.reshard_bucket_mib << 20)
        logging.info("rollout layout: %d replicas x rollout.tensor=%d over the learner's %s",
                     self.rollout_mesh.shape["data"], self.rollout_mesh.shape["tensor"],
                     dict(self.mesh.shape))
        self._preflight()
        self.model_config, init_params_, self.task = build_model_and_task(self.settings,
                                                                          self.workdir, reward_fn)
        self.model_config = self.model_config.replace(numerics=numerics)
        engine_kwargs = dict(max_prompt_len=s.data.max_prompt_len,
                             max_new_tokens=max(s.rollout.max_new_tokens, s.eval.max_new_tokens),
                             pad_id=self.task.pad_id, mesh=self.rollout_mesh)
        # Sparse-RL's KV compression applies to the rollout actor only: evaluation samples and
        # the learner's log-probs (logp_prox) stay dense.
        sampler_settings = self.settings.rollout.sampler
        # With LoRA both samplers read the frozen base through the adapters' hook: the rollout
        # with the recipe's product (W8A8 for int8), the evaluation as the learner reads it.
        self.sampler = build_rollout_sampler(
            self.model_config, lora.dot_general(quant.rollout_dot_general) if self.lora
            else quant.make_dot_general(self.recipe), sampler_settings, **engine_kwargs)
        pool = (f", a paged KV pool of {sampler_settings.kv_pages} pages of "
                f"{sampler_settings.kv_page_size} tokens" if sampler_settings.kv_pages else "")
        kv = sampler_settings.kv_precision
        logging.info("rollout sampler: %s, %s concurrent rows%s, %s KV cache%s",
                     type(self.sampler).__name__, s.rollout.sampler.max_concurrent_rows or "all",
                     pool, kv.value if kv.quantizes else  # 'bf16' means the compute dtype
                     f"{jnp.dtype(self.model_config.compute_dtype).name} (the compute dtype)",
                     f" (a scale per {sampler_settings.kv_scale.value})" if kv.quantizes else "")
        self.eval_sampler = build_eval_sampler(
            self.model_config, sampler_settings, s.eval.kv_cache == "rollout", **engine_kwargs,
            **({"dot_general": lora.dot_general(quant.rollout_dot_general)} if self.lora else {}))

        self.base = None
        if self.lora:
            # The frozen base, quantized once and placed once on the rollout's replicas: the
            # rollout samples these arrays and the learner reads the very same ones.
            dtype = self.model_config.compute_dtype
            self.base = jax.block_until_ready(lora.quantize_base(
                init_params_, self.lora, self.recipe, dtype, self._reshard.shardings(
                    lora.base_shapes(init_params_, self.lora, self.recipe, dtype))))
            trained = lora.init_adapter(stream_key(s.seed, Stream.LORA, 0), init_params_,
                                        self.lora)
            del init_params_
            logging.info("LoRA: rank %d, alpha %g on %d projections, %.2fM adapter parameters; "
                         "base frozen in %s (%s rollout)", self.lora.rank, self.lora.alpha,
                         len(lora.target_paths(self.base, self.lora)),
                         sum(x.size for x in jax.tree.leaves(trained)) / 1e6,
                         self.lora.base_precision, self.recipe.name)
        else:
            trained = self._maybe_invariant_scaling(init_params_)
        # The reference policy of the KL term: the initial parameters (LoRA: the initial
        # adapter, b = 0, i.e. the base).
        self.ref_params = self.learner.shard_params(trained) if s.rl.kl_coef else None
        self.params = self.learner.shard_params(trained)
        self.opt_state = self.learner.init_opt_state(self.params)
        self.step_count = 0
        self._restore()
        if dist.is_primary():
            # The resolved config of the run, for inspection and the resume check.
            run_config.save(self._flat_config, self.workdir)
        self.writer = MetricWriter(
            self.workdir, resume_step=self.step_count, enabled=dist.is_primary(),
            tensorboard="tensorboard" in s.loop.loggers,
            wandb_project=s.loop.wandb_project if "wandb" in s.loop.loggers else None)
        self._reward_thread = concurrent.futures.ThreadPoolExecutor(1, "qurl-reward")
        self._bad_steps = 0
        # Set by `python -m qurl_jax.main` (`qurl_jax.runtime.watchdog`,
        # `qurl_jax.parallel.program_check`).
        self.watchdog: Any = None
        self.program_check: Any = None
        # Set by `python -m qurl_jax.main` on process 0 (`qurl_jax.runtime.progress.Heartbeat`):
        # told what the run is doing, it logs a line when nothing else was logged for 50 s.
        self.heartbeat: Any = None
        self._evaluations: list[float] = []  # seconds of this process's evaluations
        self.last_metrics: dict[str, float] = {}

    @property
    def sampling(self) -> SamplingParams:
        """The rollout's sampling settings (`settings.rollout`) with the task's EOS ids."""
        return self.settings.rollout.sampling(self.task.eos_ids)

    # ------------------------------------------------------------------------------------ set-up
    def _param_shapes(self) -> Any:
        """The model's parameters as `jax.ShapeDtypeStruct`s (nothing built or loaded)."""
        return jax.eval_shape(lambda: init_params(self.model_config, jax.random.key(0)))

    def _abstract_state(self) -> dict[str, Any]:
        """Shapes and dtypes of the checkpointed state, without building or loading weights:
        the parameters and optimizer state, or with LoRA the adapter and its optimizer state
        (the base is read from its source)."""
        shapes = self._param_shapes()
        if self.lora:
            shapes = lora.adapter_shapes(shapes, self.lora)
        params, opt_state = self.learner.abstract_state(shapes)
        return {self._state_key: params, "opt_state": opt_state}

    def _preflight(self) -> None:
        """Compiles the run's programs and stops (`memory_plan.MemoryPlanError`, naming the
        knobs) if one needs more memory per device than the device has; before anything is
        written. With `train.preflight_target` they are compiled for that target's devices (its
        chip's compiler; the limit is `memory_plan.FIT_FRACTION` of its memory), else for the
        run's own mesh."""
        s = self.settings
        target = targets.parse(s.loop.preflight_target) if s.loop.preflight_target else None
        platform = target.platform if target else targets.platform_of(self.mesh)
        if s.loop.preflight == "off" or (s.loop.preflight == "auto" and platform == "cpu"):
            return
        limit = int(s.loop.memory_limit_gib * memory_plan.GIB)
        if target is not None:
            setup = memory_plan.build_setup(self.settings, self.model_config, target.devices())
            limit = limit or memory_plan.budget_bytes(target)
        else:
            setup = memory_plan.setup_for(self.settings, self.model_config, self.mesh,
                                          self.learner)
            limit = limit or (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit", 0)
        if not limit:
            raise ValueError("config.train.memory_limit_gib: the device reports no memory limit; "
                             "set one for train.preflight")
        memory_plan.preflight(setup, limit, log=logging.info)

    def _maybe_invariant_scaling(self, params: Any) -> Any:
        s = self.settings.rollout.invariant_scaling
        if s == 1.0:
            return params
        targets = tuple(self.settings.rollout.invariant_scaling_targets)
        logging.info("invariant scaling s=%.3g on %s", s, targets)
        return quant.invariant_scaling(params, s=s, targets=targets)

    def _restore(self) -> None:
        restored = self.checkpointer.restore_latest(
            {self._state_key: self.params, "opt_state": self.opt_state})
        if restored is None:
            return
        step, state, meta = restored
        self.params, self.opt_state = state[self._state_key], state["opt_state"]
        self.step_count = step
        self.task.restore(meta["data"])
        logging.info("resumed from step %d in %s", step, self.checkpointer.directory)

    def _save(self, force: bool = False) -> None:
        self.checkpointer.save(
            self.step_count, {self._state_key: self.params, "opt_state": self.opt_state},
            {"step": self.step_count, "data": self.task.state(), "seed": self.settings.seed},
            force=force)

    def key(self, purpose: Stream, index: int = 0) -> jax.Array:
        """This step's key for `purpose` (see `stream_key`)."""
        return stream_key(self.settings.seed, purpose, self.step_count, index)

    # ------------------------------------------------------------------------------------ rollout
    def _rollout(self, rollout_params: Any, round_: int, timer: PhaseTimer) -> Rollout:
        """Samples the next prompts (generation round `round_` of this step); the verifier starts
        on the reward thread, so the rewards are pending when this returns."""
        s, sampling = self.settings, self.sampling
        prompts, answers = self.task.next_prompts(s.data.prompts_per_step,
                                                  shard=(self._block, self._blocks))
        with timer.phase("rollout"):
            out = self.sampler.sample(rollout_params, prompts, sampling,
                                      key=self.key(Stream.ROLLOUT, round_), n=s.rollout.n,
                                      process_local=self._blocks > 1)
            out = jax.device_get(out)
        texts = self.task.decode(out.tokens, out.mask)
        pending = self._reward_thread.submit(
            self.task.rewards, texts, [a for a in answers for _ in range(s.rollout.n)])
        return Rollout.from_sample(out, sampling, pending)

    def _shaped_rewards(self, r: Rollout) -> np.ndarray:
        """f32[N] rewards plus DAPO's overlong penalty (when rl.overlong_buffer > 0)."""
        s = self.settings
        if s.rl.overlong_buffer <= 0:
            return r.rewards
        penalty = adv_lib.overlong_penalty(jnp.asarray(r.lengths), s.rollout.max_new_tokens,
                                           s.rl.overlong_buffer, s.rl.overlong_factor)
        return r.rewards + np.asarray(penalty, np.float32)

    def _groups_to_keep(self, r: Rollout) -> np.ndarray:
        """bool[B]: groups whose `rl.filter_metric` is not all equal (a resolved rollout)."""
        n = self.settings.rollout.n
        values = r.accuracy if self.settings.rl.filter_metric == "accuracy" else \
            self._shaped_rewards(r)
        return np.array(adv_lib.groups_to_keep(jnp.asarray(values), group_size=n))[::n]

    def collect(self, rollout_params: Any, timer: PhaseTimer) -> tuple[Rollout, dict[str, float]]:
        """Samples one batch; with DAPO dynamic sampling, replaces groups whose accuracy (or
        reward, `rl.filter_metric`) is all equal by kept groups of further rounds.

        Without dynamic sampling the rewards are still being verified when this returns
        (`Rollout.pending`). Groups still all-equal after `max_gen_batches` generation rounds stay
        in the batch with a zero loss mask, so shapes stay static and they add nothing.

        In a multi-process run each process regenerates its own groups, and every process runs as
        many rounds as the one that needs the most (the rounds are collective); the statistics
        are over all processes' rows.
        """
        s = self.settings
        n = s.rollout.n
        r = self._rollout(rollout_params, 0, timer)
        generated = [r]
        keep = None
        if s.rl.dynamic_sampling:
            with timer.phase("reward"):
                r.resolve()
            keep = self._groups_to_keep(r)
            while len(generated) < s.rl.max_gen_batches and \
                    dist.host_sums({"dropped": float((~keep).sum())})["dropped"]:
                extra = self._rollout(rollout_params, len(generated), timer)
                generated.append(extra)
                with timer.phase("reward"):
                    extra.resolve()
                r, keep = regenerate_groups(r, keep, extra, self._groups_to_keep(extra), n)
        sums = dist.host_sums({
            "rows": float(r.size), "tokens": float(r.lengths.sum()),
            "generated": float(sum(g.lengths.sum() for g in generated)),
            "sampled": sum(float(g.resp_mask.sum()) for g in generated),
            "gap": sum(float(g.logp_truncation_gap.sum()) for g in generated),
            "groups": float(r.size // n), "kept": float(0 if keep is None else keep.sum())})
        stats = {"rollout/response_len": sums["tokens"] / sums["rows"],
                 "rollout/tokens": sums["tokens"],
                 "rollout/generated_tokens": sums["generated"],
                 "rollout/logp_truncation_gap": sums["gap"] / max(sums["sampled"], 1.0),
                 "rollout/kv_bytes_per_row": float(self.sampler.engine.kv_bytes_per_row(
                     r.tokens.shape[1] - s.rollout.max_new_tokens, s.rollout.max_new_tokens))}
        if keep is not None:
            r.resp_mask = r.resp_mask * np.repeat(keep, n)[:, None].astype(np.float32)
            stats.update({"rollout/gen_batches": float(len(generated)),
                          "rollout/kept_group_frac": sums["kept"] / sums["groups"]})
        return r, stats

    # --------------------------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics (already written to metrics.jsonl)."""
        timer = PhaseTimer(self.watchdog, _StepPhases(self.heartbeat, self.step_count + 1))
        compiled_before = compilation.compile_stats()
        if self.lora:
            with timer.phase("reshard"):  # the adapter to the rollout's replicas; nothing else
                adapter = jax.block_until_ready(self._adapter_on_rollout(self.params))
            r, metrics = self.collect(lora.attach(self.base, adapter, self.lora.scale), timer)
            self._check_rollout_adapter(adapter)
            metrics["reshard/bytes_per_device"] = float(
                sizes.tree_bytes_per_device(adapter))
            del adapter
        else:
            with timer.phase("requantize"):
                actor = jax.block_until_ready(quant.requantize(
                    self.params, self.recipe, compute_dtype=self.model_config.compute_dtype))
            with timer.phase("reshard"):  # codes and scales to the rollout's replicas
                rollout_params = jax.block_until_ready(self._reshard(actor))
            moved = self._reshard.bytes(actor)
            del actor
            r, metrics = self.collect(rollout_params, timer)
            metrics.update({"reshard/bytes_per_device": float(moved.received),
                            "reshard/bytes_per_quantized_param": moved.per_quantized_parameter})
        batch = self._learner_batch(r)
        plan = self._minibatch_plan(batch)
        # The rows the pi_prox pass covers: all, or (`prox.skip_first`) all but the first
        # update's, which take pi_prox from that update's own forward (`learner.prox`).
        prox_rows = None
        if self.prox.skip_first:
            prox_rows = np.setdiff1d(np.arange(batch["tokens"].shape[0]), plan[0])
        if self.prox.recompute or self.ref_params is not None:
            with timer.phase("logp_recompute"):
                if self.prox.recompute:  # else the update's own forward gives pi_prox
                    part = batch if prox_rows is None else self.learner.shard_batch(
                        {k: v[prox_rows] for k, v in batch.items()})
                    batch["logp_prox"] = self.learner.logprobs(self.params, part, self.base)
                if self.ref_params is not None:
                    batch["logp_ref"] = self.learner.logprobs(self.ref_params, batch,
                                                              self.base)
                jax.block_until_ready(batch)
        if self.prox.recompute and self.objective.mode == objectives.Mode.SPARSE_RL:
            # Counts of the recomputed rows (the first update adds its rows' counts when it
            # takes them from its forward: `_update`).
            rows = slice(None) if prox_rows is None else prox_rows
            rejected = objectives.sparse_rl_rejections(
                batch["logp_prox"], batch["logp_behav"][rows], batch["resp_mask"][rows],
                self.objective)
            metrics.update({f"sparse/{k}": float(v) for k, v in rejected.items()})
        with timer.phase("reward"):  # only the part the recomputation did not hide
            r.resolve()
        advantages = self._advantages(self._shaped_rewards(r))
        batch.update(dist.global_batch(self.mesh, {"advantages": advantages}))
        # The update donates the parameter buffers, so the diagnostic keeps its own copy,
        # unless the update program reports it (`RunSettings.capture_in_update`).
        old_params = (jax.tree.map(jnp.copy, self.params) if self.recipe.quantizes
                      and not self.lora and self.learner.update_capture is None else None)
        if self.settings.loop.malloc_trim_steps:  # what the rollout freed, out of the update's way
            malloc.trim()
        with timer.phase("update"):
            for k, v in self._update(batch, plan, prox_rows).items():
                metrics[k] = metrics.get(k, 0.0) + v if k.startswith("sparse/") else v
        if old_params is not None:
            capture = quant.update_capture(old_params, self.params, self.recipe)
            metrics.update({f"quant/{k}": float(v) for k, v in capture.items()})
        metrics.update(self._step_metrics(r, timer, metrics))
        metrics.update(self.learner.last_pack)  # packed rows and real-token share, if packing
        # Programs compiled (or loaded from the persistent cache) in this step: after the first
        # step, a new one means a shape or setting changed.
        metrics.update(compilation.compile_stats().since(compiled_before).metrics())
        self.step_count += 1
        self.writer.write(self.step_count, metrics)
        self.last_metrics = metrics
        return metrics

    def _adapter_on_rollout(self, adapter: Any) -> Any:
        """The LoRA adapter replicated on the rollout's replicas (what a step reshards)."""
        return jax.device_put(adapter, NamedSharding(self.rollout_mesh, PartitionSpec()))

    def _check_rollout_adapter(self, adapter: Any) -> None:
        """Stops the run when the adapter the rollout sampled with is not the learner's of this
        step (`lora.fingerprint`): a rollout that silently kept sampling an older policy (the
        failure TRL / verl / ms-swift users met) must not reach the update."""
        if not np.array_equal(lora.fingerprint(adapter), lora.fingerprint(self.params)):
            raise RuntimeError(f"step {self.step_count + 1}: the rollout sampled with a LoRA "
                               "adapter that is not the learner's of this step; stopping before "
                               "the update")

    def _step_metrics(self, r: Rollout, timer: PhaseTimer, metrics: dict[str, float]
                      ) -> dict[str, float]:
        # Over every process's rows (and verifier).
        verifier = {f"verifier/{k}": float(v) for k, v in self.task.verifier_stats().items()
                    if k != "calls"}
        sums = dist.host_sums({"rows": float(r.size), "reward": float(r.rewards.sum()),
                               "accuracy": float(r.accuracy.sum()), **verifier})
        out = {"rollout/reward_mean": sums["reward"] / sums["rows"],
               "rollout/accuracy": sums["accuracy"] / sums["rows"]}
        out.update({k: sums[k] for k in verifier})
        out.update(timer.metrics())
        out["time/rollout_share"] = timer.seconds["rollout"] / max(sum(timer.seconds.values()),
                                                                   1e-9)
        # Every round's tokens over every round's time (DAPO's further rounds included).
        out["rollout/tokens_per_s"] = metrics["rollout/generated_tokens"] / max(
            timer.seconds["rollout"], 1e-9)
        return out

    def _advantages(self, rewards: np.ndarray) -> np.ndarray:
        estimator = _ADVANTAGES[self.settings.rl.advantage]
        return np.asarray(estimator(jnp.asarray(rewards), group_size=self.settings.rollout.n))

    def _learner_batch(self, r: Rollout) -> dict[str, jax.Array]:
        """The learner's inputs except the advantages (those wait for the verifier)."""
        positions = positions_from_mask(r.attn_mask)
        batch = {"tokens": r.tokens, "positions": positions, "attn_mask": r.attn_mask,
                 "resp_mask": r.resp_mask, "logp_behav": r.logp_behav}
        # This process's rows; the global batch is every process's rows in block order.
        return dist.global_batch(self.mesh, batch)

    def _minibatch_plan(self, batch: dict[str, jax.Array]) -> list[np.ndarray | None]:
        """The rows of every optimizer step of the RL step, in order: `rl.ppo_epochs` passes of
        `rl.num_minibatches` minibatches, each epoch a permutation of the batch (None: the whole
        batch, one minibatch). Drawn before the first update, so the pi_prox pass knows which
        rows the first update covers."""
        s = self.settings
        size = batch["tokens"].shape[0]
        if s.train.num_minibatches == 1:
            return [None] * s.rl.ppo_epochs
        mb = size // s.train.num_minibatches
        balance = self._block_balance(batch)
        plan = []
        for epoch in range(s.rl.ppo_epochs):
            order = np.asarray(jax.random.permutation(self.key(Stream.MINIBATCH, epoch), size))
            for i in range(s.train.num_minibatches):
                idx = np.sort(order[i * mb:(i + 1) * mb])
                if balance is not None:
                    lengths, count = balance  # each process packs its block of the minibatch
                    idx = packing.balance_blocks(idx, lengths[idx], count)
                plan.append(idx)
        return plan

    def _update(self, batch: dict[str, jax.Array], plan: list[np.ndarray | None],
                prox_rows: np.ndarray | None = None) -> dict[str, float]:
        """One optimizer step per entry of `plan` (`_minibatch_plan`); mean metrics (Sparse-RL's
        `sparse/*` counts summed). `prox_rows`: the rows `batch["logp_prox"]` holds, in order,
        when the pass left out the first update's rows (`prox.skip_first`); that update marks
        its rows `prox_from_forward` and the others carry their recomputed log-probs.

        With `train.apply_updates` False (the control run) each update is computed on copies of
        the parameters and optimizer state and then discarded.
        """
        s = self.settings
        # The metrics are fetched once after the last update: the host enqueues all updates (and
        # the minibatch gathers between them) without waiting for one to finish.
        pending = []
        for step, idx in enumerate(plan):
            if pending and jax.process_count() > 1:
                # One update ahead at most: ~20 gathers and reshards dispatched behind a
                # running update hung two-process CPU runs (docs/scaling.md, "Failures").
                jax.block_until_ready(pending[-1])
            if idx is None:
                mini = batch
            elif prox_rows is None:
                mini = self.learner.shard_batch({k: v[idx] for k, v in batch.items()})
            else:
                mini = {k: v[idx] for k, v in batch.items() if k != "logp_prox"}
                if step == 0:  # these rows are not in the pass: pi_prox from this forward
                    mini["logp_prox"] = np.zeros(mini["resp_mask"].shape, np.float32)
                else:
                    mini["logp_prox"] = batch["logp_prox"][np.searchsorted(prox_rows, idx)]
                mini["prox_from_forward"] = np.full(len(idx), step == 0)
                mini = self.learner.shard_batch(mini)
            if s.loop.apply_updates:
                self.params, self.opt_state, m = self.learner.update(
                    self.params, self.opt_state, mini, self.base)
            else:
                _, _, m = self.learner.update(jax.tree.map(jnp.copy, self.params),
                                              jax.tree.map(jnp.copy, self.opt_state), mini,
                                              self.base)
            pending.append(m)
        sums: dict[str, float] = {}
        for m in jax.device_get(pending):
            for k, v in to_floats(m).items():
                sums[k] = sums.get(k, 0.0) + v
        count = len(pending)
        # A step is bad when any of its updates was skipped for a non-finite loss or gradient.
        self._bad_steps = self._bad_steps + 1 if sums["update/skipped"] else 0
        return {k: v if k.startswith("sparse/") else v / count for k, v in sums.items()}

    def _block_balance(self, batch: dict[str, jax.Array]) -> tuple[np.ndarray, int] | None:
        """(every sequence's real tokens, row blocks) when processes pack their own blocks of
        each minibatch (packing, minibatches, more than one block), for `packing.balance_blocks`;
        else None. The lengths come from a small collective every process runs."""
        if not self.learner.packing or self.settings.train.num_minibatches <= 1:
            return None
        if self._blocks <= 1:
            return None
        return np.asarray(dist.to_host(jnp.sum(batch["attn_mask"], axis=1))), self._blocks

    # ---------------------------------------------------------------------------------------- run
    def evaluate(self, params: Any | None = None, when: str = "") -> dict[str, float]:
        """Eval metrics of the full-precision policy on the task's evaluation sets. With `when`
        ("before RL", ...) it logs a line as it starts and one with its results
        (`tasks.result_line`); its progress shows as it runs (`Task.evaluate`)."""
        e = self.settings.eval
        if when:
            sets = ", ".join(self.task.eval_sets)
            what = "greedy" if e.greedy_only else f"{e.k} samples at T={e.temperature:g} and greedy"
            logging.info("evaluation %s on %s: %s, up to %d tokens%s", when, sets, what,
                         e.max_new_tokens, "" if self._evaluations else
                         " (the first call of each kind compiles its programs)")
            if self.heartbeat is not None:
                self.heartbeat.doing(f"evaluation {when}")
        start, compiled = time.monotonic(), compilation.compile_stats()
        with self._watch("eval"):
            params = self._eval_policy(self.params if params is None else params)
            metrics = self.task.evaluate(self.eval_sampler, params, e, self.key(Stream.EVAL),
                                         bar=self.settings.loop.progress)
        self._evaluations.append(time.monotonic() - start)
        if when:
            new = compilation.compile_stats().since(compiled)
            logging.info("evaluation %s (%s%s): %s", when, clock(self._evaluations[-1]),
                         f", {new.seconds:.0f} s of it compiling {new.programs} programs"
                         if new.programs else "", result_line(metrics))
        return metrics

    def _watch(self, phase: str) -> Any:
        """The stall watchdog's mark around a phase outside `step` (none without one)."""
        return self.watchdog.watch(phase) if self.watchdog else contextlib.nullcontext()

    def rollout_speed(self, num_prompts: int | None = None) -> dict[str, float]:
        """Rollout tokens/s of the quantized actor vs the fp32 actor on the same prompts
        (`qurl_jax.plan.rollout_speed`)."""
        s = self.settings
        prompts, _ = self.task.sample_prompts(num_prompts or s.data.prompts_per_step)
        engines = [("fp", self.eval_sampler, self._eval_policy(self.params))]
        if self.lora:
            engines.append((self.recipe.name, self.sampler, lora.attach(
                self.base, self._adapter_on_rollout(self.params), self.lora.scale)))
        elif self.recipe.quantizes:
            engines.append((self.recipe.name, self.sampler, self._reshard(quant.requantize(
                self.params, self.recipe, compute_dtype=self.model_config.compute_dtype))))
        # Plain sampling at the rollout's temperature, every row to the length limit.
        settings = SamplingParams(max_new_tokens=self.sampling.max_new_tokens,
                                  temperature=self.sampling.temperature)
        n = s.rollout.n
        try:  # a static sampler's chunk must hold n x batch shards rows
            self.eval_sampler.rows_per_chunk(len(prompts), n)
        except ValueError:  # the same rows as single samples: the same work
            prompts, n = [p for p in prompts for _ in range(n)], 1
        return compare_rollout_speed(engines, prompts, settings, key=self.key(Stream.SPEED),
                                     n=n)

    def _eval_policy(self, params: Any) -> Any:
        """What the evaluation sampler samples: the full-precision `params` on the rollout's
        replicas, or with LoRA the adapter `params` on the frozen base, read as the learner
        reads it (`lora.learner_base`: the learner's policy; no float copy of the base)."""
        if self.lora:
            return lora.learner_policy(self.base, self._adapter_on_rollout(params), self.lora)
        return self._on_rollout_layout(params)

    def _on_rollout_layout(self, params: Any) -> Any:
        """Full-precision `params` (the learner's) in the compute dtype on the rollout's
        replicas, for the evaluation sampler."""
        return self._reshard(quant.requantize(params, "fp",
                                              compute_dtype=self.model_config.compute_dtype))

    def _write_eval(self, metrics: dict[str, float]) -> None:
        self.writer.write(self.step_count, {f"eval/{k}": v for k, v in metrics.items()})

    def train(self, num_steps: int | None = None,
              preemption: PreemptionGuard | None = None) -> dict[str, Any]:
        """Runs to `num_steps` (default train.num_steps), evaluating before (`eval.before`) and
        after.

        With a `preemption` guard that reports a stop request (SIGTERM / SIGINT, see
        `qurl_jax.train.preemption`) the run ends after the current step with a checkpoint of it and
        skips the final evaluation, export and plots; the summary's `preempted` is then the step
        of the newest checkpoint.
        """
        s = self.settings
        total = s.loop.num_steps if num_steps is None else num_steps
        summary: dict[str, Any] = {"start_step": self.step_count}
        if self.step_count == 0 and self.task.has_eval and s.loop.eval_before:
            summary["eval_before"] = self.evaluate(when="before RL")
            self._write_eval(summary["eval_before"])
        elif self.step_count and self.task.has_eval and dist.is_primary():  # resumed: step 0's
            summary["eval_before"] = eval_at(read_metrics(self.workdir), 0)
        progress = _Progress(total, self.step_count, bar=s.loop.progress and dist.is_primary(),
                             final_eval=self._final_eval_s())
        if self.heartbeat is not None:
            self.heartbeat.status = progress.left
        if self.step_count < total:
            logging.info("step %d/%d compiles its programs as it runs (rollout, log-probs, "
                         "update); later steps reuse them", self.step_count + 1, total)
        stopped = None
        while self.step_count < total:
            started = time.monotonic()
            metrics = self.step()
            if preemption is not None:  # compiled: from here a signal finishes its step
                preemption.at_steps = True
            if self.program_check is not None:
                with self._watch("check_collectives"):
                    self.program_check.compare(self.step_count)
            if self.watchdog:
                self.watchdog.step_done(self.step_count)
            progress.update(self.step_count, metrics, time.monotonic() - started)
            # Every step, on every process: in a multi-process run this is a collective point.
            preempted = preemption is not None and preemption.reached(self.step_count)
            if self._bad_steps:
                logging.warning("step %d: non-finite loss or gradient, update skipped "
                                "(%d in a row)", self.step_count, self._bad_steps)
                if self._bad_steps >= s.loop.max_bad_steps:
                    stopped = f"{self._bad_steps} consecutive non-finite updates"
                    logging.error("stopping: %s; last good checkpoint kept", stopped)
                    break
                if preempted:
                    stopped = "preempted"
                    break
                continue
            if preempted:
                if self.step_count not in self.checkpointer.steps():
                    self._save(force=True)
                stopped = "preempted"
                break
            if self.checkpointer.should_save(self.step_count):
                self._save()
            elif s.loop.malloc_trim_steps:  # a save trims already (`step` trims before the update)
                malloc.trim()
            if s.loop.eval_every and self.step_count % s.loop.eval_every == 0 \
                    and self.step_count < total:
                self._write_eval(self.evaluate(when=f"at step {self.step_count}"))
        progress.close()
        if preemption is not None:  # evaluation, speed check: a signal stops them at once
            preemption.at_steps = False
        if stopped == "preempted":  # the scheduler's kill follows: checkpoint, close, return
            saved = self.checkpointer.steps()
            self._close()
            summary.update(end_step=self.step_count, stopped=stopped, last=self.last_metrics,
                           preempted=saved[-1] if saved else None)
            return summary
        summary.update(end_step=self.step_count, stopped=stopped, last=self.last_metrics)
        if stopped is None and self.step_count not in self.checkpointer.steps():
            self._save(force=True)  # the final state, for `python -m qurl_jax.evaluate`
        if self.task.has_eval and self._evaluated(summary["start_step"]):
            # A finished run rerun: its final evaluation is in metrics.jsonl already.
            logging.info("the run is complete at step %d; metrics.jsonl holds its final "
                         "evaluation (python -m qurl_jax.evaluate evaluates again)",
                         self.step_count)
            summary["complete"] = True
            if dist.is_primary():
                summary["eval_after"] = eval_at(read_metrics(self.workdir), self.step_count)
        elif self.task.has_eval:
            summary["eval_after"] = self.evaluate(when="after RL")
            self._write_eval(summary["eval_after"])
        steps = [r for r in read_metrics(self.workdir) if "time/rollout_share" in r] \
            if dist.is_primary() else []
        summary["means"] = {k: float(np.mean([r[k] for r in steps if k in r]))
                            for k in SUMMARY_KEYS if any(k in r for r in steps)}
        if "time/rollout_share" in summary["means"]:  # of all step time, as time_split.png
            summary["means"]["time/rollout_share"] = rollout_share(steps)
        if s.loop.report_speed:
            summary["rollout_speed"] = self.rollout_speed()
        if s.loop.export_hf and stopped is None:
            params = dist.to_host(self.params)  # gathered from every process (a collective)
            if dist.is_primary() and self.lora:
                # The merged model (base dequantized + a @ b * scale), and the adapter as PEFT.
                base = dist.to_host(self.base)
                self.task.export(s.loop.export_hf, self.model_config,
                                 lora.merge(base, params, self.lora.scale))
                peft.save_adapter(os.path.join(s.loop.export_hf, peft.ADAPTER_DIR), params,
                                  self.lora, s.model.path)
            elif dist.is_primary():
                self.task.export(s.loop.export_hf, self.model_config, params)
        self._close()
        if dist.is_primary():
            summary["plots"] = self._write_plots()
        summary["compile"] = compilation.compile_stats().since(self._compiled_before).metrics("")
        return summary

    def _final_eval_s(self) -> float:
        """Seconds the evaluation after RL is expected to take: the last evaluation's (0 without
        evaluation sets, NaN before any has run)."""
        if not self.task.has_eval:
            return 0.0
        return self._evaluations[-1] if self._evaluations else math.nan

    def _evaluated(self, start_step: int) -> bool:
        """Whether the run resumed at its last step and metrics.jsonl already has that step's
        evaluation (read by process 0; the same answer on every process)."""
        done = start_step == self.step_count > 0 and dist.is_primary() and any(
            k.startswith("eval/") for r in read_metrics(self.workdir)
            if r.get("step") == self.step_count for k in r)
        return dist.host_sums({"done": float(done)})["done"] > 0

    def _close(self) -> None:
        """Waits for the checkpoint writes and ends the writers, threads and verifier processes."""
        self.checkpointer.close()
        self.writer.close()
        self._reward_thread.shutdown()
        self.task.close()  # verifier worker processes

    def _write_plots(self) -> list[str]:
        """The run's PNG plots in `<workdir>/plots/` (`qurl_jax.runtime.report`); none, with a
        warning, when matplotlib is not installed, since the run itself has finished."""
        try:
            paths = report.write_plots(self.workdir)
        except (ImportError, OSError) as e:  # no matplotlib, or a workdir that is a URL
            logging.warning("no plots written (%s); install matplotlib, then run "
                            "python -m qurl_jax.runtime.report --workdir=%s", e, self.workdir)
            return []
        logging.info("wrote %d plots to %s", len(paths),
                     os.path.join(self.workdir, report.PLOTS_DIR))
        return paths


class _StepPhases:
    """Tells the heartbeat which phase of which step is running (a `PhaseTimer` listener)."""

    def __init__(self, heartbeat: Any, step: int) -> None:
        self.heartbeat, self.step = heartbeat, step

    def enter(self, name: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.doing(f"step {self.step}: {name}")

    def leave(self, name: str) -> None:
        del name


class _Progress:
    """A tqdm bar on a terminal; otherwise (a log file, a pod's log, or `bar=False`) one plain
    status line every `every` steps, at the last step and after any step that ends 30 s or more
    after the last line, so a redirected run's log holds readable lines instead of hundreds of
    carriage-return bar frames. Every line carries the step's seconds and the run's time left
    (`left`): the steps still to run at the mean of the last five (the first step of a process,
    which compiles, only while it is the only one) plus `final_eval` seconds for the evaluation
    after RL (NaN: not known yet)."""

    def __init__(self, total: int, start: int, bar: bool, stream: Any = None,
                 final_eval: float = 0.0) -> None:
        stream = sys.stderr if stream is None else stream  # where tqdm draws
        self._total = total
        self._step = start
        self._every = max(1, (total - start) // 20)
        self._final_eval = final_eval
        self._seconds: list[float] = []
        self._printed = time.monotonic()
        self._bar = None
        if bar and stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rl", dynamic_ncols=True,
                             file=stream)

    @staticmethod
    def line(m: dict[str, float]) -> str:
        return (f"reward {m.get('rollout/reward_mean', math.nan):.3f} "
                f"len {m.get('rollout/response_len', math.nan):.1f} "
                f"loss {m.get('update/loss', math.nan):+.4f} "
                f"kl(b|p) {m.get('kl_behav_prox_k3', math.nan):.2e} "
                f"rollout {m.get('time/rollout_share', math.nan):.0%}")

    def left(self) -> str:
        """The run's time left, as a phrase ('' before the first step has ended)."""
        if not self._seconds:
            return ""
        recent = self._seconds[1:][-5:] or self._seconds
        steps = (self._total - self._step) * sum(recent) / len(recent)
        if math.isnan(self._final_eval):
            return f"about {clock(steps)} left in the run, and the evaluation after RL"
        return f"about {clock(steps + self._final_eval)} left in the run"

    def update(self, step: int, m: dict[str, float], seconds: float = math.nan) -> None:
        self._step = step
        if math.isfinite(seconds):
            self._seconds.append(seconds)
        if self._bar is not None:
            self._bar.set_postfix_str(self.line(m))
            self._bar.update(step - self._bar.n)
        elif step % self._every == 0 or step == self._total or \
                time.monotonic() - self._printed >= 30:
            self._printed = time.monotonic()
            left = self.left()
            logging.info("step %d/%d: %.1f s, %s%s", step, self._total, seconds, self.line(m),
                         f"; {left}" if left else "")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
