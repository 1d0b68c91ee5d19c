"""`python -m qurl_jax.bench.interconnect`: the rollout's decode step on a whole slice, collectives
included, predicted from the compiled program (the model: `qurl_jax.plan.interconnect`).

    python -m qurl_jax.bench.interconnect --config=configs/deepscaler_r1_1p5b_int8.py \
        --target=tpu:v5p-16
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
from typing import Any

from qurl_jax.config.base import load_config_file
from qurl_jax.config.settings import RunSettings
from qurl_jax.parallel import sharding as shd
from qurl_jax.parallel import targets
from qurl_jax.plan import interconnect, memory_plan


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Per config, target and layout: the collectives per token and the predicted step and
    tokens/s, and each layout's tokens/s over the first layout's of the same config and target."""
    head = ["target", "model", "precision", "layout (mesh; actor share)", "collectives / token",
            "MiB / token", "HBM+FLOP ms", "links ms", "latency ms", "predicted step ms",
            "predicted tokens/s", "vs first layout", "links at every port: tokens/s",
            "vs first layout (every port)", "live KV reads: tokens/s", "vs first layout (live)",
            "the program's KV reads"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    first: dict[tuple[str, str], dict[str, Any]] = {}
    for r in records:
        key = (r["target"], r["config_model"])
        ref = first.setdefault(key, r)
        ports = interconnect._all_ports(r)
        m = r["mesh"]
        lines.append("| " + " | ".join([
            r["target"], r["config_model"], r["precision"],
            f"{r['layout']} (data={m['data']} fsdp={m['fsdp']} tensor={m['tensor']}; "
            f"{r['actor_fraction']:.3g})",
            str(r["collectives"]["count"]), f"{r['collectives']['bytes'] / 2**20:,.1f}",
            f"{max(r['hbm_ms'], r['flops_ms']):.2f}", f"{r['links_ms']:.2f}",
            f"{r['latency_ms']:.2f}", f"{r['step_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / ref['tokens_per_s']:.2f}x", f"{ports:,.0f}",
            f"{ports / interconnect._all_ports(ref):.2f}x"]
            + ([f"{r['tokens_per_s_live']:,.0f}",
                f"{r['tokens_per_s_live'] / ref['tokens_per_s_live']:.2f}x"]
               if "tokens_per_s_live" in r and "tokens_per_s_live" in ref else ["", ""])
            + [r.get("kv_reads", "")])
            + " |")
    return "\n".join(lines)


def set_field(config: Any, item: str) -> None:
    """Sets `FIELD=VALUE` (a dotted field of `config`; VALUE a Python literal, else a string) on
    `config`, whose own type checks refuse a value of another type."""
    field, sep, text = item.partition("=")
    if not sep:
        raise ValueError("expected FIELD=VALUE")
    *sections, name = field.strip().split(".")
    node = config
    for section in sections:
        node = node[section]
    if name not in node:
        raise KeyError(f"no config field {field!r}")
    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        value = text.strip()
    with config.unlocked():
        node[name] = value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", help="a config file with get_config() (configs/)")
    p.add_argument("--target", help="tpu:v5p-16, tpu:v5e-8, tpu:v6e-8, gpu:h100-8, ...")
    p.add_argument("--layouts", default="learner,rollout",
                   help="learner, rollout, replicated: a list (module docstring)")
    p.add_argument("--shapes_dir", help="model config.json files; default: shapes/ beside "
                                        "--config")
    p.add_argument("--json", help="write the records here (after each layout)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these files")
    p.add_argument("--reshard", action="store_true",
                   help="predict the once-per-step reshard instead (no decode compile)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a config field, e.g. --set rollout.quantize_vocab=False "
                        "(repeatable)")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([r for path in args.table for r in json.load(open(path))]))
        return
    if not args.config:
        sys.exit("qurl_jax: bad flag --config: required (or --table)")
    layouts = args.layouts.split(",")
    if any(a not in interconnect.LAYOUTS for a in layouts):
        sys.exit(f"qurl_jax: bad flag --layouts={args.layouts}: expected a list of "
                 f"{', '.join(interconnect.LAYOUTS)}")
    try:
        target = targets.parse(args.target or "")
    except targets.TargetError as e:
        sys.exit(f"qurl_jax: bad flag --target: {e}")
    if target.chip is None or target.chip.name not in interconnect.LINKS:
        sys.exit(f"qurl_jax: bad flag --target={args.target}: link figures known for "
                 f"{', '.join(interconnect.LINKS)} only")
    targets.use_cpu_unless_accelerator_attached()
    try:
        config = load_config_file(args.config)
    except (OSError, ImportError, SyntaxError) as e:
        sys.exit(f"qurl_jax: bad flag --config={args.config}: {e}")
    for item in args.set:
        try:
            set_field(config, item)
        except (KeyError, TypeError, ValueError) as e:
            sys.exit(f"qurl_jax: bad flag --set={item}: {e}")
    shapes_dir = args.shapes_dir or os.path.join(os.path.dirname(os.path.abspath(args.config)),
                                                 "shapes")
    if args.reshard:
        try:
            record = interconnect.reshard(RunSettings.from_config(config), shapes_dir, target)
        except (targets.TargetError, memory_plan.PlanError, shd.MeshError) as e:
            sys.exit(f"qurl_jax: {e}")
        print(interconnect.describe_reshard(record))
        if args.json:
            with open(args.json, "w") as f:
                json.dump([record], f, indent=1)
        return
    records = []
    for layout in layouts:
        try:
            records.append(interconnect.predict(RunSettings.from_config(config), shapes_dir,
                                                target, layout))
        except (targets.TargetError, memory_plan.PlanError, shd.MeshError) as e:
            sys.exit(f"qurl_jax: {e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(records, f, indent=1)
    if len(records) > 1:
        print("\n" + markdown_table(records))



if __name__ == "__main__":
    main()
