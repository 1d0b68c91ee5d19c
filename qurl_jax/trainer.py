"""The RL trainer: one step reads like QuRL's algorithm.

    params --requantize--> rollout_params --sample(n per prompt)--> tokens, logp_behav
           --verify--> rewards --group--> advantages (DAPO: drop all-equal groups, refill)
           --learner forward (fp32)--> logp_prox (and logp_ref for the KL)
           --policy_loss(acr | tis | ...) x minibatches--> AdamW update of params

Invariant scaling (QuRL's UAQ) is applied once to the learner's parameters before the first step;
the rollout actor is re-quantized from the full-precision learner every step. `Trainer(config,
workdir).train()` is the whole run and is what `python -m qurl_jax.main` calls; other JAX code can
drive `Trainer.step()` itself. State (params, optimizer, step, data position, seed) is checkpointed
with orbax every `train.checkpoint_every` steps and a workdir with a checkpoint resumes from it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging

from qurl_jax import quant
from qurl_jax import sharding as shd
from qurl_jax.checkpoint import Checkpointer
from qurl_jax.config import learner_micro_batch_size, objective_from_config, validate
from qurl_jax.learner import Learner, OptimConfig
from qurl_jax.metrics import MetricWriter, PhaseTimer, read_metrics, to_floats
from qurl_jax.models import positions_from_mask
from qurl_jax.rl import advantages as adv_lib
from qurl_jax.sampling import Sampler
from qurl_jax.tasks import build_model_and_task

# Per-step metrics averaged over the run for the end-of-run summary.
SUMMARY_KEYS = ("time/rollout_share", "time/step_s", "rollout/tokens_per_s", "rollout/reward_mean",
                "kl_behav_prox_k1", "kl_behav_prox_k3", "logp_gap_abs_mean", "raw_is_weight_max",
                "truncated_frac", "clipfrac_upper", "clipfrac_lower",
                "quant/code_change_fraction", "quant/update_to_step_ratio")

_ADVANTAGES = {"grpo": adv_lib.grpo_advantages, "dr_grpo": adv_lib.dr_grpo_advantages,
               "rloo": adv_lib.rloo_advantages}


def optim_from_config(o: ml_collections.ConfigDict) -> OptimConfig:
    return OptimConfig(learning_rate=o.learning_rate, warmup_steps=o.warmup_steps,
                       decay_steps=o.decay_steps, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                       grad_clip=o.grad_clip)


@dataclasses.dataclass
class Rollout:
    """One step's experience, host-side numpy, rows grouped by prompt (n consecutive rows each).

    tokens i32[N, P+G] prompt (left-padded) + response; attn_mask bool[N, P+G];
    resp_mask f32[N, G]; logp_behav f32[N, G]; lengths i32[N]; rewards f32[N], None while the
    verifier still runs in the background (`pending`); `resolve()` waits for it.
    """

    tokens: np.ndarray
    attn_mask: np.ndarray
    resp_mask: np.ndarray
    logp_behav: np.ndarray
    rewards: np.ndarray | None
    lengths: np.ndarray
    pending: concurrent.futures.Future | None = None

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    def resolve(self) -> Rollout:
        if self.pending is not None:
            self.rewards = np.array(self.pending.result(), np.float32)
            self.pending = None
        return self


def _left_pad_to_same_width(a: Rollout, b: Rollout) -> tuple[Rollout, Rollout]:
    """Left-pads the prompt part of the narrower rollout so rows of both can be exchanged."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])

    def pad(r: Rollout) -> Rollout:
        extra = width - r.tokens.shape[1]
        if not extra:
            return r
        return dataclasses.replace(
            r, tokens=np.pad(r.tokens, ((0, 0), (extra, 0))),
            attn_mask=np.pad(r.attn_mask, ((0, 0), (extra, 0))))

    return pad(a), pad(b)


