"""A run's evaluation without training, as `python -m qurl_jax.evaluate` runs it: the policy of a
workdir's checkpoint (or the initial policy at step 0) sampled on the config's evaluation sets with
the trainer's evaluation key for that step. A library module: it defines no command-line flags, so
other code (and tests) import it beside any command's flags."""

from __future__ import annotations

import json
import os
from typing import Any

from absl import logging

EVAL_DIR = "eval"


def checkpoint_step(workdir: str, step: int | None) -> int:
    """The step to evaluate: `step`, checked against the workdir's checkpoints (None: the newest;
    0 without any: the initial policy); `UserError` naming what is missing. Reads metadata only."""
    from qurl_jax.runtime.checkpoint import Checkpointer
    from qurl_jax.runtime.errors import UserError

    directory = os.path.join(workdir, "checkpoints")
    steps = Checkpointer(directory).steps() if os.path.isdir(directory) else []
    if not steps:
        if step:
            raise UserError(f"--step={step}: {directory} holds no checkpoint")
        return 0
    step = steps[-1] if step is None else step
    if step and step not in steps:
        raise UserError(f"--step={step}: no checkpoint of that step in {directory} (saved: "
                        f"{', '.join(map(str, steps))})")
    return step


def _lora_policy(settings: Any, learner: Any, model_config: Any, init: Any, workdir: str,
                 step: int) -> Any:
    """A LoRA run's policy as the evaluation samples it: the frozen base quantized from the
    initial weights as the trainer makes it, with the adapter of checkpoint `step` (at step 0
    the initial one) attached, the base read as the learner reads it
    (`model.lora.learner_products`; `Trainer._eval_policy`)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from qurl_jax import lora
    from qurl_jax.runtime.checkpoint import Checkpointer
    from qurl_jax.train.trainer import STATE_KINDS, Stream, stream_key

    cfg = settings.model.lora
    adapter = lora.init_adapter(stream_key(settings.seed, Stream.LORA, 0), init, cfg)
    if step:
        template, opt_state = learner.abstract_state(jax.eval_shape(lambda: adapter))
        checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), kinds=STATE_KINDS)
        try:
            state, _ = checkpointer.restore_step(step, {"adapter": template,
                                                        "opt_state": opt_state})
        finally:
            checkpointer.close()
        adapter = state["adapter"]
    base = lora.quantize_base(init, cfg, settings.rollout.recipe, model_config.compute_dtype)
    base = jax.device_put(base, NamedSharding(learner.mesh, PartitionSpec()))
    return lora.learner_policy(base, learner.shard_params(adapter), cfg)


def _policy(learner: Any, model_config: Any, init: Any, workdir: str,
            step: int, invariant_scaling: tuple[float, tuple[str, ...]]) -> tuple[int, Any]:
    """(step, sharded float32 params): the checkpoint of `step`, or at step 0 the initial policy
    as the trainer prepares it."""
    import jax

    from qurl_jax import quant
    from qurl_jax.models import init_params
    from qurl_jax.runtime.checkpoint import Checkpointer
    from qurl_jax.train.trainer import STATE_KINDS

    directory = os.path.join(workdir, "checkpoints")
    if step == 0:
        s, targets = invariant_scaling
        params = init if s == 1.0 else quant.invariant_scaling(init, s=s, targets=targets)
        return 0, learner.shard_params(params)
    params, opt_state = learner.abstract_state(
        jax.eval_shape(lambda: init_params(model_config, jax.random.key(0))))
    checkpointer = Checkpointer(directory, kinds=STATE_KINDS)
    try:
        state, _ = checkpointer.restore_step(step, {"params": params, "opt_state": opt_state})
    finally:
        checkpointer.close()
    return step, state["params"]


def evaluate_run(config: Any, workdir: str, step: int | None = None,
                 eval_files: list[str] | None = None, reward_fn: Any = None
                 ) -> tuple[int, dict[str, float]]:
    """(step, metrics) of the evaluation this module's command runs (see the module docstring);
    writes `<workdir>/eval/step_<N>.json`. `reward_fn` as `Trainer`'s."""
    from qurl_jax.config.base import validate
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.data import reward_hook
    from qurl_jax.parallel import sharding as shd
    from qurl_jax.runtime import paths
    from qurl_jax.runtime.errors import ConfigError, WorkdirError
    from qurl_jax.sampling.factory import build_eval_sampler
    from qurl_jax.train.tasks import build_model_and_task, model_config_for, result_line
    from qurl_jax.train.trainer import Stream, stream_key

    if eval_files is not None:
        config = config.copy_and_resolve_references()
        config.eval.files = tuple(eval_files)
    c = validate(config)
    if reward_fn is not None:
        reward_hook.takes_prompts(reward_fn, "reward_fn")
    settings = RunSettings.from_config(c)
    if c.data.task == "math" and not settings.eval.files:
        raise ConfigError("config.eval.files is empty: name the evaluation sets (or pass "
                          "--eval_files=a.jsonl,b.jsonl)")
    workdir = paths.local_abspath(workdir)
    if c.model.source == "tiny" and not os.path.isdir(workdir):  # its warm start lives there
        raise WorkdirError(f"--workdir={workdir} does not exist: name the run's workdir")
    step = checkpoint_step(workdir, step)  # before the task or its warm start is built
    mesh = shd.mesh_from_config(c.mesh)
    model_config = model_config_for(settings.model)
    learner = settings.train.learner(model_config, mesh, temperature=c.rollout.temperature,
                                     rollout_rows=settings.rollout_rows,
                                     lora=settings.model.lora)
    model_config, init, task = build_model_and_task(settings, workdir, reward_fn)
    hook = {}
    try:
        if settings.model.lora.enabled:
            from qurl_jax import lora, quant

            params = _lora_policy(settings, learner, model_config, init, workdir, step)
            hook = {"dot_general": lora.dot_general(quant.rollout_dot_general)}
        else:
            step, params = _policy(learner, model_config, init, workdir, step,
                                   (c.rollout.invariant_scaling,
                                    tuple(c.rollout.invariant_scaling_targets)))
        sampler = build_eval_sampler(
            model_config, settings.rollout.sampler, max_prompt_len=c.data.max_prompt_len,
            max_new_tokens=max(c.rollout.max_new_tokens, c.eval.max_new_tokens),
            pad_id=task.pad_id, mesh=mesh, compressed=c.eval.kv_cache == "rollout", **hook)
        metrics = task.evaluate(sampler, params, settings.eval,
                                stream_key(c.seed, Stream.EVAL, step))
        logging.info("evaluation at step %d: %s", step, result_line(metrics))
    finally:
        task.close()
    out_dir = os.path.join(workdir, EVAL_DIR)
    os.makedirs(out_dir, exist_ok=True)
    record = {"step": step, "eval_files": list(settings.eval.files),
              "model": settings.model.path if settings.model.source != "tiny" else "tiny",
              "kv_cache": _kv_cache(c), "metrics": metrics}
    path = os.path.join(out_dir, eval_file_name(step, c))
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    logging.info("wrote %s", path)
    return step, metrics


def _kv_cache(c: Any) -> dict[str, Any]:
    """The evaluation's KV cache: {'policy': 'dense'} or the rollout's compressed policy."""
    if c.eval.kv_cache == "dense":
        return {"policy": "dense"}
    r = c.rollout
    return {"policy": r.kv_policy, "budget": r.kv_budget, "interval": r.kv_interval,
            "window": r.kv_window}


def eval_file_name(step: int, config: Any) -> str:
    """`step_<N>.json`, or `step_<N>_<policy>.json` under a compressed cache (`eval.kv_cache`)."""
    if config.eval.kv_cache == "dense":
        return f"step_{step}.json"
    return f"step_{step}_{config.rollout.kv_policy}.json"


def format_table(step: int, metrics: dict[str, float]) -> str:
    """The evaluation as a two-column table."""
    lines = [f"{'evaluation at step ' + str(step):<40}{'value':>12}"]
    lines += [f"{k:<40}{v:>12.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)
