"""The rollout-precision study: one RL run under each rollout precision, correction and KV cache.

    python -m qurl_jax.study --config=configs/chain_tiny.py --out=/tmp/study
    python -m qurl_jax.study --config=configs/chain_tiny.py --out=/tmp/quick --quick

Every variant runs the same config (the reasoning-chain task by default) from the same warm start,
built once under `<out>/warm_start` and loaded by every run as `model.source=hf` (a config of a
real checkpoint, `hf` or `gguf`, starts every run from it as it is), with the same
train / held-out split (`data.split_seed`); a variant changes only the fields listed in `VARIANTS`,
and the rows marked * run under every seed (`--seeds`), the others under the first. Nothing is
tuned per variant. Each run is a `python -m qurl_jax.main` subprocess writing to
`<out>/runs/<variant>_s<seed>` (`--jobs` at a time), so a run is what a user gets from the same
command, with its own log, metrics and plots; the runs share one compilation cache
(`<out>/compile_cache`), so a program compiled by one run is loaded by the next. A finished run
is not run again: rerunning the command after a crash goes on where it stopped (an unfinished run
resumes from its checkpoint); a finished run made with another command (other steps, config or
variant) stops the study instead of being reused.

Written to `<out>`:
- `study.md`: the table, mean +- std over seeds: held-out accuracy after RL (greedy and Avg@k per
  evaluation set), training reward (mean of the last quarter of the steps), KL(behav || prox) k3,
  clip and truncated fractions, vetoed sequences, the update-capture fraction of the quantized
  actor, step and rollout seconds (steps after the first, which compiles);
- `study.json`: the same per run and per variant;
- `plots/*.png`: reward, rollout accuracy and mismatch against step, one figure per comparison.

`--quick` runs two variants, one seed and two steps of a shrunk run (its test is
tests/test_study.py). Measured results: docs/study.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from qurl_jax.config.base import load_config_file, validate
from qurl_jax.runtime import report

RKV = {"rollout.kv_policy": "rkv", "rollout.kv_budget": 64, "rollout.kv_interval": 16}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the study: config fields it sets on top of the base config."""

    name: str
    overrides: Mapping[str, Any]
    seeded: bool  # * rows: run under every seed
    label: str


