"""Command-line entry point: `python -m qurl_jax.main --config=configs/arith_tiny.py --workdir=...`.

Flags are parsed by absl with `ml_collections.config_flags`, so any field can be overridden
(`--config.rl.loss_mode=tis --config.rollout.precision=fp8`). Unknown or ill-typed overrides are
rejected while parsing, and `qurl_jax.config.validate` checks values, all before JAX compiles
anything; a bad value ends the run with one line naming the field and a non-zero exit code. A
workdir that already holds a checkpoint resumes from it; a checkpoint of another model or
optimizer ends the run the same way, before anything is written.

Multi-process runs (`qurl_jax.distributed`): every process runs the same command. Without flags,
`jax.distributed.initialize()` is called only where a cluster is detected (Cloud TPU VM or GKE TPU
workers, SLURM under `srun`, Open MPI, xpk GPU pods); `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (and `--local_device_ids=0,1,...`) join one explicitly. A peer
that dies makes the others abort within `--heartbeat_timeout_s`; restarting every process resumes
from the last checkpoint. Only process 0 prints the summary and writes metrics and logs.

Compiled programs are kept in JAX's persistent compilation cache at
`config.train.compilation_cache_dir` (default `<workdir>/compile_cache`; `qurl_jax.compilation`),
so a restarted run loads them instead of compiling again.
"""

from __future__ import annotations

import logging as std_logging
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file with get_config() (see configs/).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here.")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", None, "Export the final policy to this directory in Hugging Face format.")
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "HOST:PORT of process 0's coordination service (multi-process).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the run.", lower_bound=1)
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.", lower_bound=0)
_LOCAL_DEVICE_IDS = flags.DEFINE_list(
    "local_device_ids", None, "Local devices this process uses (default: all; env "
    "JAX_LOCAL_DEVICE_IDS also works).")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 100, "Seconds without a heartbeat after which a peer counts as lost "
    "and the other processes abort.", lower_bound=1)
_INIT_TIMEOUT = flags.DEFINE_integer(
    "init_timeout_s", 300, "Seconds start-up waits for every process to join.", lower_bound=1)
flags.mark_flags_as_required(["config", "workdir"])


class _QuietLibraries(std_logging.Filter):
    """Drops INFO chatter from orbax/JAX internals (one line per array on every save); warnings and
    errors still pass, and qurl_jax's own INFO lines are kept."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        noisy = any(part in record.pathname for part in ("orbax", "jax/_src", "tensorboardX"))
        return record.levelno >= std_logging.WARNING or not noisy


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad `--config.*` override reported in one line, not a traceback
    (ml_collections raises AttributeError for an unknown field, ValueError for a bad value)."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        # An unknown field arrives as AttributeError(KeyError(message)); unwrap to the message.
        cause = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
        text = cause.args[0] if isinstance(cause, KeyError) and cause.args else cause
        text = " ".join(str(text).split())
        sys.exit(f"qurl_jax: bad flag: {text}")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.get_absl_handler().addFilter(_QuietLibraries())
    from qurl_jax import distributed

    try:
        distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            [int(i) for i in _LOCAL_DEVICE_IDS.value] if _LOCAL_DEVICE_IDS.value else None,
            heartbeat_timeout_s=_HEARTBEAT.value, init_timeout_s=_INIT_TIMEOUT.value)
    except ValueError as e:
        sys.exit(f"qurl_jax: bad flag: {e}")
    if not distributed.is_primary():  # process 0 logs for the run; the others only warn
        logging.set_verbosity(logging.WARNING)
    from qurl_jax.checkpoint import CheckpointMismatchError
    from qurl_jax.config import validate

    try:
        config = validate(_CONFIG.value)
    except ValueError as e:
        sys.exit(f"qurl_jax: bad config: {e}")
    if _EXPORT_HF.value:
        config.unlock()
        config.train.export_hf = _EXPORT_HF.value
        config.lock()
    from qurl_jax import compilation
    from qurl_jax.metrics import format_summary
    from qurl_jax.trainer import Trainer

    # Before anything compiles: the memory preflight's programs and a restart's are loaded again.
    compilation.enable_persistent_cache(
        compilation.cache_dir(config.train.compilation_cache_dir, _WORKDIR.value))

    try:
        trainer = Trainer(config, _WORKDIR.value)
    except CheckpointMismatchError as e:
        sys.exit(f"qurl_jax: cannot resume: {e}")
    summary = trainer.train()
    if distributed.is_primary():
        print(format_summary(summary), flush=True)


if __name__ == "__main__":
    from qurl_jax.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    app.run(main, flags_parser=_parse_flags)
