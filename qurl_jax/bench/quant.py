"""Benchmark: one decode step of a ~100M-parameter Qwen2-shaped model per rollout recipe, on CPU.

Run `python -m qurl_jax.bench.quant`. The decode step is the sampler's hot loop: batch 8, one new
token against a 512-token KV cache through the model's cache path, jitted with the cache donated
(updated in place, as a sampler does), weights as `requantize` output and the model built with
`rollout_dot_general` (on CPU: the int8 kernels packed and attention on the decode attention
kernel, as the sampler's loop runs them; `--xla-attention` for XLA's attention). All recipes are
timed in one run, interleaved round by round so that load from other processes hits them alike;
the table reports the median per recipe and its speedup over `fp`. It also times one `requantize`
call against one learner step (forward, backward and AdamW on a batch of sequences), the per-RL-step
overhead of quantized rollouts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from qurl_jax.cpu_kernels import decode_attention
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.params import init_params, token_logprobs
from qurl_jax.models.transformer import KVCache, Transformer
from qurl_jax.quant import (
    QuantizedTensor,
    Recipe,
    get_recipe,
    pack_for_decode,
    requantize,
    rollout_dot_general,
)

# ~98M parameters: 73M in the 12 decoder layers (quantized), 2 x 12.6M in the 16k x 768 embedding
# and the untied LM head (kept in float32). Untied because XLA:CPU runs the tied head (contracting
# the embedding's second axis) about 3x slower per byte than a [E, V] kernel, which would swamp
# the decoder layers in both columns of the comparison.
BENCH_CONFIG = ModelConfig(
    model_type="qwen2", vocab_size=16384, hidden_size=768, intermediate_size=2048, num_layers=12,
    num_heads=12, num_kv_heads=2, head_dim=64, attention_bias=True, tie_word_embeddings=False,
    max_position_embeddings=4096, rope_theta=1e6,
)


def _block(x: Any) -> Any:
    return jax.tree.map(lambda a: a.block_until_ready(), x)


def make_decode_step(config: ModelConfig,
                     cpu_attention: bool = True) -> Callable[..., tuple[jax.Array, KVCache]]:
    """jitted (params, cache, tokens i32[B,1]) -> (logits, cache); the cache argument is donated.
    The returned cache keeps the input's bookkeeping (pos, n_used, next_pos), so every call is
    the same step: the token is written into the same free slot at the same position. With
    `cpu_attention`, attention runs on the CPU decode attention kernel where usable, as in the
    sampler's decode loop."""
    hook = None
    if cpu_attention and decode_attention.usable(config.compute_dtype, config.head_dim):
        hook = decode_attention.decode_attention
    model = Transformer(config, dot_general=rollout_dot_general, decode_attention=hook)

    def step(params, cache, tokens):
        logits, new = model.apply({"params": params}, tokens, cache.next_pos[:, None],
                                  cache=cache)
        return logits, new.replace(pos=cache.pos, n_used=cache.n_used, next_pos=cache.next_pos)

    return jax.jit(step, donate_argnums=(1,))


def filled_cache(config: ModelConfig, batch: int, context: int, rng: jax.Array) -> KVCache:
    """A cache of `context` valid random slots (positions 0 .. context-1) plus room for one more
    token."""
    cache = KVCache.zeros(config, batch, context + 1)
    keys = jax.random.split(rng, 2 * config.num_layers)
    random_like = lambda key, x: jax.random.normal(key, x.shape, x.dtype)  # noqa: E731
    return cache.replace(
        k=tuple(map(random_like, keys[0::2], cache.k)),
        v=tuple(map(random_like, keys[1::2], cache.v)),
        pos=cache.pos.at[:, :context].set(jnp.arange(context, dtype=jnp.int32)),
        n_used=jnp.full((batch,), context, jnp.int32),
        next_pos=jnp.full((batch,), context, jnp.int32),
    )


def parse_recipe(spec: str) -> Recipe:
    """A recipe name, optionally with '+lm_head' to also quantize the (untied) LM head."""
    base, plus, extra = spec.partition("+")
    if plus and extra != "lm_head":
        raise ValueError(f"recipe spec {spec!r}: the only suffix is '+lm_head'")
    recipe = get_recipe(base)
    return recipe.replace(name=spec, quantize_lm_head=True) if plus else recipe


def time_decode(config: ModelConfig, recipes: Sequence[str], batch: int = 8, context: int = 512,
                rounds: int = 5, steps_per_round: int = 10, seed: int = 0,
                cpu_attention: bool = True) -> dict[str, dict[str, float]]:
    """Seconds of one decode step per recipe: {'median': ..., 'best': ...} over the rounds.

    Rounds are interleaved across recipes; 'best' (the fastest round) is the least disturbed by
    other processes on a shared machine."""
    rng = jax.random.key(seed)
    params = init_params(config, rng)
    step = make_decode_step(config, cpu_attention)
    tokens = jnp.ones((batch, 1), jnp.int32)
    state = {}
    for name in recipes:
        # As the sampler's decode loop does once per rollout: int8 kernels in the CPU kernel's
        # packed layout (a no-op off CPU or without AVX512-VNNI).
        rollout = _block(jax.jit(pack_for_decode)(requantize(params, parse_recipe(name))))
        cache = filled_cache(config, batch, context, rng)
        _, cache = _block(step(rollout, cache, tokens))  # compile + warm up
        state[name] = [rollout, cache]
    samples: dict[str, list[float]] = {name: [] for name in recipes}
    for _ in range(rounds):
        for name in recipes:
            rollout, cache = state[name]
            start = time.perf_counter()
            for _ in range(steps_per_round):
                logits, cache = step(rollout, cache, tokens)
            _block((logits, cache))
            samples[name].append((time.perf_counter() - start) / steps_per_round)
            state[name][1] = cache
    return {name: {"median": statistics.median(t), "best": min(t)} for name, t in samples.items()}