VARIANTS = (
    Variant("fp", {"rollout.precision": "fp"}, True, "fp rollout (reference)"),
    Variant("int8_naive", {"rollout.precision": "int8", "rl.loss_mode": "naive"}, True,
            "int8 rollout, naive"),
    Variant("int8_tis", {"rollout.precision": "int8", "rl.loss_mode": "tis"}, True,
            "int8 rollout, TIS"),
    Variant("int8_acr", {"rollout.precision": "int8", "rl.loss_mode": "acr"}, True,
            "int8 rollout, ACR (s = 1)"),
    Variant("int8_kv8_naive", {"rollout.precision": "int8", "rollout.kv_precision": "int8",
                               "rl.loss_mode": "naive"}, True,
            "int8 rollout + int8 KV cache, naive"),
    Variant("int8_kv8_acr", {"rollout.precision": "int8", "rollout.kv_precision": "int8",
                             "rl.loss_mode": "acr"}, True,
            "int8 rollout + int8 KV cache, ACR"),
    Variant("int8_acr_s1.5", {"rollout.precision": "int8", "rl.loss_mode": "acr",
                              "rollout.invariant_scaling": 1.5}, False,
            "int8 rollout, ACR, invariant scaling s = 1.5"),
    Variant("fp8_naive", {"rollout.precision": "fp8", "rl.loss_mode": "naive"}, True,
            "fp8 rollout, naive"),
    Variant("fp8_tis", {"rollout.precision": "fp8", "rl.loss_mode": "tis"}, True,
            "fp8 rollout, TIS"),
    Variant("fp8_acr", {"rollout.precision": "fp8", "rl.loss_mode": "acr"}, True,
            "fp8 rollout, ACR"),
    # Both fp8_block rows keep the vocabulary tables in the compute dtype, as the Jet-RL config
    # does: its learner does not quantize them, so int8 tables in the rollout alone would put an
    # uncorrected mismatch into the unified flow.
    Variant("fp_train_fp8_block_rollout", {"rollout.precision": "fp8_block",
                                           "rollout.quantize_vocab": False,
                                           "rl.loss_mode": "naive"}, False,
            "fp train + fp8_block rollout, naive"),
    Variant("jetrl_fp8_block", {"rollout.precision": "fp8_block", "train.precision": "fp8_block",
                                "rollout.quantize_vocab": False, "rl.loss_mode": "naive"}, False,
            "fp8_block train + rollout (Jet-RL), naive"),
    # The same with exact on-policy numerics: pi_behav == pi_prox bit for bit (models.exact).
    Variant("jetrl_fp8_block_exact", {"rollout.precision": "fp8_block",
                                      "train.precision": "fp8_block",
                                      "rollout.quantize_vocab": False, "rl.loss_mode": "naive",
                                      "train.on_policy_numerics": "exact"}, False,
            "fp8_block train + rollout (Jet-RL), exact numerics, naive"),
    Variant("rkv_tis", {**RKV, "rl.loss_mode": "tis"}, False,
            "rkv rollout, uncorrected (TIS on the sparse log-probs)"),
    Variant("rkv_sparse_rl", {**RKV, "rl.loss_mode": "sparse_rl"}, True,
            "rkv rollout, Sparse-RL correction"),
    Variant("int8_rkv_acr_sparse_rl", {**RKV, "rollout.precision": "int8",
                                       "rl.loss_mode": "sparse_rl", "rl.sparse_base": "acr"},
            False, "int8 + rkv rollout, Sparse-RL with ACR"),
)
QUICK_VARIANTS = ("fp", "int8_acr")
# The figures: file -> (title, variants, metrics).
FIGURES = {
    "study.png": ("Rollout precision and correction: training reward and mismatch", (
        "fp", "int8_naive", "int8_acr", "fp8_naive", "fp8_tis", "fp8_acr", "rkv_tis",
        "rkv_sparse_rl"), ("rollout/reward_mean", "kl_behav_prox_k3")),
    "quantized.png": ("Quantized rollouts: naive, TIS, ACR", (
        "fp", "int8_naive", "int8_tis", "int8_acr", "fp8_naive", "fp8_tis", "fp8_acr"),
        ("rollout/reward_mean", "rollout/accuracy", "kl_behav_prox_k3", "truncated_frac")),
    "kv_quant.png": ("8-bit KV cache: int8 weights alone vs int8 weights + int8 KV", (
        "fp", "int8_naive", "int8_acr", "int8_kv8_naive", "int8_kv8_acr"),
        ("rollout/reward_mean", "kl_behav_prox_k3")),
    "invariant_scaling.png": ("Invariant scaling: int8 + ACR with s = 1 and s = 1.5", (
        "int8_acr", "int8_acr_s1.5"), ("rollout/reward_mean", "quant/code_change_fraction",
                                       "kl_behav_prox_k3")),
    "jetrl.png": ("Jet-RL: fp train + fp8_block rollout vs the unified fp8_block flow", (
        "fp", "fp_train_fp8_block_rollout", "jetrl_fp8_block", "jetrl_fp8_block_exact"),
        ("kl_behav_prox_k3", "rollout/reward_mean")),
    "sparse_rl.png": ("Sparse-RL: rkv rollout (budget 64), uncorrected vs corrected", (
        "fp", "rkv_tis", "rkv_sparse_rl", "int8_rkv_acr_sparse_rl"),
        ("rollout/reward_mean", "kl_behav_prox_k3", "vetoed_seq_frac")),
}
# Metrics averaged over the steps after the first (which compiles) for the table.
STEP_MEANS = ("kl_behav_prox_k3", "clipfrac", "truncated_frac", "vetoed_seq_frac",
              "quant/code_change_fraction", "time/step_s", "time/rollout_s")
COLUMNS = (  # table column -> (summary key, format)
    ("reward", "reward_last_quarter", ".3f"),
    ("KL k3", "kl_behav_prox_k3", ".1e"),
    ("clipfrac", "clipfrac", ".1e"),
    ("truncated", "truncated_frac", ".1e"),
    ("vetoed seqs", "vetoed_sequences", ".0f"),
    ("capture", "quant/code_change_fraction", ".3f"),
    ("step s", "time/step_s", ".2f"),
    ("rollout s", "time/rollout_s", ".2f"),
)
DONE = "study_done.json"