class Trainer:
    """Owns the model, the actor's recipe, the sampler, the learner and the run state."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str) -> None:
        self.config = validate(config)
        self.workdir = os.path.abspath(workdir)
        os.makedirs(self.workdir, exist_ok=True)
        c = self.config
        self.mesh = shd.make_mesh(c.mesh.data, c.mesh.fsdp, c.mesh.tensor)
        self.model_config, init_params, self.task = build_model_and_task(c, self.workdir)
        self.model_config = self.model_config.replace(attention=c.model.attention)
        self.recipe = quant.get_recipe(c.rollout.precision)
        self.objective = objective_from_config(c.rl)
        self.learner = Learner(self.model_config, self.objective, optim_from_config(c.optim),
                               self.mesh, temperature=c.rollout.temperature,
                               num_micro_batches=c.rl.num_micro_batches, remat=c.train.remat,
                               scan_layers=c.train.scan_layers, logprob_chunk=c.train.logprob_chunk,
                               logprob_batch_size=learner_micro_batch_size(c))
        sampler_kwargs = dict(max_prompt_len=c.data.max_prompt_len,
                              max_new_tokens=max(c.rollout.max_new_tokens, c.eval.max_new_tokens),
                              pad_id=self.task.pad_id, mesh=self.mesh)
        self.sampler = Sampler(self.model_config, quant.make_dot_general(self.recipe),
                               **sampler_kwargs)
        self.eval_sampler = Sampler(self.model_config, **sampler_kwargs)

        scaled = self._maybe_invariant_scaling(init_params)
        self.ref_params = self.learner.shard_params(scaled) if c.rl.kl_coef else None
        self.params = self.learner.shard_params(scaled)
        self.opt_state = self.learner.init_opt_state(self.params)
        self.step_count = 0
        self.checkpointer = Checkpointer(os.path.join(self.workdir, "checkpoints"),
                                         interval=c.train.checkpoint_every,
                                         keep=c.train.keep_checkpoints)
        self._restore()
        self.writer = MetricWriter(self.workdir)
        self._reward_thread = concurrent.futures.ThreadPoolExecutor(1, "qurl-reward")
        self._bad_steps = 0
        self.last_metrics: dict[str, float] = {}

    # ------------------------------------------------------------------------------------ set-up
    def _maybe_invariant_scaling(self, params: Any) -> Any:
        s = self.config.rollout.invariant_scaling
        if s == 1.0:
            return params
        targets = tuple(self.config.rollout.invariant_scaling_targets)
        logging.info("invariant scaling s=%.3g on %s", s, targets)
        return quant.invariant_scaling(params, s=s, targets=targets)

    def _restore(self) -> None:
        restored = self.checkpointer.restore_latest(
            {"params": self.params, "opt_state": self.opt_state})
        if restored is None:
            return
        step, state, meta = restored
        self.params, self.opt_state = state["params"], state["opt_state"]
        self.step_count = step
        self.task.restore(meta["data"])
        logging.info("resumed from step %d in %s", step, self.checkpointer.directory)

    def _save(self, force: bool = False) -> None:
        self.checkpointer.save(
            self.step_count, {"params": self.params, "opt_state": self.opt_state},
            {"step": self.step_count, "data": self.task.state(), "seed": self.config.seed},
            force=force)

    # ------------------------------------------------------------------------------------ rollout
    def _rollout(self, rollout_params: Any, prompts: list[list[int]], answers: list[str],
                 key: jax.Array, timer: PhaseTimer) -> Rollout:
        c = self.config
        with timer.phase("rollout"):
            out = self.sampler.sample(
                rollout_params, prompts, key=key, n=c.rollout.n,
                max_new_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature,
                top_k=c.rollout.top_k, top_p=c.rollout.top_p, eos_ids=self.task.eos_ids)
            out = jax.device_get(out)
        texts = self.task.decode(out.tokens, out.mask)
        # Verification runs on the reward thread while the learner recomputes log-probs.
        pending = self._reward_thread.submit(
            self.task.rewards, texts, [a for a in answers for _ in range(c.rollout.n)])
        resp_mask = np.asarray(out.mask, np.float32)
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        attn = np.concatenate([out.prompt_mask, resp_mask > 0], axis=1)
        # With top-k/top-p truncation the learner's policy is the untruncated tempered softmax, so
        # importance ratios use the behaviour log-prob under that same distribution.
        # Owned, writable copies: device_get returns read-only views, and dynamic sampling
        # overwrites the rows of dropped groups in place.
        return Rollout(tokens=tokens, attn_mask=attn, resp_mask=resp_mask,
                       logp_behav=np.array(out.logp_untruncated, np.float32),
                       rewards=None, lengths=np.array(out.lengths, np.int32), pending=pending)

    def _shape_rewards(self, r: Rollout) -> np.ndarray:
        c = self.config
        if c.rl.overlong_buffer <= 0:
            return r.rewards
        penalty = adv_lib.overlong_penalty(jnp.asarray(r.lengths), c.rollout.max_new_tokens,
                                           c.rl.overlong_buffer, c.rl.overlong_factor)
        return r.rewards + np.asarray(penalty, np.float32)

    def _advantages(self, rewards: np.ndarray) -> np.ndarray:
        estimator = _ADVANTAGES[self.config.rl.advantage]
        return np.asarray(estimator(jnp.asarray(rewards), group_size=self.config.rollout.n))

    def _groups_to_keep(self, shaped: np.ndarray) -> np.ndarray:
        n = self.config.rollout.n
        return np.array(adv_lib.groups_to_keep(jnp.asarray(shaped), group_size=n))[::n]  # writable

    def collect(self, rollout_params: Any, key: jax.Array, timer: PhaseTimer
                ) -> tuple[Rollout, dict[str, float]]:
        """Samples one batch; with DAPO dynamic sampling, replaces all-equal groups by new ones.

        Without dynamic sampling the rewards are still being verified when this returns
        (`Rollout.pending`). Groups still all-equal after `max_gen_batches` generation rounds stay
        in the batch with a zero loss mask, so shapes stay static and they add nothing.
        """
        c = self.config
        n, want = c.rollout.n, c.data.prompts_per_step
        prompts, answers = self.task.next_prompts(want)
        r = self._rollout(rollout_params, prompts, answers, key, timer)
        stats = {"rollout/response_len": float(r.lengths.mean()),
                 "rollout/tokens": float(r.lengths.sum())}
        if not c.rl.dynamic_sampling:
            return r, stats
        with timer.phase("reward"):
            r.resolve()
        shaped = self._shape_rewards(r)
        keep = self._groups_to_keep(shaped)
        rounds = 1
        while not keep.all() and rounds < c.rl.max_gen_batches:
            prompts, answers = self.task.next_prompts(want)
            extra = self._rollout(rollout_params, prompts, answers,
                                  jax.random.fold_in(key, rounds), timer)
            with timer.phase("reward"):
                extra.resolve()
            extra_shaped = self._shape_rewards(extra)
            r, extra = _left_pad_to_same_width(r, extra)
            extra_keep = self._groups_to_keep(extra_shaped)
            free = np.flatnonzero(~keep)
            take = np.flatnonzero(extra_keep)[: len(free)]
            for dst, src in zip(free[: len(take)], take, strict=True):
                rows_d, rows_s = slice(dst * n, dst * n + n), slice(src * n, src * n + n)
                for field in ("tokens", "attn_mask", "resp_mask", "logp_behav", "rewards",
                              "lengths"):
                    getattr(r, field)[rows_d] = getattr(extra, field)[rows_s]
                shaped[rows_d] = extra_shaped[rows_s]
                keep[dst] = True
            rounds += 1
        r.resp_mask *= np.repeat(keep, n)[:, None].astype(np.float32)
        stats.update({"rollout/gen_batches": float(rounds),
                      "rollout/kept_group_frac": float(keep.mean())})
        return r, stats

    # --------------------------------------------------------------------------------------- step
    def step(self) -> dict[str, float]:
        """One RL step; returns its metrics (already written to metrics.jsonl)."""
        c = self.config
        timer = PhaseTimer()
        key = jax.random.fold_in(jax.random.key(c.seed), self.step_count)
        with timer.phase("requantize"):
            rollout_params = jax.block_until_ready(quant.requantize(self.params, self.recipe))
        r, metrics = self.collect(rollout_params, key, timer)
        batch = self._learner_batch(r)
        with timer.phase("logp_recompute"):
            batch["logp_prox"] = self.learner.logprobs(self.params, batch)
            if self.ref_params is not None:
                batch["logp_ref"] = self.learner.logprobs(self.ref_params, batch)
            jax.block_until_ready(batch["logp_prox"])
        with timer.phase("reward"):  # only the part the recomputation did not hide
            r.resolve()
        metrics.update({"rollout/reward_mean": float(r.rewards.mean()),
                        "rollout/accuracy": float((r.rewards > 0.5).mean())})
        advantages = self._advantages(self._shape_rewards(r))
        batch.update(self.learner.shard_batch({"advantages": jnp.asarray(advantages)}))
        # The update donates the parameter buffers, so the diagnostic keeps its own copy.
        old_params = jax.tree.map(jnp.copy, self.params) if self.recipe.quantizes else None
        with timer.phase("update"):
            update_metrics = self._update(batch)
        metrics.update(update_metrics)
        capture = quant.update_capture(old_params, self.params, self.recipe) \
            if self.recipe.quantizes else {}
        metrics.update({f"quant/{k}": float(v) for k, v in capture.items()})
        metrics.update(timer.metrics())
        metrics["time/rollout_share"] = timer.seconds["rollout"] / max(
            sum(timer.seconds.values()), 1e-9)
        metrics["rollout/tokens_per_s"] = metrics["rollout/tokens"] / max(
            timer.seconds["rollout"], 1e-9)
        self.step_count += 1
        self.writer.write(self.step_count, metrics)
        self.last_metrics = metrics
        return metrics

    def _learner_batch(self, r: Rollout) -> dict[str, jax.Array]:
        """The learner's inputs except the advantages (those wait for the verifier)."""
        positions = positions_from_mask(r.attn_mask)
        batch = {"tokens": r.tokens, "positions": positions, "attn_mask": r.attn_mask,
                 "resp_mask": r.resp_mask, "logp_behav": r.logp_behav}
        return self.learner.shard_batch({k: jnp.asarray(v) for k, v in batch.items()})

    def _update(self, batch: dict[str, jax.Array]) -> dict[str, float]:
        c = self.config
        size = batch["tokens"].shape[0]
        mb = size // c.rl.num_minibatches
        sums: dict[str, float] = {}
        count = 0
        perm_key = jax.random.fold_in(jax.random.key(c.seed + 1), self.step_count)
        for epoch in range(c.rl.ppo_epochs):
            order = np.asarray(jax.random.permutation(jax.random.fold_in(perm_key, epoch), size))
            for i in range(c.rl.num_minibatches):
                idx = np.sort(order[i * mb:(i + 1) * mb]) if c.rl.num_minibatches > 1 else None
                mini = batch if idx is None else self.learner.shard_batch(
                    {k: v[idx] for k, v in batch.items()})
                self.params, self.opt_state, m = self.learner.update(
                    self.params, self.opt_state, mini)
                m = to_floats(m)
                for k, v in m.items():
                    sums[k] = sums.get(k, 0.0) + v
                count += 1
        # A step is bad when any of its updates was skipped for a non-finite loss or gradient.
        self._bad_steps = self._bad_steps + 1 if sums["update/skipped"] else 0
        return {k: v / count for k, v in sums.items()}

    # ---------------------------------------------------------------------------------------- run
    def evaluate(self, params: Any | None = None) -> dict[str, float]:
        """Eval metrics of the full-precision policy on the task's evaluation sets."""
        params = self.params if params is None else params
        return self.task.evaluate(self.eval_sampler, params, self.config,
                                  jax.random.key(self.config.seed + 2))

    def rollout_speed(self, num_prompts: int | None = None) -> dict[str, float]:
        """Rollout tokens/s of the quantized actor vs the fp32 actor: same prompts, same key,
        EOS disabled so both generate the same number of tokens; compiled before timing."""
        c = self.config
        prompts, _ = self.task.sample_prompts(num_prompts or c.data.prompts_per_step)
        key = jax.random.key(c.seed + 3)
        result = {}
        for name, sampler, params in (
                ("fp", self.eval_sampler, self.params),
                (self.recipe.name, self.sampler, quant.requantize(self.params, self.recipe))):
            kwargs = dict(key=key, n=c.rollout.n, max_new_tokens=c.rollout.max_new_tokens,
                          temperature=c.rollout.temperature, eos_ids=())
            jax.block_until_ready(sampler.sample(params, prompts, **kwargs).tokens)  # compile
            start = time.perf_counter()
            out = jax.block_until_ready(sampler.sample(params, prompts, **kwargs))
            result[f"{name}_tokens_per_s"] = float(np.asarray(out.lengths).sum()) / (
                time.perf_counter() - start)
        if self.recipe.quantizes:
            result["speedup"] = result[f"{self.recipe.name}_tokens_per_s"] / result[
                "fp_tokens_per_s"]
        return result

    def train(self, num_steps: int | None = None) -> dict[str, Any]:
        """Runs to `num_steps` (default train.num_steps), evaluating before and after."""
        c = self.config
        total = c.train.num_steps if num_steps is None else num_steps
        summary: dict[str, Any] = {"start_step": self.step_count}
        if self.step_count == 0 and self.task.has_eval:
            summary["eval_before"] = self.evaluate()
            self.writer.write(0, {f"eval/{k}": v for k, v in summary["eval_before"].items()})
        progress = _Progress(total, self.step_count, enabled=c.train.progress)
        stopped = None
        while self.step_count < total:
            metrics = self.step()
            progress.update(self.step_count, metrics)
            if self._bad_steps:
                logging.warning("step %d: non-finite loss or gradient, update skipped "
                                "(%d in a row)", self.step_count, self._bad_steps)
                if self._bad_steps >= c.train.max_bad_steps:
                    stopped = f"{self._bad_steps} consecutive non-finite updates"
                    logging.error("stopping: %s; last good checkpoint kept", stopped)
                    break
                continue
            if self.checkpointer.should_save(self.step_count):
                self._save()
            if c.train.eval_every and self.step_count % c.train.eval_every == 0 \
                    and self.step_count < total:
                self.writer.write(self.step_count,
                                  {f"eval/{k}": v for k, v in self.evaluate().items()})
        progress.close()
        if stopped is None and self.step_count not in self.checkpointer.steps():
            self._save(force=True)
        summary.update(end_step=self.step_count, stopped=stopped, last=self.last_metrics)
        if self.task.has_eval:
            summary["eval_after"] = self.evaluate()
            self.writer.write(self.step_count,
                              {f"eval/{k}": v for k, v in summary["eval_after"].items()})
        steps = [r for r in read_metrics(self.workdir) if "time/rollout_share" in r]
        summary["means"] = {k: float(np.mean([r[k] for r in steps if k in r]))
                            for k in SUMMARY_KEYS if any(k in r for r in steps)}
        if c.train.report_speed:
            summary["rollout_speed"] = self.rollout_speed()
        if c.train.export_hf and stopped is None:
            self.task.export(c.train.export_hf, self.model_config, jax.device_get(self.params))
        self.checkpointer.close()
        self.writer.close()
        self._reward_thread.shutdown()
        self.task.close()  # verifier worker processes
        return summary


class _Progress:
    """One status line per step (tqdm bar when enabled)."""

    def __init__(self, total: int, start: int, enabled: bool) -> None:
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=start, desc="rl", dynamic_ncols=True)

    def update(self, step: int, m: dict[str, float]) -> None:
        line = (f"reward {m.get('rollout/reward_mean', math.nan):.3f} "
                f"len {m.get('rollout/response_len', math.nan):.1f} "
                f"loss {m.get('update/loss', math.nan):+.4f} "
                f"kl(b|p) {m.get('kl_behav_prox_k3', math.nan):.2e} "
                f"rollout {m.get('time/rollout_share', math.nan):.0%}")
        if self._bar is not None:
            self._bar.set_postfix_str(line)
            self._bar.update(step - self._bar.n)
        else:
            logging.info("step %d: %s", step, line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
