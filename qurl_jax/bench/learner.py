"""Benchmark: the learner's log-prob recomputation and update, packed vs padded, in one run.

`python -m qurl_jax.bench.learner [--rows=32 --max_prompt_len=128 --max_new_tokens=512 ...]`

One long-tailed batch at the paper configs' length distribution, scaled to a CPU-sized model:
responses log-normal with median max_new_tokens / 4 (`bench.sampler.tail_limits`, as
`bench.sampler` and `bench.paged` draw them; mean about 0.35 x the limit), prompts of about
120 / 1024 of `max_prompt_len` (MATH prompts against the configs' 1024 slots: uniform in
[0.06, 0.18] x max_prompt_len). The same batch goes through two `Learner`s that differ only in
`packing`: `logprobs` (pi_prox) then `update` (`--micro_batches` accumulated micro-batches), the
host-side packing included in the packed side's time. Rounds alternate between the two (after one
warm-up round each, which compiles), so load from other processes hits both alike; the table
reports each side's median seconds, real tokens per second (the batch's prompt + response tokens
over the time: the same numerator for both) and the real-token share of what the programs
compute (real tokens / rows x row length). Prints one JSON line with every figure at the end.

`--cpu_dots_ab` instead runs the same packed batch through two `Learner`s that differ only in
`cpu_dots`: XLA:CPU's own choice of float products ('xla') and Eigen's in the learner's programs
('learner'), interleaved the same way: which is faster for this model's width on this CPU
(`train.cpu_dots`, `qurl_jax.runtime.xla_cpu`).

`--ab precision` / `--ab numerics` instead runs the same packed batch through two `Learner`s that
differ only in `train.precision` ('fp' vs 'fp8_block') or in `train.on_policy_numerics` ('default'
vs 'exact', at `--precision`), interleaved the same way, and reports each side's update and
log-prob seconds and their ratio; `--smollm2` gives the model SmolLM2-135M's shapes (random
weights, `--layers` of them: 30 by default), e.g. the FP8 learner against the float32 one:

    python -m qurl_jax.bench.learner --ab precision --smollm2 --rows 64 --max_prompt_len 128 \
        --max_new_tokens 96 --micro_batches 8 --logprob_chunk 128 --rounds 3

`--vs_torch` instead times one update of a SmolLM2-135M-shaped model against torch doing the same
forward, backward and AdamW step on the same tokens (`qurl_jax.bench.learner_vs_torch`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from qurl_jax.bench.learner_flops import long_tailed_batch
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig

# --ab: the two sides of each comparison, (name, Learner keywords, ModelConfig changes).
AB_SIDES = {
    "precision": (("fp", {"precision": "fp"}, {}),
                  ("fp8_block", {"precision": "fp8_block"}, {})),
    "numerics": (("default", {}, {"numerics": "default"}),
                 ("exact", {}, {"numerics": "exact"})),
}


def _sides(args: argparse.Namespace) -> tuple[tuple[str, dict, dict], ...]:
    """(name, Learner keywords, ModelConfig changes) of the two learners compared."""
    if args.ab:
        base = {"packing": True, "cpu_dots": args.cpu_dots, "precision": args.precision}
        return tuple((name, {**base, **kw}, cfg) for name, kw, cfg in AB_SIDES[args.ab])
    if args.cpu_dots_ab:
        return (("xla", {"packing": True, "cpu_dots": "xla"}, {}),
                ("learner", {"packing": True, "cpu_dots": "learner"}, {}))
    return (("padded", {"packing": False, "cpu_dots": args.cpu_dots}, {}),
            ("packed", {"packing": True, "cpu_dots": args.cpu_dots}, {}))


def run(args: argparse.Namespace) -> dict[str, float]:
    if args.smollm2:
        from qurl_jax.bench.learner_vs_torch import SMOLLM2_135M, smollm2_shapes

        cfg = smollm2_shapes(args.layers).replace(attention=args.attention)
        vocab = SMOLLM2_135M["vocab_size"]
    else:
        cfg = ModelConfig(model_type="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                          intermediate_size=args.hidden * 3, num_layers=args.layers,
                          num_heads=args.heads, num_kv_heads=max(args.heads // 2, 1),
                          head_dim=args.hidden // args.heads, attention=args.attention)
        vocab = args.vocab
    host = long_tailed_batch(args.rows, args.max_prompt_len, args.max_new_tokens, vocab,
                             args.seed)
    real = int(host["attn_mask"].sum())
    mesh = shd.make_mesh()
    params0 = init_params(cfg, jax.random.key(args.seed))
    sides = {}
    for name, kw, changes in _sides(args):
        learner = Learner(cfg.replace(**changes), ObjectiveConfig(),
                          OptimConfig(learning_rate=1e-6), mesh,
                          num_micro_batches=args.micro_batches,
                          logprob_batch_size=args.rows // args.micro_batches,
                          logprob_chunk=args.logprob_chunk, **kw)
        params = learner.shard_params(params0)
        sides[name] = {"learner": learner, "params": params,
                       "opt": learner.init_opt_state(params), "times": [], "update": [],
                       "logprobs": []}

    def one_round(side: dict) -> tuple[float, float]:
        learner = side["learner"]
        # A fresh batch object per round (as the trainer's): the packing is redone and timed.
        batch = learner.shard_batch({k: jnp.asarray(v) for k, v in host.items()})
        jax.block_until_ready(batch)
        start = time.perf_counter()
        batch["logp_prox"] = jax.block_until_ready(learner.logprobs(side["params"], batch))
        middle = time.perf_counter()
        side["params"], side["opt"], metrics = learner.update(side["params"], side["opt"], batch)
        jax.block_until_ready((side["params"], metrics))
        return middle - start, time.perf_counter() - middle

    for side in sides.values():  # warm-up: compiles
        one_round(side)
    for _ in range(args.rounds):
        for side in sides.values():
            logprobs, update = one_round(side)
            side["times"].append(logprobs + update)
            side["logprobs"].append(logprobs)
            side["update"].append(update)
    out: dict[str, float] = {"real_tokens": float(real)}
    padded_tokens = args.rows * (args.max_prompt_len + args.max_new_tokens)
    for name, side in sides.items():
        t = statistics.median(side["times"])
        if side["learner"].packing:  # rows x pack length of the last packing (the update's)
            share = side["learner"].last_pack["learner/real_token_share"]
        else:
            share = real / padded_tokens
        computed = real / share
        out.update({f"{name}/seconds": t, f"{name}/real_tokens_per_s": real / t,
                    f"{name}/computed_tokens": float(computed),
                    f"{name}/real_token_share": share,
                    f"{name}/update_seconds": statistics.median(side["update"]),
                    f"{name}/logprobs_seconds": statistics.median(side["logprobs"])})
    first, second = (name for name, _, _ in _sides(args))
    out["speedup"] = out[f"{first}/seconds"] / out[f"{second}/seconds"]
    out["update_ratio"] = out[f"{second}/update_seconds"] / out[f"{first}/update_seconds"]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max_prompt_len", type=int, default=128)
    ap.add_argument("--max_new_tokens", type=int, default=512)
    ap.add_argument("--micro_batches", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--attention", default="auto")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flops", action="store_true",
                    help="instead: compiled FLOPs per RL step of --config's learner on "
                         "--target, packed vs padded (bench/learner_flops.py)")
    ap.add_argument("--vs_torch", action="store_true",
                    help="instead: one update of a SmolLM2-135M-shaped model against torch "
                         "doing the same forward, backward and AdamW step, interleaved "
                         "(bench/learner_vs_torch.py; --rows, --max_prompt_len, "
                         "--max_new_tokens, --rounds, --layers)")
    ap.add_argument("--remat", default="none",
                    help="with --vs_torch: our learner's train.remat (none | dots | projections "
                         "| full)")
    ap.add_argument("--scan_layers", action="store_true",
                    help="with --vs_torch: our learner's layers as one lax.scan")
    ap.add_argument("--cpu_dots", default="auto",
                    help="our learner's XLA:CPU float products (auto | xla | learner | eigen; "
                         "config.train.cpu_dots; 'eigen' only with --vs_torch)")
    ap.add_argument("--cpu_dots_ab", action="store_true",
                    help="instead of padded vs packed: cpu_dots 'xla' vs 'learner', both packed")
    ap.add_argument("--ab", choices=tuple(AB_SIDES),
                    help="instead of padded vs packed, both packed: train.precision 'fp' vs "
                         "'fp8_block' (precision), or train.on_policy_numerics 'default' vs "
                         "'exact' at --precision (numerics)")
    ap.add_argument("--precision", default="fp", help="with --ab numerics: train.precision")
    ap.add_argument("--smollm2", action="store_true",
                    help="SmolLM2-135M's shapes (random weights; --layers of them)")
    ap.add_argument("--apart", action="store_true",
                    help="with --vs_torch: one process at a time (ours, torch, torch, ours), each "
                         "warmed up and timed for --rounds rounds")
    ap.add_argument("--logprob_chunk", type=int, default=512,
                    help="our learner's response positions per LM-head chunk")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers (default: 2, or 30 with --vs_torch)")
    ap.add_argument("--config", help="with --flops: a config file (configs/)")
    ap.add_argument("--target", default="tpu:v5p-16", help="with --flops: a compile target")
    args = ap.parse_args(argv)
    if args.cpu_dots == "eigen" and not args.vs_torch:  # a process-wide flag set before JAX starts
        ap.error("--cpu_dots=eigen needs --vs_torch (or XLA_FLAGS=--xla_cpu_experimental_ynn_"
                 "fusion_type= in the environment)")
    if args.flops:
        if not args.config:
            ap.error("--flops needs --config")
        from qurl_jax.bench import learner_flops
        from qurl_jax.parallel import targets

        targets.use_cpu_unless_accelerator_attached()
        counted = learner_flops.count(args.config, args.target, args.seed)
        print("\n".join(learner_flops.describe(counted)))
        print(json.dumps(counted))
        return
    if args.vs_torch:
        from qurl_jax.bench import learner_vs_torch

        argv = argv if argv is not None else sys.argv[1:]
        given = lambda flag: any(a.split("=")[0] == flag for a in argv)  # noqa: E731
        out = learner_vs_torch.run(
            rows=args.rows if given("--rows") else 32,
            max_prompt_len=args.max_prompt_len if given("--max_prompt_len") else 40,
            max_new_tokens=args.max_new_tokens if given("--max_new_tokens") else 64,
            rounds=args.rounds, layers=args.layers or 30, seed=args.seed,
            learner_kw={"remat": args.remat, "scan_layers": args.scan_layers,
                        "logprob_chunk": args.logprob_chunk},
            cpu_dots=args.cpu_dots, apart=args.apart)
        how = (f"2 x {args.rounds} rounds, one process at a time" if args.apart
               else f"{args.rounds} interleaved rounds")
        print(f"update (forward + backward + AdamW), median of {how} on {out['cpus']:.0f} CPUs "
              f"(our cpu_dots: {args.cpu_dots}):")
        print(f"  ours  {out['ours/seconds']:7.2f} s  peak RSS {out['ours/peak_rss_gb']:.2f} GB"
              f"  (+ a separate pi_prox pass: {out['ours_logprobs/seconds']:.2f} s)")
        print(f"  torch {out['torch/seconds']:7.2f} s  peak RSS {out['torch/peak_rss_gb']:.2f} GB")
        shares = {k.split("op_share_")[1]: v for k, v in out.items() if "op_share_" in k}
        if shares:
            print("  our update's XLA:CPU operations in flight: " + ", ".join(
                f"{k} {v:.0%}" for k, v in shares.items())
                + f" of {out['ours/op_traced_seconds']:.1f} s (a product running: matmul; a "
                f"copy but no product: transpose; the profiled update took "
                f"{out['ours/profiled_update_seconds']:.1f} s)")
        print(f"  ours / torch: {out['ratio_update_ours_over_torch']:.2f} wall, "
              f"{out['ratio_update_cpu_ours_over_torch']:.2f} CPU seconds "
              f"({out['ours/cpu_seconds']:.2f} / {out['torch/cpu_seconds']:.2f})")
        print(json.dumps(out))
        return
    args.layers = args.layers or (30 if args.smollm2 else 2)
    out = run(args)
    names = tuple(name for name, _, _ in _sides(args))
    print(f"{'side':<10}{'median s':>10}{'update s':>10}{'logprobs s':>11}{'real tok/s':>12}"
          f"{'computed tok':>14}{'real share':>12}")
    for name in names:
        print(f"{name:<10}{out[f'{name}/seconds']:>10.3f}{out[f'{name}/update_seconds']:>10.3f}"
              f"{out[f'{name}/logprobs_seconds']:>11.3f}"
              f"{out[f'{name}/real_tokens_per_s']:>12.0f}"
              f"{out[f'{name}/computed_tokens']:>14.0f}{out[f'{name}/real_token_share']:>12.3f}")
    if args.ab:
        print(f"{names[1]} / {names[0]} ({args.rounds} interleaved rounds, medians): update "
              f"{out['update_ratio']:.2f}x, log-probs + update {1 / out['speedup']:.2f}x")
    elif args.cpu_dots_ab:
        print(f"'learner' speedup over 'xla' (log-probs + update, same run, {args.hidden} wide, "
              f"{args.layers} layers): {out['speedup']:.2f}x")
    else:
        print(f"packed speedup (log-probs + update, same run): {out['speedup']:.2f}x")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