# What --quick's table says about itself: its numbers check the machinery, not the method.
QUICK_NOTE = ("--quick is a smoke test: two RL steps after a 30-step warm start, so accuracy "
              "columns of 0.000 are expected; they show that every variant runs end to end, not "
              "what a variant does. Run without --quick for the study.")


def quick_overrides() -> dict[str, Any]:
    """What --quick shrinks: a short warm start, two steps of a small batch, a small evaluation."""
    return {"sft.steps": 30, "data.prompts_per_step": 4, "rollout.n": 4, "train.num_steps": 2,
            "rollout.max_new_tokens": 48, "eval.max_new_tokens": 48, "eval.max_examples": 8,
            "eval.k": 2, "rl.num_minibatches": 1}


def build_warm_start(config_path: str, out: str, base: Mapping[str, Any]) -> str:
    """Builds (or reuses) the warm start every run loads; returns its Hugging Face directory."""
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.train import tasks

    c = load_config_file(config_path)
    c.update_from_flattened_dict(dict(base))
    if c.model.source != "tiny":
        return c.model.path  # a real checkpoint: every run starts from it as it is
    validate(c)
    workdir = os.path.join(out, "warm_start")
    _, _, task = tasks.build_model_and_task(RunSettings.from_config(c), workdir)
    task.close()
    return os.path.join(workdir, "sft_model")


@dataclasses.dataclass
class Run:
    variant: Variant
    seed: int
    workdir: str

    @property
    def name(self) -> str:
        return f"{self.variant.name}_s{self.seed}"

    def done(self) -> dict[str, Any] | None:
        path = os.path.join(self.workdir, DONE)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)


def _flag(field: str, value: Any) -> str:
    return f"--config.{field}={value}"


def command(config_path: str, run: Run, overrides: Mapping[str, Any]) -> list[str]:
    return [sys.executable, "-m", "qurl_jax.main", f"--config={config_path}",
            f"--workdir={run.workdir}", *(_flag(k, v) for k, v in overrides.items())]


def run_all(runs: Sequence[Run], commands: Mapping[str, list[str]], jobs: int) -> None:
    """Runs the commands of the unfinished runs, `jobs` at a time, and marks each finished one."""
    waiting = [r for r in runs if r.done() is None]
    active: list[tuple[Run, subprocess.Popen, float, Any]] = []
    total, finished = len(waiting), 0
    while waiting or active:
        while waiting and len(active) < jobs:
            run = waiting.pop(0)
            os.makedirs(run.workdir, exist_ok=True)
            log = open(os.path.join(run.workdir, "log.txt"), "a", encoding="utf-8")
            print(f"[study] start {run.name}", flush=True)
            proc = subprocess.Popen(commands[run.name], stdout=log, stderr=subprocess.STDOUT)
            active.append((run, proc, time.monotonic(), log))
        time.sleep(0.5)
        for item in list(active):
            run, proc, start, log = item
            if proc.poll() is None:
                continue
            active.remove(item)
            log.close()
            finished += 1
            wall = time.monotonic() - start
            print(f"[study] {finished}/{total} {run.name}: exit {proc.returncode}, "
                  f"{wall:.0f} s", flush=True)
            if proc.returncode == 0:
                with open(os.path.join(run.workdir, DONE), "w", encoding="utf-8") as f:
                    json.dump({"wall_s": wall, "command": commands[run.name]}, f, indent=1)


