"""Evaluates a run's checkpoint, or a model, without training:

    python -m qurl_jax.evaluate --config=configs/<name>.py --workdir=DIR [--step=N]
        [--eval_files=a.jsonl,b.jsonl] [--config.<section>.<field>=VALUE ...]

The policy is the workdir's checkpoint of step N (default: the newest), or, when the workdir holds
no checkpoint, the config's initial policy (`--config.model.path`, or the embedded default's warm
start) as step 0. It is evaluated on the config's `eval.files` (or `--eval_files`) plus a synthetic
task's own held-out set, with the full-precision sampler, the config's `eval` settings and the
random key the trainer uses at that step, so a finished run's final evaluation row in
metrics.jsonl is reproduced. The table is printed and written to `<workdir>/eval/step_<N>.json`;
metrics.jsonl and the checkpoints are not touched. Bad input ends with one line and exit code 2,
as `python -m qurl_jax.main`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to the run's config file (configs/<name>.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir: its checkpoints are read and "
                               "eval/step_<N>.json is written there.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint's step (default: the newest).",
                             lower_bound=0)
_EVAL_FILES = flags.DEFINE_list("eval_files", None, "Evaluation sets instead of the config's "
                                "eval.files (comma-separated).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of bad-input errors too.")

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


def _policy(learner: Any, model_config: Any, init: Any, workdir: str,
            step: int, invariant_scaling: tuple[float, tuple[str, ...]]) -> tuple[int, Any]:
    """(step, sharded float32 params): the checkpoint of `step`, or at step 0 the initial policy
    as the trainer prepares it."""
    import jax

    from qurl_jax import quant
    from qurl_jax.models import init_params
    from qurl_jax.runtime.checkpoint import Checkpointer

    directory = os.path.join(workdir, "checkpoints")
    if step == 0:
        s, targets = invariant_scaling
        params = init if s == 1.0 else quant.invariant_scaling(init, s=s, targets=targets)
        return 0, learner.shard_params(params)
    params, opt_state = learner.abstract_state(
        jax.eval_shape(lambda: init_params(model_config, jax.random.key(0))))
    checkpointer = Checkpointer(directory)
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
                                     rollout_rows=settings.rollout_rows)
    model_config, init, task = build_model_and_task(settings, workdir, reward_fn)
    try:
        step, params = _policy(learner, model_config, init, workdir, step,
                               (c.rollout.invariant_scaling,
                                tuple(c.rollout.invariant_scaling_targets)))
        sampler = build_eval_sampler(
            model_config, settings.rollout.sampler, max_prompt_len=c.data.max_prompt_len,
            max_new_tokens=max(c.rollout.max_new_tokens, c.eval.max_new_tokens),
            pad_id=task.pad_id, mesh=mesh)
        metrics = task.evaluate(sampler, params, settings.eval,
                                stream_key(c.seed, Stream.EVAL, step))
        logging.info("evaluation at step %d: %s", step, result_line(metrics))
    finally:
        task.close()
    out_dir = os.path.join(workdir, EVAL_DIR)
    os.makedirs(out_dir, exist_ok=True)
    record = {"step": step, "eval_files": list(settings.eval.files),
              "model": settings.model.path if settings.model.source != "tiny" else "tiny",
              "metrics": metrics}
    path = os.path.join(out_dir, f"step_{step}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    logging.info("wrote %s", path)
    return step, metrics


def format_table(step: int, metrics: dict[str, float]) -> str:
    """The evaluation as a two-column table."""
    lines = [f"{'evaluation at step ' + str(step):<40}{'value':>12}"]
    lines += [f"{k:<40}{v:>12.4f}" for k, v in sorted(metrics.items())]
    return "\n".join(lines)


def main(argv: list[str]) -> None:
    from qurl_jax.runtime.errors import ConfigError, FlagError, UserError

    try:
        if len(argv) > 1:
            raise FlagError(f"unexpected arguments: {argv[1:]}")
        if _CONFIG.value is None:
            raise ConfigError("--config is missing: name the run's config file")
        if not _WORKDIR.value:
            raise ConfigError("--workdir is missing: name the run's workdir")
        from qurl_jax.runtime.quiet import quiet_libraries
        from qurl_jax.train.preemption import PreemptionGuard, Stopped

        quiet_libraries()  # orbax's INFO line per restored array, as main keeps them out
        guard = PreemptionGuard().install()  # SIGTERM / Ctrl-C: one line, 128 + the signal
        try:
            step, metrics = evaluate_run(_CONFIG.value, _WORKDIR.value, _STEP.value,
                                         _EVAL_FILES.value)
        except Stopped as e:
            guard.caught()
            print(f"qurl_jax: {signal.Signals(e.signum).name} received during the evaluation: "
                  "stopped; nothing written", file=sys.stderr, flush=True)
            sys.stdout.flush()
            # Not sys.exit: the interpreter's shutdown can crash while a thread is still inside
            # XLA (a compile the signal interrupted); the verifier processes are closed already.
            os._exit(e.exit_code)
    except UserError as e:
        if _VERBOSE.value:
            traceback.print_exc()
        print(f"qurl_jax: {e.what}: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        sys.exit(2)
    print(format_table(step, metrics), flush=True)


def _parse_flags(argv: list[str]) -> list[str]:
    from qurl_jax.config.overrides import expand_lists, flag_error

    try:
        return flags.FLAGS(expand_lists(argv))
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        cause = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
        text = str(cause.args[0] if isinstance(cause, KeyError) and cause.args else cause)
        print(f"qurl_jax: bad flag: {flag_error(argv, text)}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    try:  # Ctrl-C while the libraries load (before any handler): one line, not a traceback
        from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

        use_cpu_unless_accelerator_attached()  # before JAX starts a backend
        app.run(main, flags_parser=_parse_flags)
    except KeyboardInterrupt:
        print("qurl_jax: interrupted before the evaluation started; nothing written",
              file=sys.stderr, flush=True)
        sys.exit(130)
