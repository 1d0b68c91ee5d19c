"""Runs the accelerator test selection on whatever JAX sees and streams the results to a folder.

    python -m tests.accelerator OUTDIR [--dtype bfloat16|float32] [--workers N] [--budget S]
                                       [--cache-dir DIR] [--files F ...] [pytest args, e.g. -k x]
    ./test.sh --accelerator OUTDIR [same options]

Unlike the default suite (tests/conftest.py: JAX_PLATFORMS=cpu and 8 host devices), nothing is
forced: the tests run on the GPU, TPU or CPU that JAX picks, with its real device count; tests
that need more devices are skipped with the reason. The tests that take the `precision` fixture
compute in `--dtype` (bfloat16 by default, the accelerator's compute dtype) with the tolerances of
tests/tolerances.py; the rest run in float32 with matmuls at full precision.

What runs: tests/accelerator_selection.py (FILES minus EXCLUDE), or `--files`. Results go to
OUTDIR as they come (tests/accelerator_plugin.py): summary.txt, junit.xml, failures.txt,
selection.txt; a run killed mid-way leaves the results it finished. Tests not started within
`--budget` seconds are skipped with the reason, so the files are complete before a lease's command
limit. Compiled programs go to JAX's persistent cache (`--cache-dir`), so a second run in the same
lease skips most compiles.

Exit status: pytest's (0 all passed, 1 some failed), 2 for bad arguments or no working JAX.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One process per host owns a TPU; on a GPU, processes share it with a slice of its memory each.
_DEFAULT_WORKERS = {"tpu": 1, "gpu": 4, "cpu": 2}

_PROBE = """
import json, jax
d = jax.devices()
print(json.dumps({"platform": jax.default_backend(), "devices": len(d),
                  "device_kind": d[0].device_kind, "jax": jax.__version__}))
"""


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m tests.accelerator", allow_abbrev=False,
        description="Run the accelerator test selection; results stream to OUTDIR.")
    parser.add_argument("outdir", type=Path, help="folder for summary.txt, junit.xml, ...")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="compute dtype of the tests that take the `precision` fixture")
    parser.add_argument("--workers", type=int, default=None,
                        help="pytest-xdist processes, one test file each (default: 4 on a GPU, "
                             "1 on a TPU, 2 on a CPU)")
    parser.add_argument("--budget", type=float, default=420.0,
                        help="seconds after which tests not yet started are skipped (default 420)")
    parser.add_argument("--cache-dir", type=Path,
                        default=Path.home() / ".cache" / "qurl_jax" / "jax_compilation_cache",
                        help="JAX persistent compilation cache")
    parser.add_argument("--files", nargs="+", default=None,
                        help="test files to run instead of tests/accelerator_selection.py FILES")
    args, pytest_args = parser.parse_known_args(argv)
    if args.workers is not None and args.workers < 1:
        parser.error(f"--workers={args.workers} must be >= 1")
    if args.budget <= 0:
        parser.error(f"--budget={args.budget} must be > 0")
    return args, pytest_args


def _probe(env: dict[str, str]) -> dict:
    """Platform and devices, asked in a child process (a TPU is held by the process that opens
    it, and must be free for the test processes)."""
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
        sys.exit(f"tests.accelerator: error: JAX could not start: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _xdist_can_keep_file_order() -> bool:
    """Whether this pytest-xdist has --no-loadscope-reorder (it sends the largest file first
    otherwise, and the selection's priority order is lost)."""
    spec = importlib.util.find_spec("xdist.plugin")
    return spec is not None and "--no-loadscope-reorder" in Path(spec.origin).read_text()


def main(argv: list[str]) -> None:
    args, pytest_args = _parse(argv)
    from tests.accelerator_selection import FILES

    files = args.files or list(FILES)
    missing = [f for f in files if not (ROOT / f).exists() and not Path(f).exists()]
    if missing:
        sys.exit(f"tests.accelerator: error: --files: no such file: {', '.join(missing)}")
    # pytest runs in the repository root: paths relative to it stay, others become absolute.
    files = [f if (ROOT / f).exists() else str(Path(f).resolve()) for f in files]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    info = _probe(env)
    workers = args.workers or _DEFAULT_WORKERS.get(info["platform"], 1)
    if importlib.util.find_spec("xdist") is None:
        workers = 1
    outdir = args.outdir.resolve()
    outdir.mkdir(parents=True, exist_ok=True)
    info.update(compute_dtype=args.dtype, workers=workers, budget_s=args.budget,
                started=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    env.update(
        QURL_TEST_ACCELERATOR="1",
        QURL_TEST_COMPUTE_DTYPE=args.dtype,
        QURL_ACCELERATOR_OUT=str(outdir),
        QURL_ACCELERATOR_INFO=json.dumps(info),
        QURL_ACCELERATOR_DEADLINE=str(time.time() + args.budget),
        QURL_ACCELERATOR_SELECT="1",
        JAX_COMPILATION_CACHE_DIR=str(args.cache_dir.resolve()),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
    )
    if info["platform"] == "gpu" and workers > 1:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{0.9 / workers:.2f}")
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.accelerator_plugin", "-q", "-rfE",
           "-m", "not slow", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(workers), "--dist", "loadfile"] if workers > 1 else ["-n", "0"]
        if workers > 1 and _xdist_can_keep_file_order():
            cmd.append("--no-loadscope-reorder")  # files in priority order, not largest first
    cmd += files + pytest_args
    print(f"tests.accelerator: {info}\n+ {' '.join(cmd)}", flush=True)
    os.chdir(ROOT)
    os.execvpe(cmd[0], cmd, env)


if __name__ == "__main__":
    main(sys.argv[1:])
