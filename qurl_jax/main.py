"""Command-line entry point: `python -m qurl_jax.main --config=configs/arith_tiny.py --workdir=...`.

Flags are parsed by absl with `ml_collections.config_flags`, so any field can be overridden
(`--config.rl.loss_mode=tis --config.rollout.precision=fp8`); `--print_config` lists every field
with its value and one-line doc and exits. Unknown or ill-typed overrides are rejected while
parsing, and `qurl_jax.config.base.validate` checks values, all before JAX compiles anything. Bad
input (`qurl_jax.runtime.errors`: a config file or field, a data file, the workdir, a mesh that does
not fit the devices, a checkpoint of another model) ends the run with one line naming it, `qurl_jax:
<what>: <message>`, and exit code 2; `--verbose` adds the traceback. A workdir that already holds a
checkpoint resumes from it. A list field also takes comma-separated values,
`--config.data.train_files=/a.jsonl,/b.jsonl` (`qurl_jax.config.overrides`).

SIGTERM (a spot VM's or scheduler's preemption notice) or Ctrl-C ends the run after the current
step with a checkpoint and the line "preempted at step N; checkpoint saved; rerun the same command
to resume", exit code 128 + the signal; a second signal aborts at once
(`qurl_jax.train.preemption`). Outside the step loop (set-up, warm start, evaluation, the first
step's compiles, the speed check) the first signal stops the run within seconds with one line and
the same exit code; checkpoints already saved are kept.

Multi-process runs (`qurl_jax.parallel.distributed`): every process runs the same command. Without
flags, `jax.distributed.initialize()` is called only where a cluster is detected (Cloud TPU VM or
GKE TPU workers, SLURM under `srun`, Open MPI, xpk GPU pods); `--coordinator_address=HOST:PORT
--num_processes=N --process_id=I` (and `--local_device_ids=0,1,...`) join one explicitly. A peer
that dies makes the others abort within `--heartbeat_timeout_s`; restarting every process resumes
from the last checkpoint. Only process 0 prints the summary and writes metrics and logs.

Compiled programs are kept in JAX's persistent compilation cache at
`config.train.compilation_cache_dir` (default `<workdir>/compile_cache`;
`qurl_jax.runtime.compilation`), so a restarted run loads them instead of compiling again.
"""

from __future__ import annotations

import os
import sys
import traceback
import uuid

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file with get_config() (see configs/).", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Checkpoints, metrics and logs go here (a local "
                               "directory or a URL such as gs://bucket/run).")
_EXPORT_HF = flags.DEFINE_string(
    "export_hf", None, "Export the final policy to this directory in Hugging Face format.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (with the overrides), each field with its "
    "one-line doc, and exit.")
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Show the traceback of bad-input errors too (always shown for bugs).")
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

_HELP_FLAGS = ("--help", "-help", "-h", "--helpshort", "--helpfull", "-?")
_USAGE = """usage: python -m qurl_jax.main --config=configs/<name>.py --workdir=DIR \\
           [--config.<section>.<field>=VALUE ...] [flags]

Every config field can be overridden as --config.<section>.<field>=VALUE. List the fields, their
values and one-line docs with

    python -m qurl_jax.main --config=configs/arith_tiny.py --print_config
"""
# Exit code of bad input (`qurl_jax.runtime.errors`), as argparse uses for bad arguments.
EXIT_BAD_INPUT = 2


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _bad_input(what: str, message: object) -> None:
    print(f"qurl_jax: {what}: {_one_line(message)}", file=sys.stderr, flush=True)
    sys.exit(EXIT_BAD_INPUT)