def summarize_run(workdir: str) -> dict[str, float]:
    """The table's numbers of one finished run, from its metrics.jsonl."""
    data = report.read_series(workdir)
    out: dict[str, float] = {}
    for key, s in data.items():
        if key.startswith("eval/") and (key.endswith("/greedy_acc") or "/avg@" in key):
            out[key] = float(s.values[-1])  # the evaluation after RL
    reward = data.get("rollout/reward_mean")
    if reward is not None:
        tail = reward.values[-max(1, len(reward.values) // 4):]
        out["reward_last_quarter"] = float(np.nanmean(tail))
    for key in STEP_MEANS:
        s = data.get(key)
        if s is not None:
            values = s.values[s.steps > 1] if (s.steps > 1).any() else s.values
            out[key] = float(np.nanmean(values))
    vetoed = data.get("sparse/vetoed_sequences")
    if vetoed is not None:
        out["vetoed_sequences"] = float(np.nansum(vetoed.values))
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def aggregate(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per variant: its seeds' summaries and the mean and std of each number."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.done() is None:
            continue
        entry = out.setdefault(run.variant.name, {"label": run.variant.label, "runs": {}})
        entry["runs"][run.name] = summarize_run(run.workdir)
    for entry in out.values():
        keys = sorted({k for s in entry["runs"].values() for k in s})
        entry["mean_std"] = {k: _mean_std([s[k] for s in entry["runs"].values() if k in s])
                             for k in keys}
    return out


def _cell(stats: tuple[float, float] | None, fmt: str, seeds: int) -> str:
    if stats is None or not math.isfinite(stats[0]):
        return "-"
    mean, std = stats
    return f"{mean:{fmt}}" + (f" ± {std:{fmt}}" if seeds > 1 else "")


def table(results: Mapping[str, dict[str, Any]], before: Mapping[str, float]) -> str:
    """The markdown table: one row per variant, the warm start's evaluation first."""
    eval_keys = sorted({k for r in results.values() for k in r["mean_std"]
                        if k.startswith("eval/")}, key=lambda k: (k.count("carry"), k))
    head = ["variant", "seeds", *(k.removeprefix("eval/").replace("/", " ") for k in eval_keys),
            *(c for c, _, _ in COLUMNS)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if before:
        lines.append("| " + " | ".join(["warm start (before RL)", "", *(
            f"{before[k]:.3f}" if k in before else "-" for k in eval_keys),
            *("" for _ in COLUMNS)]) + " |")
    for variant in VARIANTS:
        r = results.get(variant.name)
        if r is None:
            continue
        seeds = len(r["runs"])
        stats = r["mean_std"]
        cells = [f"{variant.label}{' *' if variant.seeded else ''}", str(seeds),
                 *(_cell(stats.get(k), ".3f", seeds) for k in eval_keys),
                 *(_cell(stats.get(key), fmt, seeds) for _, key, fmt in COLUMNS)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_figures(runs: Sequence[Run], out: str) -> list[str]:
    """The comparison PNGs of `FIGURES`, over the variants that finished."""
    groups: dict[str, list[str]] = {}
    labels = {v.name: v.label for v in VARIANTS}
    logged: dict[str, set[str]] = {}  # workdir -> the metrics it logged
    for run in runs:
        if run.done() is not None:
            groups.setdefault(run.variant.name, []).append(run.workdir)
            logged[run.workdir] = set(report.read_series(run.workdir))
    written = []
    for file, (title, variants, metrics) in FIGURES.items():
        selected = {labels[v]: groups[v] for v in variants if v in groups}
        if len(selected) < 2:
            continue
        present = [m for m in metrics if any(m in logged[w] for ws in selected.values()
                                             for w in ws)]
        written.append(report.compare_runs(selected, present, os.path.join(out, "plots", file),
                                           title=title))
    return written


def _before(runs: Sequence[Run]) -> dict[str, float]:
    """The warm start's evaluation, logged at step 0 by the run that evaluates before RL."""
    for run in runs:
        data = report.read_series(run.workdir)
        values = {k: float(s.values[0]) for k, s in data.items()
                  if k.startswith("eval/") and s.steps[0] == 0}
        if values:
            return values
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qurl_jax.study",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="configs/chain_tiny.py", help="base config file")
    parser.add_argument("--out", required=True, help="study directory")
    parser.add_argument("--steps", type=int, default=30, help="RL steps per run")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the * rows (0, 1, ...)")
    parser.add_argument("--first_seed", type=int, default=0,
                        help="seed offset of this invocation's runs (runs <variant>_s<N> for N "
                             "in first_seed..first_seed + seeds - 1): adds seeds to a study "
                             "whose earlier seeds ran elsewhere")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--variants", default="", help="comma-separated subset of the variants")
    parser.add_argument("--quick", action="store_true",
                        help="two variants, one seed, two steps of a shrunk run (a smoke test)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.config):
        parser.error(f"--config={args.config!r} does not exist")
    for name in ("steps", "seeds", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.first_seed < 0:
        parser.error(f"--first_seed={args.first_seed} must be >= 0")
    known = {v.name: v for v in VARIANTS}
    names = [n for n in args.variants.split(",") if n] or (
        list(QUICK_VARIANTS) if args.quick else list(known))
    if unknown := [n for n in names if n not in known]:
        parser.error(f"--variants: unknown {unknown}; known: {list(known)}")
    first = 0 if args.quick else args.first_seed
    if first and (unseeded := [n for n in names if not known[n].seeded]):
        parser.error(f"--first_seed={first}: {unseeded} run under the first seed only; "
                     "leave them out or run them without --first_seed")
    seeds = 1 if args.quick else args.seeds
    base = load_config_file(args.config)
    shared = {"train.num_steps": args.steps, **(quick_overrides() if args.quick else {})}

    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    model_path = build_warm_start(args.config, args.out, shared)
    # The tiny model's warm start is a Hugging Face directory; a real checkpoint keeps its format.
    source = "hf" if base.model.source == "tiny" else base.model.source
    shared.update({
        "model.source": source, "model.path": model_path, "data.split_seed": base.seed,
        "train.progress": False, "train.checkpoint_every": shared["train.num_steps"],
        # One persistent compilation cache for all runs: most programs are the same in every run.
        "train.compilation_cache_dir": os.path.join(os.path.abspath(args.out), "compile_cache")})
    runs, commands = [], {}
    for seed in range(first, first + seeds):  # every variant's first seed before any second one
        for name in names:
            variant = known[name]
            if seed and not variant.seeded:
                continue
            run = Run(variant, base.seed + seed, os.path.join(args.out, "runs", f"{name}_s{seed}"))
            overrides = {**shared, "seed": run.seed, "eval.before": not runs,
                         **variant.overrides}
            runs.append(run)
            commands[run.name] = command(args.config, run, overrides)
    stale = [r.name for r in runs if (done := r.done()) and done["command"] != commands[r.name]]
    if stale:
        sys.exit(f"python -m qurl_jax.study: {args.out} holds finished runs made with other "
                 f"settings ({', '.join(stale)}); use another --out")
    print(f"[study] {len(runs)} runs of {shared['train.num_steps']} steps, {args.jobs} at a "
          f"time, in {args.out}", flush=True)
    run_all(runs, commands, args.jobs)

    results = aggregate(runs)
    before = _before(runs)
    failed = [r.name for r in runs if r.done() is None]
    wall = time.monotonic() - start
    run_wall = sum(done["wall_s"] for r in runs if (done := r.done()) is not None)
    text = "\n".join([
        f"# Rollout-precision study ({args.config})", "",
        f"{len(runs) - len(failed)} of {len(runs)} runs finished, {shared['train.num_steps']} RL "
        f"steps each, seeds {base.seed + first}..{base.seed + first + seeds - 1} for the * rows. "
        f"The runs took {run_wall / 60:.1f} min of wall time summed over runs; this invocation "
        f"{wall / 60:.1f} min with {args.jobs} runs at a time (runs finished before it are not "
        "run again).",
        "Accuracy: the full-precision policy after RL; reward: mean of the last quarter of the "
        "steps; other columns: mean over steps 2.. (step 1 compiles); vetoed seqs: total over "
        "the run; mean ± std over seeds.", "", table(results, before), ""]
        + ([QUICK_NOTE, ""] if args.quick else [])
        + ([f"Failed (see their log.txt): {', '.join(failed)}", ""] if failed else []))
    with open(os.path.join(args.out, "study.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(args.out, "study.json"), "w", encoding="utf-8") as f:
        json.dump({"config": args.config, "steps": shared["train.num_steps"], "before": before,
                   "variants": results, "failed": failed, "wall_s": wall,
                   "run_wall_s": run_wall}, f, indent=1)
    plots = write_figures(runs, args.out)
    print(text)
    print("\n".join(plots))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
