"""The whole RL step of LoRA on a frozen int8 base against the full fine-tune's, on the real model.

    python -m qurl_jax.bench.lora_step [--workdir=/tmp/lora_step] [--steps=5]
        [--order=full,lora,lora,full] [--model_path=PATH]

Each run is `python -m qurl_jax.main` in a process of its own, one at a time in `--order` (A B B A:
load drifts hit both sides alike): 'full' is `configs/smollm2_135m_word.py`, 'lora'
`configs/smollm2_135m_word_lora.py` (the same task, rollout, objective and memory settings; rank-16
adapters on a frozen int8 base, the learner running the rollout's W8A8 product with remat
'projections', LoRA's learning rate), each as shipped but for `--steps` steps and no evaluation.
The configs run are written beside the runs (`<workdir>/<side>.py`).

Step 1 compiles, and a run whose packed batch shrinks compiles again (static shapes), so the table
takes the steps from 2 on at which every run updated the same number of packed rows (`like_steps`).
Per side: the mean step, rollout and update seconds over those steps, each run's peak RSS
(`os.wait4`), and the ratio of the sides' means; the CPU (its name and the int8 paths the library
takes on it). Prints the markdown table and writes `<workdir>/lora_step.json`. A run that fails
stops the benchmark with its log's path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from absl import app, flags

from qurl_jax.runtime.metrics import read_metrics

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/lora_step", "Where the runs and the JSON go.")
_STEPS = flags.DEFINE_integer("steps", 5, "RL steps per run (step 1 compiles).")
_ORDER = flags.DEFINE_list("order", ["full", "lora", "lora", "full"], "Runs, one at a time.")
_MODEL = flags.DEFINE_string("model_path", "", "The GGUF file (default: the configs' own).")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {"full": "configs/smollm2_135m_word.py", "lora": "configs/smollm2_135m_word_lora.py"}
METRICS = ("step", "rollout", "update")


def config_source(side: str, steps: int, model_path: str = "") -> str:
    """The config file a `side` run takes: the shipped config, `steps` steps, no evaluation."""
    if side not in CONFIGS:
        raise ValueError(f"--order: {side!r} is not one of {sorted(CONFIGS)}")
    sets: dict[str, Any] = {"train.num_steps": steps, "eval.files": ()}
    if model_path:
        sets["model.path"] = model_path
    lines = ["from qurl_jax.config.base import load_config_file", "", "", "def get_config():",
             f"    c = load_config_file({os.path.join(REPO, CONFIGS[side])!r})"]
    lines += [f"    c.{key} = {value!r}" for key, value in sets.items()]
    return "\n".join(lines + ["    return c", ""])


def read_steps(run_dir: str) -> list[dict[str, float]]:
    """Per RL step of a run's metrics.jsonl: its seconds (`METRICS`) and packed rows."""
    return [{**{m: row[f"time/{m}_s"] for m in METRICS},
             "rows": row.get("learner/packed_rows", 0.0),
             "kl_k3": row.get("kl_behav_prox_k3", float("nan"))}
            for row in read_metrics(run_dir) if "time/step_s" in row]


def like_steps(runs: Sequence[dict[str, Any]]) -> list[int]:
    """1-based steps from 2 on that every run has, with the same packed rows in all of them."""
    common = min(len(r["steps"]) for r in runs)
    return [i + 1 for i in range(1, common)
            if len({r["steps"][i]["rows"] for r in runs}) == 1]


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Each side's mean seconds per `METRICS` over `like_steps`, its peaks, and full / lora."""
    steps = like_steps(runs)
    if not steps:
        raise ValueError("lora_step: no step from 2 on where every run updated the same packed "
                         "rows; run more --steps")
    sides: dict[str, Any] = {}
    for side in sorted({r["side"] for r in runs}):
        mine = [r for r in runs if r["side"] == side]
        sides[side] = {m: sum(r["steps"][s - 1][m] for r in mine for s in steps)
                       / (len(mine) * len(steps)) for m in METRICS}
        sides[side]["peak_gb"] = [r["peak_gb"] for r in mine]
    out: dict[str, Any] = {"steps": steps, "sides": sides}
    if {"full", "lora"} <= sides.keys():
        out["full_over_lora"] = {m: sides["full"][m] / sides["lora"][m] for m in METRICS}
        out["peak_lora_over_full"] = max(sides["lora"]["peak_gb"]) / max(
            sides["full"]["peak_gb"])
    return out


