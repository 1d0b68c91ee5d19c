"""A soak of the two-process configurations: each run N times, counting hangs.

    python -m tests.multiprocess_soak --runs 20 --load 1 --out /tmp/soak

runs every configuration in `CONFIGS` `--runs` times, one run at a time (two `qurl_jax.main`
processes of 4 CPU devices each, the tiny test config of tests/test_multiprocess.py, the
collective check on), with `--load` CPU-burning processes beside them, and prints one line per run
and a table: runs, passes, hangs and wall times per configuration. A run is a hang when the stall
watchdog ended it (exit 75, `stall-*.txt` written) or it outlived `--timeout_s` (then both
processes' Python stacks are dumped to the run's directory with py-spy, when installed, and the
processes are killed). The 'sigterm' configuration sends SIGTERM to process 1 once step 2 has
finished, expects both processes to exit 143 at the same step, then resumes to the end.

The slow test `tests/test_multiprocess_hangs.py::test_soak` runs it with `QURL_JAX_SOAK_RUNS`
runs (default 1) and no load; the figures in docs/scaling.md come from the command above.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time

from qurl_jax.runtime.metrics import read_metrics
from tests import test_multiprocess
from tests.test_multiprocess import MESH, _Children

STEPS = 4
CONFIGS: dict[str, tuple[str, ...]] = {
    "static": ("--config.rollout.refill=off",),
    "refill": (),
    "paged": ("--config.rollout.kv_pages=64", "--config.rollout.kv_page_size=4"),
    "dapo": ("--config.rl.dynamic_sampling=True",),
    "minibatches": ("--config.rl.num_minibatches=2",),
    "paged_dapo_minibatches": ("--config.rollout.kv_pages=96", "--config.rollout.kv_page_size=4",
                               "--config.rollout.kv_watermark_pages=0",
                               "--config.rl.dynamic_sampling=True",
                               "--config.rl.num_minibatches=2"),
    "sigterm": (),
}


@dataclasses.dataclass
class Run:
    config: str
    index: int
    outcome: str  # 'ok', 'hang', or 'fail: ...'
    wall_s: float


def _burn() -> None:
    while True:
        pass


def _dump_stacks(procs: list[subprocess.Popen], workdir: str) -> None:
    if shutil.which("py-spy") is None:
        return
    for i, proc in enumerate(procs):
        try:
            with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
                pid = int(f.read().split()[0])  # `timeout`'s python child
        except (OSError, ValueError, IndexError):
            continue
        with open(os.path.join(workdir, f"hang-{i}.txt"), "w") as out:
            subprocess.run(["py-spy", "dump", "--pid", str(pid)], stdout=out,
                           stderr=subprocess.STDOUT, timeout=60, check=False)


def _wait(procs: list[subprocess.Popen], deadline: float) -> list[int] | None:
    while time.time() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return codes
        time.sleep(0.5)
    return None


def _start(children: _Children, workdir: str, args: tuple[str, ...], log: str
           ) -> list[subprocess.Popen]:
    return children.start_group(workdir, *MESH, f"--config.train.num_steps={STEPS}",
                                "--config.train.checkpoint_every=100", *args, num=2, logs=log)


def run_once(config: str, index: int, root: str, timeout_s: float,
             extra: tuple[str, ...] = ()) -> Run:
    workdir = os.path.join(root, f"{config}-{index}")
    shutil.rmtree(workdir, ignore_errors=True)
    children = _Children()
    start = time.time()
    try:
        procs = _start(children, workdir, CONFIGS[config] + extra, workdir + ".log")
        if config == "sigterm":
            outcome = _sigterm_then_resume(children, procs, workdir, start + timeout_s, extra)
        else:
            codes = _wait(procs, start + timeout_s)
            outcome = _outcome(codes, procs, workdir)
    finally:
        children.kill_all()
    return Run(config, index, outcome, time.time() - start)


def _outcome(codes: list[int] | None, procs: list[subprocess.Popen], workdir: str,
             expected: int = 0) -> str:
    if codes is None:
        _dump_stacks(procs, workdir)
        return "hang"
    if any(os.path.exists(os.path.join(workdir, f"stall-{i}.txt")) for i in range(2)):
        return "hang"
    if codes != [expected, expected]:
        return f"fail: exit codes {codes}"
    return "ok"


def _sigterm_then_resume(children: _Children, procs: list[subprocess.Popen], workdir: str,
                         deadline: float, extra: tuple[str, ...] = ()) -> str:
    while not any(r.get("step", 0) >= 2 and "rollout/reward_mean" in r
                  for r in read_metrics(workdir)):
        if time.time() > deadline:
            _dump_stacks(procs, workdir)
            return "hang"
        if any(p.poll() is not None for p in procs):
            return f"fail: exited before step 2 ({[p.poll() for p in procs]})"
        time.sleep(0.5)
    with open(f"/proc/{procs[1].pid}/task/{procs[1].pid}/children") as f:
        os.kill(int(f.read().split()[0]), signal.SIGTERM)
    outcome = _outcome(_wait(procs, deadline), procs, workdir, expected=143)
    if outcome != "ok":
        return outcome
    resumed = _start(children, workdir, extra, workdir + ".log.resumed")
    outcome = _outcome(_wait(resumed, deadline), resumed, workdir)
    if outcome != "ok":
        return outcome
    steps = [r["step"] for r in read_metrics(workdir) if "rollout/reward_mean" in r]
    return "ok" if steps == list(range(1, STEPS + 1)) else f"fail: steps {steps}"


def soak(configs: list[str], runs: int, load: int, root: str, timeout_s: float,
         cache_dir: str = "") -> list[Run]:
    """`runs` rounds of every configuration in `configs` (module docstring); with `cache_dir`,
    every run's processes share that persistent compilation cache (after a configuration's first
    run they load its programs instead of compiling them: shorter runs, the same dispatches)."""
    extra = (f"--config.train.compilation_cache_dir={cache_dir}",) if cache_dir else ()
    os.makedirs(root, exist_ok=True)
    # Under load a 5 s heartbeat lapses while both processes compile (an abort, not a hang).
    heartbeat, test_multiprocess.HEARTBEAT_S = test_multiprocess.HEARTBEAT_S, 60
    burners = [multiprocessing.Process(target=_burn, daemon=True) for _ in range(load)]
    for b in burners:
        b.start()
    results = []
    try:
        for index in range(runs):
            for config in configs:
                run = run_once(config, index, root, timeout_s, extra)
                results.append(run)
                print(json.dumps(dataclasses.asdict(run)), flush=True)
    finally:
        test_multiprocess.HEARTBEAT_S = heartbeat
        for b in burners:
            b.terminate()
            b.join()
    return results


def table(results: list[Run]) -> str:
    lines = [f"{'config':<24}{'runs':>6}{'ok':>6}{'hangs':>7}{'other':>7}"
             f"{'wall min/median/max s':>26}"]
    for config in dict.fromkeys(r.config for r in results):
        rs = [r for r in results if r.config == config]
        walls = sorted(r.wall_s for r in rs)
        lines.append(f"{config:<24}{len(rs):>6}{sum(r.outcome == 'ok' for r in rs):>6}"
                     f"{sum(r.outcome == 'hang' for r in rs):>7}"
                     f"{sum(r.outcome.startswith('fail') for r in rs):>7}"
                     f"{walls[0]:>10.0f}{walls[len(walls) // 2]:>8.0f}{walls[-1]:>8.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--load", type=int, default=0, help="CPU-burning processes beside")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--out", default="/tmp/qurl_jax_soak")
    parser.add_argument("--timeout_s", type=float, default=900.0)
    parser.add_argument("--cache_dir", default="",
                        help="a persistent compilation cache every run shares (default: each "
                             "run's own, in its workdir)")
    a = parser.parse_args(argv)
    configs = a.configs.split(",")
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {sorted(CONFIGS)}")
    results = soak(configs, a.runs, a.load, a.out, a.timeout_s, a.cache_dir)
    print(table(results), flush=True)
    return 0 if all(r.outcome == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