def _parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parsing, with a bad `--config.*` override or config file reported in one line,
    not a traceback (ml_collections raises AttributeError for an unknown field, ValueError for a
    bad value, the config file's own error when executing it fails)."""
    if any(arg in _HELP_FLAGS for arg in argv[1:]):
        print(_USAGE + "\nflags:\n" + flags.FLAGS.main_module_help(), flush=True)
        sys.exit(0)
    from qurl_jax.config.overrides import expand_lists, flag_error

    try:
        return flags.FLAGS(expand_lists(argv))  # list fields also as a,b,c
    except SyntaxError as e:
        _bad_input("bad config file", f"{e.filename}:{e.lineno}: {e.msg}")
    except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
        # An unknown field arrives as AttributeError(KeyError(message)); unwrap to the message.
        cause = e.args[0] if e.args and isinstance(e.args[0], BaseException) else e
        text = str(cause.args[0] if isinstance(cause, KeyError) and cause.args else cause)
        if text.startswith("Error whilst parsing config file"):  # raised by get_config itself
            _bad_input("bad config file", text.strip().splitlines()[-1])
        _bad_input("bad flag", flag_error(argv, text))
    except Exception as e:  # noqa: BLE001 - executing the config file failed: the user's code
        trace = traceback.extract_tb(e.__traceback__)
        where = next((f"{t.filename}:{t.lineno}: " for t in reversed(trace)
                      if t.filename == _config_path(argv)), "")
        _bad_input("bad config file", f"{where}{type(e).__name__}: {e}")
    raise AssertionError("unreachable")


def _config_path(argv: list[str]) -> str | None:
    for arg in argv:
        if arg.startswith("--config="):
            return os.path.abspath(arg.split("=", 1)[1].split(":", 1)[0])
    return None


def _check_workdir(path: str, create: bool = True) -> None:
    """Creates the workdir and checks that files can be written in it (`WorkdirError` otherwise).
    With `create` False nothing is made: an existing workdir, or a missing one's nearest
    existing parent, is probed with a file written and removed. A URL is created through fsspec
    and not probed (nothing is done for it without `create`)."""
    from qurl_jax.runtime import paths
    from qurl_jax.runtime.errors import WorkdirError

    if paths.is_url(path):
        if create:
            paths.makedirs(path)
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise WorkdirError(f"--workdir={path} is a file, not a directory")
    where = path  # the directory whose writability is probed
    if not create:
        while not os.path.exists(where):  # the nearest existing parent
            where = os.path.dirname(os.path.abspath(where))
        if not os.path.isdir(where):
            raise WorkdirError(f"--workdir={path} cannot be created: {where} is a file")
    try:
        if create:
            os.makedirs(path, exist_ok=True)
        probe = os.path.join(where, f".qurl_jax_write_probe_{uuid.uuid4().hex}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise WorkdirError(f"--workdir={path} is not writable ({e.strerror or e})") from None


def _load_config():
    """The `--config` file's config with its overrides; `ConfigError` naming the file when it
    cannot be loaded (ml_collections defers that error to the config's first use)."""
    from qurl_jax.runtime.errors import ConfigError

    config = _CONFIG.value
    if config is None:
        raise ConfigError("--config is missing: name a config file, e.g. "
                          "--config=configs/arith_tiny.py")
    try:
        config.get("seed")
    except OSError as e:
        path = config_flags.get_config_filename(flags.FLAGS["config"])
        reason = "no such file" if not os.path.exists(path) else _one_line(e.__cause__ or e)
        raise ConfigError(f"--config={path}: {reason}") from None
    return config


def main(argv: list[str]) -> None:
    """Runs the command; bad input ends it with one line (`qurl_jax.runtime.errors`), exit 2."""
    from qurl_jax.runtime.errors import UserError

    try:
        _main(argv)
    except UserError as e:
        if _VERBOSE.value:
            traceback.print_exc()
        _bad_input(e.what, e)
    except KeyboardInterrupt:
        print("qurl_jax: interrupted before training started; nothing to save", file=sys.stderr,
              flush=True)
        sys.exit(130)


def _main(argv: list[str]) -> None:
    from qurl_jax.runtime.errors import ConfigError, FlagError

    if len(argv) > 1:
        raise FlagError(f"unexpected arguments: {argv[1:]}")
    from qurl_jax.runtime.quiet import quiet_libraries

    quiet_libraries()
    from qurl_jax.config.base import format_config, ignored_fields, validate

    config = _load_config()
    if _PRINT_CONFIG.value:
        print(format_config(config), flush=True)
        return
    config = validate(config)
    if not _WORKDIR.value:
        raise ConfigError("--workdir is missing: name a directory (or gs:// URL) for the run")
    from qurl_jax.runtime import malloc, xla_cpu

    # Both before JAX starts a backend (its flags) and its threads (their arenas).
    for not_applied in (xla_cpu.apply(config.train.cpu_dots),
                        malloc.cap_arenas(config.train.malloc_arenas)):
        if not_applied:
            logging.warning("%s", not_applied)
    from qurl_jax.parallel import distributed

    try:
        distributed.initialize(
            _COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
            [int(i) for i in _LOCAL_DEVICE_IDS.value] if _LOCAL_DEVICE_IDS.value else None,
            heartbeat_timeout_s=_HEARTBEAT.value, init_timeout_s=_INIT_TIMEOUT.value)
    except ValueError as e:
        raise FlagError(str(e)) from None
    if not distributed.is_primary():  # process 0 logs for the run; the others only warn
        logging.set_verbosity(logging.WARNING)
    for warning in ignored_fields(config):
        logging.warning("%s", warning)
    if _EXPORT_HF.value:
        config.unlock()
        config.train.export_hf = _EXPORT_HF.value
        config.lock()
    from qurl_jax.parallel.sharding import check_mesh_fits
    from qurl_jax.runtime import compilation
    from qurl_jax.train import preemption

    check_mesh_fits(config.mesh)  # before the workdir or anything in it is written
    _check_workdir(_WORKDIR.value, create=False)  # at once, not after reading the data
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.train.tasks import check_task_data

    check_task_data(RunSettings.from_config(config))  # the data too, and before any INFO line
    _check_workdir(_WORKDIR.value)
    # Before anything compiles: the memory preflight's programs and a restart's are loaded again.
    compilation.enable_persistent_cache(
        compilation.cache_dir(config.train.compilation_cache_dir, _WORKDIR.value))

    guard = preemption.PreemptionGuard().install()
    try:
        _train(config, guard)
    except preemption.Stopped as e:
        guard.caught()
        print(e.line(), file=sys.stderr, flush=True)
        logging.flush()
        sys.stdout.flush()
        # Not sys.exit: the interpreter's shutdown can crash while a thread is still inside XLA
        # (a compile the signal interrupted); checkpoints and verifier processes are closed.
        os._exit(e.exit_code)


def _train(config, guard) -> None:
    """Builds the trainer (warm start included) and runs it under the preemption `guard`."""
    import jax

    from qurl_jax.parallel import distributed, program_check
    from qurl_jax.runtime import watchdog
    from qurl_jax.runtime.metrics import format_summary
    from qurl_jax.runtime.progress import Heartbeat
    from qurl_jax.train.preemption import Stopped
    from qurl_jax.train.trainer import Trainer

    # Before the trainer builds its programs, so that every one is recorded.
    check = program_check.ProgramCheck(program_check.install()) \
        if config.train.check_collectives else None
    stall = watchdog.for_run(config.train.stall_timeout_s, _WORKDIR.value,
                             jax.process_count(), jax.process_index())
    if stall:
        guard.listeners.append(lambda signum: stall.note_sigterm())
    # A line whenever the log has been silent for 50 s (a long update or compile).
    beat = Heartbeat().start() if distributed.is_primary() else None
    if beat:
        beat.doing("setting up (model, data, verifier)")
    try:
        trainer = Trainer(config, _WORKDIR.value)
        trainer.watchdog, trainer.program_check, trainer.heartbeat = stall, check, beat
        try:
            summary = trainer.train(preemption=guard)
        except Stopped:
            guard.caught()  # the listener thread leaves the ending to this handler
            trainer.checkpointer.close()  # a checkpoint still being written is finished
            trainer.task.close()  # the verifier processes
            raise
    finally:
        if beat:
            beat.stop()
    if stall:
        stall.stop()
    if summary.get("stopped") == "preempted":
        if distributed.is_primary():
            print(f"qurl_jax: preempted at step {summary['preempted']}; checkpoint saved; rerun "
                  "the same command to resume", file=sys.stderr, flush=True)
        sys.exit(guard.exit_code)
    if distributed.is_primary():
        print(format_summary(summary), flush=True)


if __name__ == "__main__":
    try:  # Ctrl-C while the libraries load (before any handler): one line, not a traceback
        from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

        use_cpu_unless_accelerator_attached()  # before JAX starts a backend
        app.run(main, flags_parser=_parse_flags)
    except KeyboardInterrupt:
        print("qurl_jax: interrupted before training started; nothing to save", file=sys.stderr,
              flush=True)
        sys.exit(130)
