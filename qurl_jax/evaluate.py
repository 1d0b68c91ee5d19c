"""Evaluates a run's checkpoint, or a model, without training:

    python -m qurl_jax.evaluate --config=configs/<name>.py --workdir=DIR [--step=N]
        [--eval_files=a.jsonl,b.jsonl] [--config.<section>.<field>=VALUE ...]

The policy is the workdir's checkpoint of step N (default: the newest), or, when the workdir holds
no checkpoint, the config's initial policy (`--config.model.path`, or the embedded default's warm
start) as step 0. It is evaluated on the config's `eval.files` (or `--eval_files`) plus a synthetic
task's own held-out set, with the full-precision sampler, the config's `eval` settings and the
random key the trainer uses at that step, so a finished run's final evaluation row in
metrics.jsonl is reproduced. The table is printed and written to `<workdir>/eval/step_<N>.json`
(`step_<N>_<policy>.json` with `--config.eval.kv_cache=rollout`: the policy under the
rollout's compressed KV cache, `rollout.kv_policy`); metrics.jsonl and the checkpoints are not
touched. Bad input ends with one line and exit code 2, as `python -m qurl_jax.main`.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

from absl import app, flags
from ml_collections import config_flags

from qurl_jax.train.evaluation import evaluate_run, format_table

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to the run's config file (configs/<name>.py).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "The run's workdir: its checkpoints are read and "
                               "eval/step_<N>.json is written there.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint's step (default: the newest).",
                             lower_bound=0)
_EVAL_FILES = flags.DEFINE_list("eval_files", None, "Evaluation sets instead of the config's "
                                "eval.files (comma-separated).")
_VERBOSE = flags.DEFINE_bool("verbose", False, "Show the traceback of bad-input errors too.")


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
