"""Metric logging: one JSON line per step in `<workdir>/metrics.jsonl` plus TensorBoard event files.

A resumed run redoes the steps after its checkpoint, so `MetricWriter(workdir, resume_step=k)`
first drops the rows those steps wrote before the interruption (every row past step k; every row
when the run starts over from step 0) and hides the same steps' TensorBoard events: each step
appears once and end-of-run means count it once.

Values are converted to Python floats on the host once per step (one device-to-host transfer of the
whole metrics dict), never inside jitted code. `PhaseTimer` measures the wall time of the RL step's
phases (requantize, rollout, reward, logp recompute, update) with `block_until_ready` at the phase
boundary, so asynchronous dispatch does not move time from one phase into the next.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np


def to_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Fetches a flat dict of scalars to the host as Python floats."""
    host = jax.device_get(dict(metrics))
    return {k: float(np.asarray(v)) for k, v in host.items()}


def _drop_rows_after(path: str, step: int) -> None:
    """Rewrites metrics.jsonl keeping the rows of steps <= `step` (none when `step` is 0)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip()]
    kept = [line for line in lines if step and json.loads(line)["step"] <= step]
    if len(kept) == len(lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


class MetricWriter:
    """Appends step metrics to metrics.jsonl and (optionally) TensorBoard.

    `resume_step`: the step the run (re)starts from; rows and events of later steps are dropped.
    """

    def __init__(self, workdir: str, *, resume_step: int = 0, tensorboard: bool = True) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        _drop_rows_after(self.path, resume_step)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._tb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                     purge_step=resume_step + 1 if resume_step else 0)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        row = {"step": step}
        for k, v in metrics.items():
            row[k] = v if math.isfinite(v) else str(v)
        self._file.write(json.dumps(row, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if math.isfinite(v):  # TensorBoard names allow no '@'
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)
            self._tb.flush()

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """The rows of `<workdir>/metrics.jsonl` (for tests and summaries)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class PhaseTimer:
    """Accumulates seconds per named phase: `with timer.phase('rollout'): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

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
    means = summary.get("means", {})
    if means:
        lines.append("per-step means")
        lines.extend(f"  {k:<34}{v:>12.4g}" for k, v in means.items())
    width = max(len(line) for line in lines)
    return "\n".join(["=" * width, *lines, "=" * width])
