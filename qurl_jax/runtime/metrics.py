"""Metric logging: one JSON line per step in `<workdir>/metrics.jsonl`, TensorBoard event files and,
optionally (`train.loggers`), a Weights & Biases run.

A resumed run redoes the steps after its checkpoint, so `MetricWriter(workdir, resume_step=k)`
first drops the rows those steps wrote before the interruption (every row past step k; every row
when the run starts over from step 0) and hides the same steps' TensorBoard events: each step
appears once and end-of-run means count it once.

Values are converted to Python floats on the host once per step (one device-to-host transfer of the
whole metrics dict), never inside jitted code. `PhaseTimer` measures the wall time of the RL step's
phases (requantize, rollout, reward, logp recompute, update) with `block_until_ready` at the phase
boundary, so asynchronous dispatch does not move time from one phase into the next.

Workdirs may be URLs (`gs://bucket/run`, through fsspec/gcsfs): an object store cannot append,
so there the whole metrics.jsonl is rewritten after each step (it is small). In a multi-process
run only process 0 writes (`MetricWriter(..., enabled=False)` elsewhere).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

import fsspec
import jax
import numpy as np
from absl import logging

from qurl_jax.runtime.paths import is_url, join, local_abspath  # noqa: F401 - re-exported


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Fetches a flat dict of scalars to the host as Python floats."""
    host = jax.device_get(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in host.items()}


