"""Per-run plots (qurl_jax.runtime.report) from a synthetic metrics.jsonl: a resumed run (steps
logged twice), nan/inf values, evaluation rows, and metrics some runs never log."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from qurl_jax.runtime import report

REPO = Path(__file__).resolve().parents[1]
ALL_FIGURES = {"reward_accuracy.png", "response_length.png", "mismatch.png",
               "clip_fractions.png", "update.png", "time_split.png"}


def _train_row(step: int, rng: np.random.Generator) -> dict:
    t = step / 120
    row = {
        "step": step,
        "rollout/reward_mean": 0.2 + 0.5 * t + 0.05 * rng.standard_normal(),
        "rollout/accuracy": 0.15 + 0.5 * t + 0.05 * rng.standard_normal(),
        "rollout/response_len": 300 + 200 * t + 20 * rng.standard_normal(),
        # k1 is an estimator that can dip below zero; k3 spans decades.
        "kl_behav_prox_k1": 10 ** (-4 + 2 * t) * (1 + 0.5 * rng.standard_normal()) - 2e-5,
        "kl_behav_prox_k3": 10 ** (-4.5 + 2 * t + 0.2 * rng.standard_normal()),
        "logp_gap_abs_mean": 10 ** (-2 + t + 0.1 * rng.standard_normal()),
        "raw_is_weight_max": 10 ** (0.2 + 1.5 * t + 0.3 * rng.standard_normal()),
        "raw_is_weight_mean": 1 + 0.01 * rng.standard_normal(),
        "is_weight_mean": 1 + 0.005 * rng.standard_normal(),
        "truncated_frac": 1e-3 * (1 + t),
        "raw_is_ess": 0.98 - 0.1 * t,
        "clipfrac": 0.02 + 0.01 * t,
        "clipfrac_upper": 0.015 + 0.01 * t,
        "update/loss": 0.01 * rng.standard_normal(),
        "update/grad_norm": 10 ** (0.5 * rng.standard_normal()),
        "entropy": 0.8 - 0.3 * t,
        "time/rollout_s": 4.0 + rng.random(),
        "time/reward_s": 0.3,
        "time/logp_recompute_s": 1.0,
        "time/update_s": 2.0 + 0.2 * rng.random(),
        "time/step_s": 7.5,
        "time/rollout_share": 0.55,
    }
    return {k: float(v) if k != "step" else v for k, v in row.items()}


def _eval_row(step: int) -> dict:
    t = step / 120
    return {"step": step, "eval/all/avg@4": 0.3 + 0.2 * t, "eval/all/pass@4": 0.5 + 0.2 * t,
            "eval/all/greedy_acc": 0.35 + 0.15 * t, "eval/all/num_examples": 256.0,
            "eval/aime24/avg@4": 0.1 + 0.1 * t, "eval/aime24/greedy_acc": 0.1}


def _write_metrics(workdir: Path, steps: int = 120) -> None:
    """A run that stopped after step 70, resumed from its step-60 checkpoint and logged 61-70
    again (the first copies carry reward -1, which must not survive), with nan/inf values,
    metrics never logged (clipfrac_lower, time/requantize_s) and evaluations at 0, 50 and the
    end."""
    rng = np.random.default_rng(0)
    rows = [_eval_row(0)]
    for step in range(1, 71):
        rows.append({**_train_row(step, rng), "rollout/reward_mean": -1.0} if step > 60
                    else _train_row(step, rng))
        if step == 50:
            rows.append(_eval_row(50))
    for step in range(61, steps + 1):
        row = _train_row(step, rng)
        if step in (80, 81):
            row["kl_behav_prox_k3"] = "nan"
            row["update/loss"] = "nan"
        if step == 90:
            row["raw_is_weight_max"] = "inf"
        rows.append(row)
    rows.append(_eval_row(steps))
    workdir.mkdir(parents=True, exist_ok=True)
    with open(workdir / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
        f.write('{"step": 121, "rollout/rew')  # a line cut short by a killed run


def _png_size(path: str) -> tuple[int, int]:
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR", path
    return struct.unpack(">II", header[16:24])


def test_read_series_keeps_the_last_row_per_step_and_eval_rows_apart(tmp_path):
    _write_metrics(tmp_path)
    data = report.read_series(tmp_path)
    reward = data["rollout/reward_mean"]
    assert list(reward.steps) == list(range(1, 121))  # each step once, ascending
    assert (reward.values > -1).all()  # the resumed copies of 61..70 replaced the first ones
    assert 50 in data["time/rollout_s"].steps  # the eval row of step 50 kept step 50's metrics
    assert list(data["eval/all/avg@4"].steps) == [0, 50, 120]
    k3 = data["kl_behav_prox_k3"]
    assert np.isnan(k3.values[np.isin(k3.steps, [80, 81])]).all()
    assert np.isposinf(data["raw_is_weight_max"].values[data["raw_is_weight_max"].steps == 90])
    assert "clipfrac_lower" not in data and 121 not in reward.steps
    assert report.read_series(tmp_path / "missing") == {}


def test_write_plots_writes_every_figure_as_a_png(tmp_path):
    _write_metrics(tmp_path)
    paths = report.write_plots(tmp_path)
    assert {os.path.basename(p) for p in paths} == ALL_FIGURES
    for path in paths:
        assert os.path.dirname(path) == str(tmp_path / "plots")
        width, height = _png_size(path)
        assert width >= 600 and height >= 400, (path, width, height)
        assert 15_000 < os.path.getsize(path) < 2_000_000, path


def _write_short_run(workdir: Path) -> None:
    """Five steps that log only the reward and the response length."""
    rows = [{"step": s, "rollout/reward_mean": 0.1 * s, "rollout/response_len": 10.0 + s}
            for s in range(1, 6)]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_write_plots_skips_figures_whose_metrics_are_missing(tmp_path):
    _write_short_run(tmp_path)
    paths = report.write_plots(tmp_path)
    assert {os.path.basename(p) for p in paths} == {"reward_accuracy.png", "response_length.png"}
    assert report.write_plots(tmp_path / "no_run") == []


def test_entropy_logged_as_zero_is_a_note_not_a_flat_line(tmp_path):
    rows = [{"step": s, "update/loss": 0.1, "entropy": 0.0} for s in range(1, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _, entropy_ax, _ = report._update(report.read_series(tmp_path), "run").axes
    assert not entropy_ax.axison and not entropy_ax.lines
    assert "not computed" in entropy_ax.texts[0].get_text()


def test_compare_runs_draws_each_run_and_needs_the_metric(tmp_path):
    _write_metrics(tmp_path / "int8")
    _write_metrics(tmp_path / "fp8", steps=90)
    out = report.compare_runs({"int8 + ACR": tmp_path / "int8", "fp8 + TIS": tmp_path / "fp8",
                               "no metrics": tmp_path / "empty"},
                              "kl_behav_prox_k3", tmp_path / "study" / "kl.png")
    assert out == str(tmp_path / "study" / "kl.png")
    assert _png_size(out)[0] >= 600
    eval_plot = report.compare_runs({"int8": tmp_path / "int8"}, "eval/all/avg@4",
                                    tmp_path / "study" / "eval.png")
    assert os.path.getsize(eval_plot) > 10_000
    with pytest.raises(ValueError, match="no run logged"):
        report.compare_runs({"int8": tmp_path / "int8"}, "no/such_metric", tmp_path / "x.png")


def test_compare_runs_draws_the_mean_and_range_of_seeds(tmp_path):
    for seed, (offset, steps) in enumerate([(0.0, 5), (1.0, 4), (2.0, 5)]):
        workdir = tmp_path / f"s{seed}"
        workdir.mkdir()
        with open(workdir / "metrics.jsonl", "w") as f:
            for step in range(1, steps + 1):
                value = "nan" if (seed, step) == (2, 3) else step + offset
                f.write(json.dumps({"step": step, "r": value, "k": 1e-4 * step}) + "\n")
    mean, low, high = report._across_runs([report.read_series(tmp_path / f"s{i}")["r"]
                                           for i in range(3)])
    np.testing.assert_array_equal(mean.steps, [1, 2, 3, 4])  # s1 stopped at step 4
    np.testing.assert_allclose(mean.values, [2.0, 3.0, 3.5, 5.0])  # s2's nan left out at 3
    np.testing.assert_allclose(low, [1, 2, 3, 4])
    np.testing.assert_allclose(high, [3, 4, 4, 6])
    out = report.compare_runs({"fp": [tmp_path / f"s{i}" for i in range(3)],
                               "int8": tmp_path / "s0"}, ["r", "k"], tmp_path / "study.png",
                              title="study")
    assert _png_size(out)[0] >= 1200  # two panels side by side
    with pytest.raises(ValueError, match="no run logged 'x'"):
        report.compare_runs({"fp": [tmp_path / "s0"]}, ["r", "x"], tmp_path / "y.png")


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_cli_writes_the_plots_and_exits_0(tmp_path):
    _write_short_run(tmp_path)
    proc = _python("-m", "qurl_jax.runtime.report", f"--workdir={tmp_path}")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(tmp_path / "plots" / "reward_accuracy.png"),
                                   str(tmp_path / "plots" / "response_length.png")]
    proc = _python("-m", "qurl_jax.runtime.report", f"--workdir={tmp_path / 'none'}")
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr


def test_importing_report_does_not_import_matplotlib():
    proc = _python("-c", "import sys, qurl_jax.runtime.report; print('matplotlib' in sys.modules)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def _series(values, start: int = 1) -> report.Series:
    values = np.asarray(values, np.float64)
    return report.Series(np.arange(start, start + len(values)), values)


def test_the_moving_average_does_not_dip_at_the_last_step():
    """A steady 0.6 whose last step happens to score 0 is not a collapse of the run's end."""
    values = np.full(60, 0.6)
    values[-1] = 0.0
    plot = report._Plot("t")
    ax = plot.axes[0]
    plot.line(ax, _series(values), "accuracy", "linear")
    thick = [line for line in ax.lines if line.get_linewidth() > 1.5]
    assert len(thick) == 1
    # A window that shrank towards the end averaged the last step alone: 0.0 there, 0.4 before.
    # The whole window (5 steps) moves by a fifth of the outlier only, and stops 2 steps early.
    assert min(thick[0].get_ydata()) >= 0.6 - 0.6 / 5 - 1e-9
    assert thick[0].get_xdata()[-1] == 58
    raw = [line for line in ax.lines if line.get_linewidth() < 1.0]
    assert raw[0].get_ydata()[-1] == 0.0  # the thin line still shows the last step


def _time_split(steps: int) -> dict[str, report.Series]:
    rollout = np.full(steps, 2.0)
    update = np.full(steps, 1.0)
    rollout[0], update[0] = 300.0, 90.0  # the first step compiles
    programs = np.zeros(steps)
    programs[0] = 12.0
    return {"time/rollout_s": _series(rollout), "time/update_s": _series(update),
            "compile/programs": _series(programs)}


@pytest.mark.parametrize("steps", [10, 80])  # raw, and smoothed
def test_time_split_is_scaled_to_the_steps_that_compiled_nothing(steps):
    plot = report._time_split(_time_split(steps), "run")
    low, high = plot.axes[0].get_ylim()
    assert low == 0 and 3.0 <= high < 4.0  # steady steps take 3 s; the first took 390 s
    assert "compiling, off the scale: step 1: 390 s" in plot.title
