"""Benchmark: Sparse-RL's compressed KV cache vs the dense one: memory and decode speed.

Run `python -m qurl_jax.bench.kv [--json=PATH]`. The ~98M-parameter Qwen2-shaped model of
`qurl_jax.bench.sampler` (random weights), batch 8, 128-token prompts, 2048 and 4096 new tokens
with EOS disabled (every row decodes every step), full-vocabulary sampling at temperature 1.
Policies: dense, and StreamingLLM / SnapKV / R-KV with budget 512 and interval 128 (the cache
holds budget + interval = 640 slots per row instead of prompt + generation). All in one run, per
(policy, new tokens):

- KV bytes per row: the K and V buffers of one row, all layers (`Engine.kv_bytes_per_row`);
- peak memory of the compiled decode program (arguments + outputs - donated + temporaries, from
  `memory_analysis()`: every buffer live at once, an upper bound of the true peak);
- decode tokens/s = batch * (new_tokens - 1) / (time of a new_tokens call - time of a 1-token
  call), each the fastest of `--rounds`, rounds interleaved across policies so that load from
  other processes hits them alike. Each length's rows are printed (and written to the JSON file)
  as soon as they are measured.

`--json=PATH` writes a list of rows {"policy", "new_tokens", "kv_bytes_per_row", "tokens_per_s",
"peak_bytes", "cache_slots"}. Flags shrink the run for a slow machine (`--new_tokens=256,512
--budget=64 --interval=32`); the printed header says what ran.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jax
import numpy as np

from qurl_jax.bench.sampler import BENCH_CONFIG
from qurl_jax.models.params import init_params
from qurl_jax.sampling import KVPolicyConfig, Sampler, SamplingParams

POLICIES = ("dense", "streaming", "snapkv", "rkv")


def _peak_bytes(sampler: Sampler, params: Any, batch: int, prompt_len: int,
                new_tokens: int) -> int:
    """Peak bytes of the compiled decode program of one chunk (see the module docstring)."""
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    lowered = sampler.lower_programs(abstract, batch, prompt_len, new_tokens)["decode"]
    m = lowered.compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
               + m.temp_size_in_bytes)


def _ratio(row: dict[str, Any], dense: dict[str, Any] | None, key: str) -> str:
    """row[key] / dense[key], formatted for the table (blank without a dense row)."""
    return f"{row[key] / dense[key]:>10.2f}" if dense else f"{'':>10}"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", default="2048,4096",
                        help="comma-separated response lengths")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--budget", type=int, default=512)
    parser.add_argument("--interval", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="compute dtype of the rollout")
    parser.add_argument("--rounds", type=int, default=2,
                        help="timed rounds per setting; the fastest counts")
    parser.add_argument("--json", default="", help="write the rows to this file")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.new_tokens.split(",")]
    policies = args.policies.split(",")

    config = BENCH_CONFIG.replace(dtype=args.dtype,
                                  max_position_embeddings=args.prompt_len + max(lengths))
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, config.vocab_size, (args.batch, args.prompt_len)).tolist()
    print(f"# {jax.devices()[0].device_kind} ({jax.default_backend()}), {args.dtype}, batch "
          f"{args.batch}, prompts {args.prompt_len}, new tokens {lengths}, budget {args.budget}, "
          f"interval {args.interval}, best of {args.rounds} rounds", flush=True)

    samplers: dict[tuple[str, int], Sampler] = {}
    for policy in policies:
        kv = KVPolicyConfig(policy=policy, budget=args.budget, interval=args.interval)
        for n in lengths:
            samplers[(policy, n)] = Sampler(
                config, max_prompt_len=args.prompt_len, max_new_tokens=n,
                prompt_buckets=[args.prompt_len], gen_buckets=[n], kv_policy=kv)

    def run(sampler: Sampler, new_tokens: int) -> float:
        t0 = time.perf_counter()
        out = sampler.sample(params, prompts,
                             SamplingParams(max_new_tokens=new_tokens, temperature=1.0),
                             key=jax.random.key(0))
        jax.block_until_ready(out.tokens)
        elapsed = time.perf_counter() - t0
        if int(out.num_steps) != new_tokens:
            raise RuntimeError(f"sampler ran {int(out.num_steps)} steps, expected {new_tokens}")
        return elapsed

    rows: list[dict[str, Any]] = []
    print(f"{'policy':<10}{'new':>6}{'slots':>7}{'KV MiB/row':>12}{'vs dense':>10}"
          f"{'peak MiB':>10}{'decode tok/s':>14}{'vs dense':>10}", flush=True)
    # One length at a time, its rows printed (and written) as soon as they are measured.
    for n in lengths:
        for policy in policies:  # compile (and warm) every program first
            run(samplers[(policy, n)], 1)
            run(samplers[(policy, n)], n)
        times: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for policy in policies:
                for steps in (1, n):
                    times.setdefault((policy, steps), []).append(run(samplers[(policy, n)],
                                                                     steps))
        dense_row = None
        for policy in policies:
            sampler = samplers[(policy, n)]
            decode_s = min(times[(policy, n)]) - min(times[(policy, 1)])
            row = {"policy": policy, "new_tokens": n,
                   "kv_bytes_per_row": sampler.engine.kv_bytes_per_row(args.prompt_len, n),
                   "tokens_per_s": args.batch * (n - 1) / decode_s,
                   "peak_bytes": _peak_bytes(sampler, params, args.batch, args.prompt_len, n),
                   "cache_slots": sampler.engine.cache_slots(args.prompt_len, n)}
            rows.append(row)
            dense_row = dense_row or (row if policy == "dense" else None)
            print(f"{policy:<10}{n:>6}{row['cache_slots']:>7}"
                  f"{row['kv_bytes_per_row'] / 2**20:>12.1f}"
                  f"{_ratio(row, dense_row, 'kv_bytes_per_row')}"
                  f"{row['peak_bytes'] / 2**20:>10.0f}{row['tokens_per_s']:>14.0f}"
                  f"{_ratio(row, dense_row, 'tokens_per_s')}", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    main()
