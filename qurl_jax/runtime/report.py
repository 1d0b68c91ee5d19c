"""Plots of a run's `<workdir>/metrics.jsonl`, written as PNGs to `<workdir>/plots/`.

    python -m qurl_jax.runtime.report --workdir=DIR

One figure per concern, each skipped when the run logged none of its metrics:

- reward_accuracy.png: training rollouts (rollout/reward_mean, rollout/accuracy) and evaluation
  (eval/<set>/avg@k, eval/<set>/greedy_acc).
- response_length.png: rollout/response_len.
- mismatch.png: KL(behav || prox) (kl_behav_prox_k1/k3, logp_gap_abs_mean); importance weights
  (every key with "weight"); truncated / masked fractions and ESS (truncated_frac,
  masked_token_frac, vetoed_seq_frac, *_ess).
- clip_fractions.png: every key with "clipfrac".
- update.png: update/loss, pg_loss, kl_loss, entropy (a note instead when it is all 0: the learner
  computes it only for an entropy bonus); update/grad_norm.
- time_split.png: time/<phase>_s stacked (requantize, rollout, reward, logp_recompute, update),
  on the scale of the steps that compiled nothing; the compiling steps (`compile/programs` > 0)
  above it are named in the title with their seconds.

Rows: a step logged twice (a run resumed from an earlier checkpoint) keeps its last training row;
evaluation rows (only `eval/...` keys) are kept apart, so the evaluation after step k does not
replace the training metrics of step k. "nan"/"inf" values are left out of the lines. Axes whose
values span more than two decades are drawn on a log scale, and runs with many steps show the raw
points faintly under a moving average (drawn only where its whole window fits, so that the last
steps' noise does not bend it). `compare_runs` draws metrics of several runs (or of
several seeds of each variant, as their mean and range) on one figure: a study of variants.

matplotlib is imported on first use, and only its Agg canvas (no pyplot, no global backend), so
importing this module or `qurl_jax` does not need it and plotting never opens a window.
"""

from __future__ import annotations

import argparse
import fnmatch
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from etils import epath

PLOTS_DIR = "plots"
SMOOTH_MIN_POINTS = 40  # below this many points a moving average hides nothing worth hiding
TIME_PHASES = ("requantize", "rollout", "reward", "logp_recompute", "update")  # RL step order


@dataclass(frozen=True)
class Series:
    """One metric over steps: steps i64[N] ascending, values f64[N] (nan where non-finite)."""

    steps: np.ndarray
    values: np.ndarray

    @property
    def finite(self) -> np.ndarray:
        return np.isfinite(self.values)


# ------------------------------------------------------------------------------------ reading
def _to_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)  # "nan", "inf", "-inf" as MetricWriter writes them
        except ValueError:
            return None
    return None