def _read_lines(path: str) -> list[str] | None:
    """The non-empty lines of a text file (local or URL), or None when it does not exist."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    if not fs.exists(fs_path):
        return None
    with fs.open(fs_path, "r", encoding="utf-8") as f:
        return [line for line in f if line.strip()]


def _drop_rows_after(path: str, step: int) -> list[str]:
    """Rewrites metrics.jsonl keeping the rows of steps <= `step` (none when `step` is 0);
    returns the kept lines."""
    lines = _read_lines(path)
    if lines is None:
        return []
    kept = [line for line in lines if step and json.loads(line)["step"] <= step]
    if len(kept) == len(lines):
        return kept
    if is_url(path):
        with fsspec.open(path, "w", encoding="utf-8") as f:
            f.writelines(kept)
        return kept
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    return kept


def _summary_writer() -> Any:
    """tensorboardX's `SummaryWriter`, imported without torch.

    tensorboardX imports torch when it is installed (the README's set-up installs it for the
    parity tests), only to accept torch tensors, which this library never passes: on an idle
    2-core AVX2 CPU the import took 2.35-2.41 s with torch and 0.52-0.62 s without (three each,
    alternating), and 180 MB more resident memory, at every run's start. Unless this process has
    imported torch already, `import torch` fails for the duration of the import (a None entry in
    `sys.modules`, which tensorboardX's `except ImportError` takes), then works again.
    """
    if "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        from tensorboardX import SummaryWriter
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
    return SummaryWriter


class MetricWriter:
    """Appends step metrics to metrics.jsonl and (optionally) TensorBoard.

    `resume_step`: the step the run (re)starts from; rows and events of later steps are dropped.
    `enabled`: False makes every method a no-op (the processes other than 0 of a multi-process
    run, which touch nothing in the workdir).
    """

    def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True,
                 enabled: bool = True, wandb_project: str | None = None) -> None:
        self.enabled = enabled
        self.path = join(workdir, "metrics.jsonl")
        self._file = self._tb = self._wandb = None
        if not enabled:
            return
        if wandb_project:
            self._wandb = _wandb_run(workdir, wandb_project)
        fs, fs_path = fsspec.core.url_to_fs(workdir)
        fs.makedirs(fs_path, exist_ok=True)
        kept = _drop_rows_after(self.path, resume_step)
        # An object store cannot append: keep the rows and rewrite the object on every write.
        self._rows = kept if is_url(self.path) else None
        if self._rows is None:
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        if tensorboard:
            self._tb = _summary_writer()(join(workdir, "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else 0)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        row = {"step": step}
        for k, v in metrics.items():
            row[k] = v if math.isfinite(v) else str(v)
        line = json.dumps(row, sort_keys=True) + "\n"
        if self._rows is not None:
            self._rows.append(line)
            with fsspec.open(self.path, "w", encoding="utf-8") as f:
                f.writelines(self._rows)
        else:
            self._file.write(line)
            self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):  # TensorBoard names allow no '@'
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if math.isfinite(v)}, step=step)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run(workdir: str, project: str) -> Any:
    """A Weights & Biases run for `workdir` (the same run id on every restart, so a resumed run
    continues it; `WANDB_MODE=offline` keeps it on disk), or None with one warning line when the
    `wandb` package is not installed."""
    try:
        import wandb
    except ImportError:
        logging.warning("train.loggers names 'wandb' but the wandb package is not installed "
                        "(pip install wandb); logging to metrics.jsonl and TensorBoard only")
        return None
    run_id = hashlib.sha256(local_abspath(workdir).encode()).hexdigest()[:16]
    local = None if is_url(workdir) else workdir  # wandb keeps its files on a local disk
    return wandb.init(project=project, id=run_id, resume="allow", dir=local,
                      name=os.path.basename(workdir.rstrip("/")))


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The rows of `<workdir>/metrics.jsonl` (for tests and summaries); a URL workdir too."""
    return [json.loads(line) for line in _read_lines(join(workdir, "metrics.jsonl")) or []]


def rollout_share(rows: list[Mapping[str, Any]]) -> float:
    """The rollout's share of all step time over `rows` (metrics.jsonl rows): the summed
    `time/rollout_s` over the summed `time/step_s`. The one definition that the end-of-run summary
    and time_split.png's legend both show (a step's own share is `time/rollout_share`)."""
    rollout = sum(float(r.get("time/rollout_s", 0.0)) for r in rows if "time/step_s" in r)
    total = sum(float(r["time/step_s"]) for r in rows if "time/step_s" in r)
    return rollout / total if total > 0 else math.nan


def eval_at(rows: list[Mapping[str, Any]], step: int) -> dict[str, float]:
    """The evaluation metrics logged at `step` ('eval/' prefix dropped), e.g. the before-RL
    evaluation (step 0) that a resumed run reads back for its summary."""
    return {k.removeprefix("eval/"): float(v) for r in rows if r.get("step") == step
            for k, v in r.items() if k.startswith("eval/")}


class PhaseTimer:
    """Accumulates seconds per named phase: `with timer.phase('rollout'): ...`.

    listeners: each told when each phase starts and ends (`enter(name)` / `leave(name)`), e.g.
    the stall watchdog (`qurl_jax.runtime.watchdog.StallWatchdog`); None entries are skipped.
    """

    def __init__(self, *listeners: Any) -> None:
        self.seconds: dict[str, float] = {}
        self.listeners = [x for x in listeners if x is not None]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        for listener in self.listeners:
            listener.enter(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            for listener in self.listeners:
                listener.leave(name)

    def metrics(self, prefix: str = "time/") -> dict[str, float]:
        total = sum(self.seconds.values())
        out = {f"{prefix}{k}_s": v for k, v in self.seconds.items()}
        out[f"{prefix}step_s"] = total
        return out


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run table: evaluation before/after RL, time split, rollout speed, mismatch."""
    lines = [f"run: steps {summary.get('start_step', 0)} -> {summary.get('end_step')}"
             + (f" (stopped: {summary['stopped']})" if summary.get("stopped") else "")]
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    if after:
        lines.append(f"{'evaluation':<36}{'before RL':>12}{'after RL':>12}{'change':>12}")
        for k in sorted(after):
            if k.endswith("num_examples"):
                continue
            b, a = before.get(k, math.nan), after[k]
            lines.append(f"{k:<36}{b:>12.4f}{a:>12.4f}{a - b:>+12.4f}")
    speed = summary.get("rollout_speed", {})
    if speed:
        lines.append("rollout speed (tokens/s, same prompts and lengths)")
        lines.extend(f"  {k:<34}{v:>12.1f}" for k, v in speed.items() if k != "speedup")
        if "speedup" in speed:
            lines.append(f"  {'quantized / fp32':<34}{speed['speedup']:>12.2f}x")
    comp = summary.get("compile", {})
    if comp:
        lines.append(f"compile: {comp['programs']:.0f} programs, {comp['seconds']:.1f} s "
                     f"(persistent cache: {comp['cache_hits']:.0f} loaded, "
                     f"{comp['saved_s']:.1f} s saved)")
    last = summary.get("last") or {}
    failed = {k.removeprefix("verifier/"): v for k, v in last.items()
              if k.startswith("verifier/") and v}
    if failed:  # counts over the run: the reward's failures scored 0 (the log has the first)
        lines.append("reward calls failed (scored 0): " + ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(failed.items())))
    means = summary.get("means", {})
    if means:
        lines.append("per-step means")
        lines.extend(f"  {k:<34}{v:>12.4g}" for k, v in means.items())
    width = max(len(line) for line in lines)
    return "\n".join(["=" * width, *lines, "=" * width])
