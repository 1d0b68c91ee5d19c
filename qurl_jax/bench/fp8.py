"""Benchmark: one learner linear layer, forward + backward, float32 vs the block-scaled FP8 product.

Run `python -m qurl_jax.bench.fp8`. Times `jax.grad` of a scalar through one [tokens, K] x [K, N]
product (forward, input gradient, weight gradient) in float32 and with `fp8_block_linear` (all
three GEMMs in FP8 E4M3 with DeepSeek-V3 block scaling), jitted, interleaved round by round so that
load from other processes hits both alike; reports the median of each and their ratio.

On a CPU, XLA has no FP8 arithmetic: it upcasts the codes and runs float32 products, plus the
quantizers and the per-group partial products of the block-scaled emulation. The ratio measures
that emulation overhead, not FP8 speed; the speed-up needs FP8 tensor cores and a block-scaled GEMM
kernel in place of `quant._dot_general.block_scaled_matmul` (see docs/jet_rl.md).

`--learner` adds two learner-level measurements on a small model: the time of one jitted learner
update (forward + backward + AdamW) with `train.precision` 'fp' vs 'fp8_block', and Jet-RL's
on-policy check: responses sampled by the 'fp8_block' rollout, then KL(behav || prox) and the
largest |logp_behav - logp_prox| with the proximal log-probs recomputed by a learner in 'fp'
(BF16-train + FP8-rollout) and in 'fp8_block' (the unified flow), as the trainer logs them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import quant
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.quant import fp8_block_linear
from qurl_jax.rl.objectives import ObjectiveConfig, mismatch_metrics
from qurl_jax.sampling import Sampler, SamplingParams

# The learner measurements' model: small, but every linear layer spans whole 128x128 blocks.
LEARNER_CONFIG = ModelConfig(model_type="qwen2", vocab_size=512, hidden_size=256,
                             intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
                             head_dim=64)


def _linear_step(product: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable:
    """jitted (x, w, r) -> (dX, dW) of sum(r * product(x, w))."""
    return jax.jit(jax.grad(lambda x, w, r: jnp.sum(r * product(x, w)), argnums=(0, 1)))


def time_linear(tokens: int = 2048, k: int = 768, n: int = 2048, repeats: int = 5,
                dtype: str = "float32") -> dict[str, float]:
    """Median seconds of one forward + backward of x[tokens, k] @ w[k, n] per product.

    Activations in `dtype` (the compute dtype), the kernel float32 (the master weights).
    Returns {"f32": seconds, "fp8_block": seconds}.
    """
    kx, kw, kr = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (tokens, k), dtype)
    w = jax.random.normal(kw, (k, n), jnp.float32) * 0.02
    r = jax.random.normal(kr, (tokens, n), dtype)
    steps = {
        "f32": _linear_step(lambda x, w: (x @ w.astype(x.dtype))),
        "fp8_block": _linear_step(fp8_block_linear),
    }
    for step in steps.values():  # compile and warm up
        jax.block_until_ready(step(x, w, r))
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            jax.block_until_ready(step(x, w, r))
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _learner_batch(config: ModelConfig, rows: int, prompt_len: int, response_len: int,
                   seed: int = 0) -> dict[str, jax.Array]:
    """A learner batch of random tokens: left-padded prompts, responses of random lengths."""
    rng = np.random.default_rng(seed)
    p_mask = np.arange(prompt_len)[None] >= rng.integers(0, prompt_len // 2, rows)[:, None]
    r_mask = np.arange(response_len)[None] < rng.integers(response_len // 2, response_len + 1,
                                                          rows)[:, None]
    attn = np.concatenate([p_mask, r_mask], axis=1)
    return {
        "tokens": jnp.asarray(rng.integers(0, config.vocab_size, attn.shape), jnp.int32),
        "positions": jnp.asarray(np.maximum(np.cumsum(attn, 1) - 1, 0), jnp.int32),
        "attn_mask": jnp.asarray(attn),
        "resp_mask": jnp.asarray(r_mask, jnp.float32),
        "logp_behav": jnp.asarray(-rng.uniform(0.5, 4.0, r_mask.shape), jnp.float32),
        "advantages": jnp.asarray(rng.normal(size=rows), jnp.float32),
    }


def time_learner_step(config: ModelConfig = LEARNER_CONFIG, rows: int = 8, prompt_len: int = 64,
                      response_len: int = 192, repeats: int = 3) -> dict[str, float]:
    """Median seconds of one learner update (single device) per training precision.

    Returns {"fp": seconds, "fp8_block": seconds}; the updates alternate round by round.
    """
    params = init_params(config, jax.random.key(0))
    mesh = shd.make_mesh()
    batch = _learner_batch(config, rows, prompt_len, response_len)
    batch["logp_prox"] = batch["logp_behav"]
    state = {}
    for precision in ("fp", "fp8_block"):
        learner = Learner(config, ObjectiveConfig(), OptimConfig(), mesh, precision=precision)
        p = learner.shard_params(params)
        state[precision] = (learner, p, learner.init_opt_state(p), learner.shard_batch(batch))
    times: dict[str, list[float]] = {name: [] for name in state}
    for i in range(repeats + 1):  # the first round compiles
        for name, (learner, p, o, b) in state.items():
            t0 = time.perf_counter()
            p, o, m = learner.update(p, o, b)
            jax.block_until_ready(m)
            state[name] = (learner, p, o, b)
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def unified_flow_mismatch(config: ModelConfig, params: Any, prompts: list[list[int]], *,
                          train_precision: str, n: int = 2, max_new_tokens: int = 16,
                          temperature: float = 1.0, eos_ids: tuple[int, ...] = (),
                          seed: int = 0) -> dict[str, float]:
    """Behaviour/proximal mismatch of one rollout from the 'fp8_block' sampler, with pi_prox
    recomputed by a single-device learner in `train_precision` (as the trainer does).

    Returns `mismatch_metrics` as floats (kl_behav_prox_k1 / _k3, logp_gap_abs_max, ...) and
    "tokens", the number of response tokens compared.
    """
    mesh = shd.make_mesh()
    sampler = Sampler(config, quant.make_dot_general("fp8_block"), mesh=mesh,
                      max_prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens)
    out = sampler.sample(quant.requantize(params, "fp8_block"), prompts,
                         SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                                        eos_ids=eos_ids),
                         key=jax.random.key(seed), n=n)
    tokens, attn_mask, positions = out.sequences()
    learner = Learner(config, ObjectiveConfig(), OptimConfig(), mesh, temperature=temperature,
                      precision=train_precision)
    batch = learner.shard_batch({"tokens": tokens, "positions": positions,
                                 "attn_mask": attn_mask,
                                 "resp_mask": out.mask.astype(jnp.float32)})
    logp_prox = learner.logprobs(learner.shard_params(params), batch)
    metrics = {k: float(v) for k, v in mismatch_metrics(logp_prox, out.logp, out.mask).items()}
    metrics["tokens"] = float(jnp.sum(out.mask))
    return metrics


def _learner_report(repeats: int, dtype: str) -> None:
    config = LEARNER_CONFIG.replace(dtype=dtype)
    rows, prompt_len, response_len = 8, 64, 192
    t = time_learner_step(config, rows, prompt_len, response_len, repeats)
    print(f"learner update, {config.num_layers} layers, hidden {config.hidden_size}, mlp "
          f"{config.intermediate_size}, {rows} x {prompt_len + response_len} tokens, {dtype}")
    for name, sec in t.items():
        print(f"  train.precision={name:10s} {sec * 1e3:9.1f} ms")
    print(f"  fp8_block / fp = {t['fp8_block'] / t['fp']:.2f}x")
    params = init_params(config, jax.random.key(0))
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(1, config.vocab_size, rng.integers(4, 16))))
               for _ in range(8)]
    print(f"rollout fp8_block, {len(prompts)} prompts x 2 samples x 32 tokens, {dtype}")
    for precision in ("fp", "fp8_block"):
        m = unified_flow_mismatch(config, params, prompts, train_precision=precision,
                                  max_new_tokens=32)
        print(f"  train {precision:10s} KL(behav||prox) k3 {m['kl_behav_prox_k3']:.3e} "
              f"k1 {m['kl_behav_prox_k1']:+.3e}  max |logp gap| {m['logp_gap_abs_max']:.3e} "
              f"({m['tokens']:.0f} tokens)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--learner", action="store_true",
                        help="also time a learner update (fp vs fp8_block) and measure "
                             "KL(behav || prox) of the unified flow")
    args = parser.parse_args()
    backend = jax.default_backend()
    t = time_linear(args.tokens, args.k, args.n, args.repeats, args.dtype)
    print(f"linear fwd+bwd [{args.tokens} x {args.k}] @ [{args.k} x {args.n}], "
          f"activations {args.dtype}, backend {backend}")
    for name, sec in t.items():
        print(f"  {name:10s} {sec * 1e3:9.1f} ms")
    print(f"  fp8_block / f32 = {t['fp8_block'] / t['f32']:.2f}x")
    if backend == "cpu":
        print("  NOTE: FP8 is EMULATED on CPU (XLA upcasts the codes to float32); this ratio is "
              "the emulation overhead, not an FP8 speed-up.")
    if args.learner:
        _learner_report(args.repeats, args.dtype)
        if backend == "cpu":
            print("  NOTE: FP8 is EMULATED on CPU; the learner time ratio is emulation overhead.")


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    main()
