"""Benchmark: one learner linear layer, forward + backward, float32 vs the block-scaled FP8 product.

Run `python -m qurl_jax.bench.fp8`. Times `jax.grad` of a scalar through one [tokens, K] x [K, N]
product (forward, input gradient, weight gradient) in float32 and with `fp8_block_linear` (all
three GEMMs in FP8 E4M3 with DeepSeek-V3 block scaling), jitted, interleaved round by round so that
load from other processes hits both alike; reports the median of each and their ratio.

On a CPU, XLA has no FP8 arithmetic: it upcasts the codes and runs float32 products, plus the
quantizers and the per-group partial products of the block-scaled emulation. The ratio measures
that emulation overhead, not FP8 speed; the speed-up needs FP8 tensor cores and a block-scaled GEMM
kernel in place of `quant._dot_general.block_scaled_matmul` (see docs/fp8_training.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from qurl_jax.quant import fp8_block_linear


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--k", type=int, default=768)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
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


if __name__ == "__main__":
    main()