def table(summary: dict[str, Any], runs: Sequence[dict[str, Any]], cpu: str) -> str:
    """The markdown table of `summarize`'s output, each run's seconds per step listed."""
    steps = summary["steps"]
    rows = ", ".join(str(int(runs[0]["steps"][s - 1]["rows"])) for s in steps)
    lines = [f"CPU: {cpu}. Runs in order: {', '.join(r['side'] for r in runs)}; steps "
             f"{', '.join(map(str, steps))}, packed rows {rows} in every run", "",
             "| | " + " | ".join(summary["sides"]) + " | full / lora |",
             "|---|" + "---|" * (len(summary["sides"]) + 1)]
    ratio = summary.get("full_over_lora", {})
    for m in METRICS:
        cells = [" / ".join(", ".join(f"{r['steps'][s - 1][m]:.1f}" for s in steps)
                            for r in runs if r["side"] == side)
                 + f" (mean {v[m]:.1f})" for side, v in summary["sides"].items()]
        lines.append(f"| {m} s | " + " | ".join(cells)
                     + f" | {ratio.get(m, float('nan')):.2f}x |")
    peaks = [" / ".join(f"{p:.2f}" for p in v["peak_gb"]) for v in summary["sides"].values()]
    lines.append("| peak RSS GB | " + " | ".join(peaks)
                 + f" | lora / full {summary.get('peak_lora_over_full', float('nan')):.2f} |")
    return "\n".join(lines)


def describe_cpu() -> str:
    """The CPU's model name and the int8 paths the library takes on it."""
    from qurl_jax import quant
    from qurl_jax.runtime import xla_cpu

    name = xla_cpu.cpu_model() or "unknown CPU"
    isa = quant.int8_kernel_isa()
    kernel = f"int8 kernel {isa} up to {quant.int8_kernel_rows()} rows" if isa else (
        "no int8 kernel")
    return f"{name}, {os.cpu_count()} cores, {xla_cpu.cpu_isa()} ({kernel})"


def run_one(index: int, side: str, workdir: str, steps: int, model_path: str) -> dict[str, Any]:
    """Run `index` (from 0), of `side`, in its own process; its steps and peak RSS."""
    config = os.path.join(workdir, f"{side}.py")
    with open(config, "w", encoding="utf-8") as f:
        f.write(config_source(side, steps, model_path))
    run_dir = os.path.join(workdir, f"run{index}_{side}")
    log = run_dir + ".log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen([sys.executable, "-m", "qurl_jax.main", f"--config={config}",
                                 f"--workdir={run_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise RuntimeError(f"lora_step: the {side} run failed (exit {proc.returncode}); see {log}")
    return {"side": side, "steps": read_steps(run_dir),
            "peak_gb": usage.ru_maxrss * 1024 / 1e9}


def main(argv: list[str]) -> None:
    del argv
    workdir = _WORKDIR.value
    if os.path.exists(workdir) and os.listdir(workdir):
        raise SystemExit(f"lora_step: --workdir={workdir} is not empty")
    os.makedirs(workdir, exist_ok=True)
    for side in _ORDER.value:
        config_source(side, _STEPS.value)  # a bad --order fails before any run
    cpu = describe_cpu()
    runs = []
    for index, side in enumerate(_ORDER.value):
        runs.append(run_one(index, side, workdir, _STEPS.value, _MODEL.value))
        print(f"{side}: steps {[round(s['step'], 1) for s in runs[-1]['steps']]} s, peak "
              f"{runs[-1]['peak_gb']:.2f} GB", flush=True)
    summary = summarize(runs)
    with open(os.path.join(workdir, "lora_step.json"), "w", encoding="utf-8") as f:
        json.dump({"cpu": cpu, "runs": runs, **summary}, f, indent=1)
    print(table(summary, runs, cpu))


if __name__ == "__main__":
    app.run(main)
