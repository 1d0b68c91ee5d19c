"""`python -m qurl_jax.bench.roofline`: predicted decode speed of the paper models on a chip we do
not have, from its compiled decode program (the model: `qurl_jax.plan.roofline`).

    python -m qurl_jax.bench.roofline --target=gpu:h100-1 --json=h100_roofline.json
    python -m qurl_jax.bench.roofline --target=tpu:v5p-8 --json=v5p_roofline.json
    python -m qurl_jax.bench.roofline --table h100_roofline.json v5p_roofline.json
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from qurl_jax.parallel import targets
from qurl_jax.plan import roofline


def markdown_table(records: list[dict[str, Any]]) -> str:
    """Predicted decode tokens/s per case and actor under each attention the records hold (dense
    first, then ragged), its ratio to bf16 under the same attention, ragged over dense where both
    are there, and the measurement. A record without `attention` is dense."""
    attention = lambda r: r.get("attention", "dense")  # noqa: E731
    modes = [a for a in roofline.ATTENTIONS if any(attention(r) == a for r in records)]
    by = {(r["target"], r["model"], r["batch"], r["actor"], attention(r)): r for r in records}
    cases = list(dict.fromkeys(k[:4] for k in by))
    head = ["target", "model", "batch", "actor"]
    for a in modes:
        head += [f"bytes/step {a} (GiB, {'>=' if a == 'dense' else 'adjusted'})", f"bound {a}",
                 f"predicted step {a}", f"predicted tokens/s {a}", f"vs bf16 ({a})"]
    if len(modes) == 2:
        head.append("ragged / dense")
    head.append("measured tokens/s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case in cases:
        cells = [str(c) for c in case]
        for a in modes:
            r, ref = by.get((*case, a)), by.get((*case[:3], "bf16", a))
            if r is None:
                cells += [""] * 5
                continue
            ratio = (f"{r['predicted_tokens_per_s'] / ref['predicted_tokens_per_s']:.2f}x"
                     if ref else "")
            cells += [f"{r.get('bytes_per_step', r['argument_bytes']) / 2**30:.2f}", r["bound"],
                      f"{r['predicted_step_ms']:.2f} ms", f"{r['predicted_tokens_per_s']:,.0f}",
                      ratio]
        if len(modes) == 2:
            d, g = by.get((*case, "dense")), by.get((*case, "ragged"))
            cells.append(f"{g['predicted_tokens_per_s'] / d['predicted_tokens_per_s']:.2f}x"
                         if d and g else "")
        measured = next((by[(*case, a)].get("measured_tokens_per_s") for a in modes
                         if (*case, a) in by and by[(*case, a)].get("measured_tokens_per_s")),
                        None)
        cells.append(f"{measured:,.0f}" if measured else "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", help="gpu:h100-1, tpu:v5p-8 (one device of it is used)")
    p.add_argument("--actors", default=",".join(roofline.ACTORS))
    p.add_argument("--cases", default=";".join(f"{m},{b}" for m, b in roofline.CASES),
                   help="model,batch;model,batch")
    p.add_argument("--attention", default=",".join(roofline.ATTENTIONS),
                   help="dense, ragged or both: the records to write (ragged is derived from the "
                        "dense compile, adjusted analytically)")
    p.add_argument("--schedule", default="refill", choices=roofline.SCHEDULES,
                   help="how the ragged live slots are averaged (`roofline.live_slots`)")
    p.add_argument("--json", help="write the records here (after every case)")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these files")
    args = p.parse_args(argv)
    if args.table:
        print(markdown_table([r for path in args.table for r in json.load(open(path))]))
        return
    try:
        target = targets.parse(args.target or "")
    except targets.TargetError as e:
        sys.exit(str(e))
    if target.chip is None or target.chip.name not in roofline.CHIPS:
        sys.exit(f"--target={args.target}: peak figures known for {', '.join(roofline.CHIPS)} only")
    modes = args.attention.split(",")
    if not modes or any(a not in roofline.ATTENTIONS for a in modes):
        sys.exit(f"--attention={args.attention}: expected a list of "
                 f"{', '.join(roofline.ATTENTIONS)}")
    actors = args.actors.split(",")
    if any(a not in roofline.ACTORS for a in actors):
        sys.exit(f"--actors={args.actors}: expected a list of {', '.join(roofline.ACTORS)}")
    targets.use_cpu_unless_accelerator_attached()
    live = roofline.live_slots(roofline.PROMPT_LEN, roofline.NEW_TOKENS, args.schedule)
    records = []
    for case in args.cases.split(";"):
        model, batch = case.split(",")
        for actor in actors:
            dense = roofline.predict(target, model, int(batch), actor)
            made = {"dense": dense, "ragged": {**roofline.ragged_record(dense, live),
                                               "live_schedule": args.schedule}}
            for a in modes:
                r = made[a]
                records.append(r)
                how = (f"compiled in {r['compile_s']} s" if a == "dense" else
                       f"{live:.1f} of {r['cache_slots']} slots live, adjusted analytically")
                print(f"{target.name} {model} x{batch} {actor} {a}: "
                      f"{r['bytes_per_step'] / 2**30:.2f} GiB/step, "
                      f"{r['predicted_tokens_per_s']:,.0f} tokens/s predicted "
                      f"({r['bound']}-bound; {how})", flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(records, f, indent=1)



if __name__ == "__main__":
    main()