def time_requantize_vs_learner_step(config: ModelConfig, recipe: str = "int8", batch: int = 8,
                                    seq_len: int = 128, repeats: int = 3,
                                    seed: int = 0) -> dict[str, float]:
    """Median seconds of one `requantize` call and of one learner step (NLL loss, AdamW)."""
    rng = jax.random.key(seed)
    params = init_params(config, rng)
    model = Transformer(config)
    optimizer = optax.adamw(1e-6)
    opt_state = optimizer.init(params)
    tokens = jax.random.randint(rng, (batch, seq_len + 1), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq_len), (batch, seq_len))

    def loss_fn(p):
        logits, _ = model.apply({"params": p}, tokens[:, :-1], positions)
        return -jnp.mean(token_logprobs(logits, tokens[:, 1:]))

    @jax.jit
    def learner_step(p, s):
        grads = jax.grad(loss_fn)(p)
        updates, s = optimizer.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    def timed(fn: Callable[[], Any]) -> float:
        _block(fn())
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _block(fn())
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return {
        "requantize_s": timed(lambda: requantize(params, recipe)),
        "learner_step_s": timed(lambda: learner_step(params, opt_state)),
    }


def quantized_bytes_ratio(params: Any, recipe: str) -> float:
    """Bytes of the quantized kernels (codes + scales) over the bytes of their float32 originals."""
    rollout = requantize(params, recipe)
    is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
    q_leaves = [x for x in jax.tree.leaves(rollout, is_leaf=is_q) if is_q(x)]
    return sum(q.nbytes for q in q_leaves) / sum(q.qvalue.size * 4 for q in q_leaves)


def format_table(decode: dict[str, dict[str, float]], baseline: str = "fp") -> str:
    """Median and best decode-step times per recipe with their speedups over `baseline`."""
    lines = [f"{'recipe':<12}{'median ms':>11}{'speedup':>9}{'best ms':>11}{'speedup':>9}"]
    base = decode[baseline]
    for name, t in decode.items():
        lines.append(
            f"{name:<12}{t['median'] * 1e3:>11.2f}{base['median'] / t['median']:>8.2f}x"
            f"{t['best'] * 1e3:>11.2f}{base['best'] / t['best']:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default="fp,int8,int8+lm_head,fp8",
                        help="comma-separated recipe names (baseline first); a '+lm_head' suffix "
                             "also quantizes the LM head")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--xla-attention", action="store_true",
                        help="attention through XLA's ops instead of the CPU decode attention "
                             "kernel")
    parser.add_argument("--steps-per-round", type=int, default=10)
    parser.add_argument("--learner-batch", type=int, default=8)
    parser.add_argument("--learner-seq-len", type=int, default=128)
    args = parser.parse_args(argv)
    recipes = args.recipes.split(",")
    cfg = BENCH_CONFIG
    print(f"config: {cfg.model_type}, {cfg.num_params / 1e6:.1f}M params, hidden "
          f"{cfg.hidden_size}, {cfg.num_layers} layers, vocab {cfg.vocab_size}; device "
          f"{jax.devices()[0].device_kind}")
    kernel = not args.xla_attention and decode_attention.usable(cfg.compute_dtype, cfg.head_dim)
    print(f"decode step: batch 8, 1 new token, 512-token KV cache; attention: "
          f"{'CPU decode attention kernel' if kernel else 'XLA'}")
    decode = time_decode(cfg, recipes, rounds=args.rounds, steps_per_round=args.steps_per_round,
                         cpu_attention=not args.xla_attention)
    print(format_table(decode, recipes[0]))
    params = init_params(cfg, jax.random.key(0))
    print(f"rollout bytes of the quantized linear layers / float32 bytes (int8): "
          f"{quantized_bytes_ratio(params, 'int8'):.4f}")
    t = time_requantize_vs_learner_step(cfg, "int8", args.learner_batch, args.learner_seq_len)
    ratio = t["requantize_s"] / t["learner_step_s"]
    print(f"requantize(int8): {t['requantize_s'] * 1e3:.1f} ms; learner step (batch "
          f"{args.learner_batch} x {args.learner_seq_len} tokens, fwd+bwd+AdamW): "
          f"{t['learner_step_s'] * 1e3:.1f} ms; requantize / learner step = {ratio:.3f}")


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()  # before JAX starts a backend
    main()