def read_series(workdir: str | os.PathLike) -> dict[str, Series]:
    """Every numeric metric of `<workdir>/metrics.jsonl` (local or gs://) as a `Series`.

    Of the rows with the same step, the last training row and the last evaluation row win.
    """
    path = epath.Path(workdir) / "metrics.jsonl"
    if not path.exists():
        return {}
    rows: dict[tuple[int, bool], dict[str, float]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(row, dict) or _to_float(row.get("step")) is None:
            continue
        step = int(_to_float(row.pop("step")))
        values = {k: v for k, v in ((k, _to_float(v)) for k, v in row.items()) if v is not None}
        is_eval = bool(values) and all(k.startswith("eval/") for k in values)
        rows[(step, is_eval)] = values  # later rows replace earlier ones
    points: dict[str, list[tuple[int, float]]] = {}
    for (step, _), values in sorted(rows.items()):
        for key, value in values.items():
            points.setdefault(key, []).append((step, value))
    return {key: Series(np.array([s for s, _ in p], np.int64), np.array([v for _, v in p]))
            for key, p in points.items()}


# ---------------------------------------------------------------------------------- helpers
def _choose_scale(series: Iterable[Series]) -> str:
    """'log' when at least 80% of the finite values are positive and those span more than two
    decades (KL estimates, importance weights); else 'linear'."""
    values = [s.values[s.finite] for s in series]
    v = np.concatenate(values) if values else np.zeros(0)
    positive = v[v > 0]
    if positive.size < 2 or positive.size < 0.8 * v.size:
        return "linear"
    return "log" if positive.max() / positive.min() > 100 else "linear"


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centred moving average of f64[N] over `window` (odd) points, only where the whole window
    fits: f64[N - window + 1], for the points `window // 2` to `N - 1 - window // 2`. A window
    that shrank towards the ends would average the last point with itself alone, and its noise
    would read as a collapse (or a jump) of the run's last steps; the thin raw line shows them."""
    total = np.concatenate([[0.0], np.cumsum(values)])
    return (total[window:] - total[:-window]) / window


def _trimmed(steps: np.ndarray, window: int) -> np.ndarray:
    """The steps `_smooth` returns values for."""
    half = window // 2
    return steps[half: len(steps) - half]


def _steps(count: int) -> str:
    return f"{count} step" + ("" if count == 1 else "s")


def _window(num_points: int) -> int:
    """Moving-average width: 0 (raw only) for short runs, else an odd ~1/15 of the run."""
    return 0 if num_points < SMOOTH_MIN_POINTS else int(np.clip(num_points // 15, 3, 51)) | 1


class _Plot:
    """A figure of panels (Agg canvas); its title notes the moving average when one was drawn."""

    def __init__(self, title: str, rows: int = 1, cols: int = 1) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.fig = Figure(figsize=(6.4 * cols, 4.2 * rows + 0.4), dpi=110, layout="constrained")
        FigureCanvasAgg(self.fig)
        self.axes = list(self.fig.subplots(rows, cols, squeeze=False).flat)
        self.title = title
        self.window = 0
        self.drawn = False

    def line(self, ax, series: Series, label: str, scale: str, *, color: str | None = None,
             linestyle: str = "-", sparse: bool = False) -> None:
        """One metric: its points (faint under a moving average when there are many), and an x on
        the axis bottom at each step whose value was nan/inf."""
        keep = series.finite & (series.values > 0) if scale == "log" else series.finite
        steps, values = series.steps[keep], series.values[keep]
        hidden = int(series.finite.sum() - keep.sum())
        if hidden:
            label += f" ({_steps(hidden)} <= 0 not shown)"
        window = 0 if sparse else _window(len(steps))
        if window:
            (raw,) = ax.plot(steps, values, linestyle=linestyle, linewidth=0.7, alpha=0.3,
                             color=color)
            color = raw.get_color()
            # On log axes the average is geometric, so one spike does not lift the whole line.
            avg = (np.exp(_smooth(np.log(values), window)) if scale == "log"
                   else _smooth(values, window))
            ax.plot(_trimmed(steps, window), avg, linestyle=linestyle, linewidth=1.8,
                    color=color, label=label)
            self.window = max(self.window, window)
        else:
            (line,) = ax.plot(steps, values, linestyle=linestyle, linewidth=1.4, color=color,
                              marker="o" if sparse or len(steps) < 15 else None, markersize=4,
                              label=label)
            color = line.get_color()
        bad = series.steps[~series.finite]
        if bad.size:
            ax.plot(bad, np.zeros(bad.size), linestyle="none", marker="x", color=color,
                    markersize=7, clip_on=False, transform=ax.get_xaxis_transform(),
                    label=f"{label}: nan/inf ({_steps(bad.size)})")
        self.drawn = True

    def panel(self, ax, data: Mapping[str, Series], keys: Sequence[str], *, title: str,
              ylabel: str, labels: Mapping[str, str] | None = None, scale: str | None = None,
              ylim: tuple[float | None, float | None] | None = None) -> None:
        """One axes with those of `keys` the run logged; hidden when it logged none. `ylim`
        applies on a linear scale (fractions start at 0, so a flat 0 does not look like noise)."""
        keys = [k for k in dict.fromkeys(keys) if k in data]
        if not keys:
            ax.set_visible(False)
            return
        scale = scale or _choose_scale(data[k] for k in keys)
        for key in keys:
            self.line(ax, data[key], (labels or {}).get(key, key), scale)
        self.finish_axes(ax, title, ylabel, scale)
        if ylim and scale == "linear":
            low, high = ax.set_ylim(*ylim)
            ax.set_ylim(low - 0.02 * (high - low), high)  # a line at the limit stays visible

    @staticmethod
    def finish_axes(ax, title: str, ylabel: str, scale: str = "linear") -> None:
        from matplotlib.ticker import MaxNLocator

        ax.set_yscale(scale)
        if scale == "linear":  # 0.9996 rather than "-0.0004" under a "+1" offset
            ax.ticklabel_format(axis="y", useOffset=False)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel + (", log scale" if scale == "log" else ""))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, ncol=2 if len(ax.get_legend_handles_labels()[0]) > 6 else 1)

    def save(self, path: epath.Path) -> str:
        note = (f"\nthin lines: every step; thick: moving average over {self.window} steps"
                if self.window else "")
        self.fig.suptitle(self.title + note, fontsize=11)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            self.fig.savefig(f, format="png")
        return os.fspath(path)


def _matching(data: Mapping[str, Series], *patterns: str) -> list[str]:
    """Training metric names matching any glob pattern, sorted."""
    return sorted(k for k in data if not k.startswith("eval/")
                  and any(fnmatch.fnmatchcase(k, p) for p in patterns))


# ------------------------------------------------------------------------------------ figures
# Each takes the run's series and its name, and returns a _Plot, or None when nothing was logged.
def _reward_accuracy(data: Mapping[str, Series], run: str) -> _Plot | None:
    plot = _Plot(f"{run}: reward and accuracy", cols=2)
    train_ax, eval_ax = plot.axes
    plot.panel(train_ax, data, ["rollout/reward_mean", "rollout/accuracy"],
               title="training rollouts (the rollout actor, at rollout.precision)",
               ylabel="mean reward / fraction correct", scale="linear")
    pattern = re.compile(r"eval/(.+)/(avg@\d+|greedy_acc)$")
    evals = sorted((m.group(1), m.group(2), k) for k in data if (m := pattern.match(k)))
    if not evals:
        eval_ax.set_visible(False)
    else:
        sets = sorted({s for s, _, _ in evals}, key=lambda s: (s != "all", s))
        colors = {s: f"C{i % 10}" for i, s in enumerate(sets)}
        for eval_set, metric, key in evals:
            plot.line(eval_ax, data[key], f"{eval_set} {metric}", "linear",
                      color=colors[eval_set], sparse=True,
                      linestyle="--" if metric == "greedy_acc" else "-")
        plot.finish_axes(eval_ax, "evaluation of the full-precision policy "
                         "(solid: avg@k, dashed: greedy)", "fraction correct")
    return plot if plot.drawn else None


def _response_length(data: Mapping[str, Series], run: str) -> _Plot | None:
    plot = _Plot(f"{run}: response length")
    plot.panel(plot.axes[0], data, ["rollout/response_len"], labels={
        "rollout/response_len": "mean over the step's rollouts"}, title="rollout responses",
        ylabel="tokens per response", scale="linear")
    return plot if plot.drawn else None


def _mismatch(data: Mapping[str, Series], run: str) -> _Plot | None:
    plot = _Plot(f"{run}: mismatch between the rollout (behav) and learner (prox) policies",
                 rows=2, cols=2)
    kl_ax, weight_ax, frac_ax, ess_ax = plot.axes
    plot.panel(kl_ax, data, ["kl_behav_prox_k1", "kl_behav_prox_k3", "logp_gap_abs_mean"],
               title="KL(behav || prox) estimates and mean |logp_prox - logp_behav|",
               ylabel="nats per token")
    plot.panel(weight_ax, data, _matching(data, "*weight*"),
               title="importance weights pi_prox / pi_behav", ylabel="weight (1 = on-policy)")
    plot.panel(frac_ax, data, ["truncated_frac", "masked_token_frac", "vetoed_seq_frac"],
               title="weights truncated, tokens masked, sequences vetoed", ylabel="fraction",
               ylim=(0, None))
    plot.panel(ess_ax, data, _matching(data, "*ess"), title="effective sample size of the weights",
               ylabel="ESS / tokens (1 = uniform)", scale="linear", ylim=(0, 1.05))
    return plot if plot.drawn else None


def _clip_fractions(data: Mapping[str, Series], run: str) -> _Plot | None:
    plot = _Plot(f"{run}: clip fractions")
    plot.panel(plot.axes[0], data, _matching(data, "*clipfrac*"),
               title="tokens clipped by the PPO ratio bounds", ylabel="fraction of kept tokens",
               ylim=(0, None))
    return plot if plot.drawn else None


def _update(data: Mapping[str, Series], run: str) -> _Plot | None:
    plot = _Plot(f"{run}: update", cols=3)
    loss_ax, entropy_ax, norm_ax = plot.axes
    plot.panel(loss_ax, data, ["update/loss", "loss", "pg_loss", "kl_loss"], title="loss terms",
               ylabel="loss", scale="linear")
    entropy = data.get("entropy")
    if entropy is not None and not np.any(entropy.values[entropy.finite]):
        # The learner computes the entropy only for an entropy bonus and logs 0 otherwise.
        entropy_ax.text(0.5, 0.5, "policy entropy not computed\n(only with rl.entropy_coef != 0)",
                        ha="center", va="center", transform=entropy_ax.transAxes, fontsize=10)
        entropy_ax.set_axis_off()
    else:
        plot.panel(entropy_ax, data, ["entropy"], title="policy entropy on the rollout tokens",
                   ylabel="nats per token", scale="linear")
    plot.panel(norm_ax, data, ["update/grad_norm"], title="gradient norm",
               ylabel="global L2 norm")
    return plot if plot.drawn else None


def _compiling_steps(data: Mapping[str, Series], steps: np.ndarray) -> np.ndarray:
    """bool[N]: the steps that compiled (or loaded) programs (`compile/programs` > 0); their
    time is mostly the compiler's."""
    s = data.get("compile/programs")
    if s is None:
        return np.zeros(len(steps), bool)
    compiled = set(s.steps[s.finite & (s.values > 0)].tolist())
    return np.array([int(step) in compiled for step in steps], bool)


def _time_split(data: Mapping[str, Series], run: str) -> _Plot | None:
    keys = [f"time/{p}_s" for p in TIME_PHASES if f"time/{p}_s" in data]
    keys += [k for k in _matching(data, "time/*_s") if k not in keys and k != "time/step_s"]
    if not keys:
        return None
    steps = np.unique(np.concatenate([data[k].steps for k in keys]))
    stack = np.zeros((len(keys), len(steps)))  # f64[phases, steps]; a phase not logged is 0 s
    for row, key in zip(stack, keys, strict=True):
        s = data[key]
        row[np.searchsorted(steps, s.steps[s.finite])] = s.values[s.finite]
    # Each phase's summed seconds over all phases' (for the rollout: `metrics.rollout_share`, the
    # figure the end-of-run summary prints).
    share = stack.sum(axis=1) / max(stack.sum(), 1e-12)
    # The steps that compiled take minutes where the others take seconds: the axis is scaled to
    # the others (the steady state) and the compiling steps are named in the title instead.
    compiling = _compiling_steps(data, steps)
    steady = ~compiling if (~compiling).any() else np.ones(len(steps), bool)
    totals = stack.sum(axis=0)
    plot = _Plot(f"{run}: time per RL step")
    plot.window = _window(int(steady.sum()))
    if plot.window:  # the steady steps only: a compile would lift the average around it
        shown = _trimmed(steps[steady], plot.window)
        stack = np.stack([_smooth(row[steady], plot.window) for row in stack])
    else:
        shown = steps
    ax = plot.axes[0]
    ax.stackplot(shown, stack, alpha=0.85, labels=[
        f"{k.removeprefix('time/').removesuffix('_s')} ({p:.0%})" for k, p in zip(
            keys, share, strict=True)])
    plot.finish_axes(ax, "phases stacked; legend: share of all step time, compiles included",
                     "seconds")
    top = 1.15 * float(stack.sum(axis=0).max() if plot.window else totals[steady].max())
    off = [(int(step), float(t)) for step, t, c in zip(steps, totals, compiling, strict=True)
           if c and t > top]
    ax.set_ylim(0, top if off else None)
    handles, names = ax.get_legend_handles_labels()  # top of the stack first
    ax.legend(handles[::-1], names[::-1], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    if off:
        listed = ", ".join(f"step {step}: {t:.0f} s" for step, t in off[:3])
        more = f", +{len(off) - 3} more" if len(off) > 3 else ""
        plot.title += f"\ncompiling, off the scale: {listed}{more}"
    if plot.window:  # the stack is smoothed, there are no thin raw lines
        plot.title += f"\nmoving average over {plot.window} steps without compiles"
        plot.window = 0
    return plot


FIGURES = {
    "reward_accuracy.png": _reward_accuracy,
    "response_length.png": _response_length,
    "mismatch.png": _mismatch,
    "clip_fractions.png": _clip_fractions,
    "update.png": _update,
    "time_split.png": _time_split,
}


# --------------------------------------------------------------------------------- public API
def write_plots(workdir: str | os.PathLike) -> list[str]:
    """Writes the PNGs of `<workdir>/metrics.jsonl` to `<workdir>/plots/`; returns their paths.

    A figure whose metrics the run did not log is not written; no metrics file, no plots.
    """
    data = read_series(workdir)
    if not data:
        return []
    out_dir = epath.Path(workdir) / PLOTS_DIR
    run = epath.Path(workdir).name or os.fspath(workdir)
    written = []
    for name, make in FIGURES.items():
        plot = make(data, run)
        if plot is not None:
            written.append(plot.save(out_dir / name))
    return written


def _across_runs(series: Sequence[Series]) -> tuple[Series, np.ndarray, np.ndarray]:
    """The mean of several runs' series over the steps every run logged, with their min and max
    (a run's nan at a step is left out of that step's mean; the run's own plots mark it)."""
    steps = functools.reduce(np.intersect1d, [s.steps for s in series])
    values = np.stack([s.values[np.searchsorted(s.steps, steps)] for s in series])
    with np.errstate(all="ignore"):
        finite = np.where(np.isfinite(values), values, np.nan)
        mean = np.nanmean(finite, axis=0) if len(steps) else np.zeros(0)
        low, high = np.nanmin(finite, axis=0), np.nanmax(finite, axis=0)
    return Series(steps, mean), low, high


def compare_runs(runs: Mapping[str, str | os.PathLike | Sequence[str | os.PathLike]],
                 metric: str | Sequence[str], path: str | os.PathLike, *,
                 title: str | None = None) -> str:
    """Metrics of several runs on one figure (a study of variants); returns the path written.

    Args:
      runs: legend label -> a workdir, or a list of workdirs (seeds of one variant: their mean
        is drawn, with their min-max range shaded), in drawing order.
      metric: a metrics.jsonl key, e.g. "rollout/reward_mean" or "eval/all/avg@32", or a list of
        keys: one panel each, two per row.
      path: the PNG to write (local or gs://).
      title: figure title (default: the metric).

    Raises:
      ValueError: no run logged one of the metrics.
    """
    metrics = [metric] if isinstance(metric, str) else list(metric)
    groups = {label: [w] if isinstance(w, str | os.PathLike) else list(w)
              for label, w in runs.items()}
    data = {w: read_series(w) for ws in groups.values() for w in ws}
    cols = min(len(metrics), 2)
    plot = _Plot(title or ", ".join(metrics), rows=-(-len(metrics) // cols), cols=cols)
    for ax in plot.axes[len(metrics):]:
        ax.set_visible(False)
    names = {label: label + (f" (mean of {len(ws)})" if len(ws) > 1 else "")
             for label, ws in groups.items()}
    styles = {label: dict(color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
              for i, label in enumerate(groups)}
    for ax, key in zip(plot.axes, metrics):
        found = {label: [s for w in ws if (s := data[w].get(key)) is not None]
                 for label, ws in groups.items()}
        found = {label: s for label, s in found.items() if s}
        if not found:
            raise ValueError(f"compare_runs: no run logged {key!r} (runs: {dict(runs)})")
        scale = _choose_scale(s for ss in found.values() for s in ss)
        for label, ss in found.items():
            mean, low, high = _across_runs(ss) if len(ss) > 1 else (ss[0], None, None)
            plot.line(ax, mean, names[label], scale, **styles[label],
                      sparse=key.startswith("eval/"))
            if low is not None:
                ax.fill_between(mean.steps, low, high, color=styles[label]["color"], alpha=0.12,
                                linewidth=0)
        missing = [label for label in groups if label not in found]
        note = key + (f"; not logged by: {', '.join(missing)}" if missing else "")
        plot.finish_axes(ax, note, key, scale)
        # The variants are named once, under the panels; a panel keeps the entries that say more
        # than a name (points hidden on a log scale, nan/inf markers).
        extra = [(h, t) for h, t in zip(*ax.get_legend_handles_labels())
                 if t not in names.values()]
        ax.get_legend().remove()
        if extra:
            ax.legend(*zip(*extra), fontsize=7)
    from matplotlib.lines import Line2D

    shaded = any(len(ws) > 1 for ws in groups.values())
    plot.fig.legend(handles=[Line2D([], [], linewidth=1.8, label=names[label], **styles[label])
                             for label in groups],
                    loc="outside lower center", ncol=2 if len(groups) > 3 else len(groups),
                    fontsize=8, title="shaded: min-max over seeds" if shaded else None,
                    title_fontsize=8)
    return plot.save(epath.Path(path))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qurl_jax.runtime.report",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", required=True, help="run directory with metrics.jsonl")
    args = parser.parse_args(argv)
    if not (epath.Path(args.workdir) / "metrics.jsonl").exists():
        parser.error(f"no metrics.jsonl in {args.workdir}")
    for path in write_plots(args.workdir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
