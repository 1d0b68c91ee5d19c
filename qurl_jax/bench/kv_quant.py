"""Accuracy of the rollout's 8-bit KV cache (`rollout.kv_precision`) on a trained checkpoint.

Run `python -m qurl_jax.bench.kv_quant --llama2c=PATH/stories260K.bin [--lengths=128,512]
[--json=PATH]`, or `--gguf=PATH.gguf` for a GGUF model (SmolLM2-135M-Instruct:
`python -m qurl_jax.models.fetch`). The full-precision model samples `--seqs` sequences of each
length from token 1 (temperature 1, its own distribution); then, on those tokens, the mean per-token
KL(fp || rollout) of the next-token distribution, where the rollout is:

- `int8 weights`: the int8 W8A8 actor (`quant.requantize`, the trainer's default recipe with its
  int8 vocabulary tables), full-precision KV;
- `int8 KV` / `fp8 KV`: the full-precision weights over an 8-bit cache;
- `int8 weights + int8 KV`: both;
- `int8 KV, per sequence` / `fp8 KV, per sequence`: `rollout.kv_scale='sequence'`, one scale
  per sequence, layer and kv head, set by the first `--prompt_len` tokens (the prompt's part).

The rollout's logits come from one cached forward over the whole sequence (the prefill path):
every key and value is quantized as it is written, with its own per-token scale, so each
position's logits are those a token-by-token decode computes (no scale depends on other tokens).
With per-sequence scales, two: the prompt's tokens (which set the scales), then the rest at those
scales (clipped), which again is what a token-by-token decode computes. Long contexts are where
KV error accumulates: the largest length is at most the checkpoint's positions.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import quant
from qurl_jax.models.kv_quant import KVPrecision
from qurl_jax.models.llama2c import load_llama2c
from qurl_jax.models.transformer import KVCache, Transformer, positions_from_mask
from qurl_jax.sampling import Sampler, SamplingParams

VARIANTS = (("int8 weights", True, KVPrecision.BF16, "token"),
            ("int8 KV", False, KVPrecision.INT8, "token"),
            ("fp8 KV", False, KVPrecision.FP8, "token"),
            ("int8 weights + int8 KV", True, KVPrecision.INT8, "token"),
            ("int8 KV, per sequence", False, KVPrecision.INT8, "sequence"),
            ("fp8 KV, per sequence", False, KVPrecision.FP8, "sequence"))


def self_sampled(config: Any, params: Any, seqs: int, length: int, seed: int) -> np.ndarray:
    """i32[seqs, length]: token 1, then length - 1 tokens the model samples at temperature 1."""
    sampler = Sampler(config, max_prompt_len=16, max_new_tokens=length - 1,
                      gen_buckets=[length - 1])
    out = sampler.sample(params, [[1]] * seqs, key=jax.random.key(seed), n=1,
                         settings=SamplingParams(max_new_tokens=length - 1, temperature=1.0))
    tokens = np.asarray(out.tokens)
    return np.concatenate([np.ones((seqs, 1), np.int32), tokens], axis=1)


def log_probs(config: Any, params: Any, tokens: np.ndarray, dot_general: Any,
              precision: KVPrecision, kv_scale: str = "token", prompt_len: int = 0
              ) -> jax.Array:
    """f32[B, T, V] log-softmax of the logits at every position, through a cache at
    `precision` (the rollout's path) written by one forward, or with per-sequence scales by two:
    the first `prompt_len` tokens, then the rest."""
    model = Transformer(config.replace(kv_scale=kv_scale), dot_general=dot_general)
    positions = positions_from_mask(np.ones(tokens.shape, bool))
    split = prompt_len if kv_scale == "sequence" else tokens.shape[1]

    @jax.jit
    def run(params, cache):
        logits, cache = model.apply({"params": params}, tokens[:, :split], positions[:, :split],
                                    cache=cache)
        if split < tokens.shape[1]:
            rest, _ = model.apply({"params": params}, tokens[:, split:], positions[:, split:],
                                  cache=cache)
            logits = jnp.concatenate([logits, rest], axis=1)
        return jax.nn.log_softmax(logits)

    return run(params, KVCache.zeros(config, tokens.shape[0], tokens.shape[1],
                                      precision=precision))


def mean_kl(lp: jax.Array, lq: jax.Array) -> float:
    """Mean over positions of KL(p || q) of log-probs f32[B, T, V]."""
    return float(jnp.mean(jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--llama2c", help="a llama2.c checkpoint (.bin)")
    source.add_argument("--gguf", help="a GGUF model file (llama.cpp's format)")
    parser.add_argument("--lengths", default="128,512", help="sequence lengths, comma separated")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt_len", type=int, default=64,
                        help="tokens that set a sequence's scales (the per-sequence variants)")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.gguf:
        from qurl_jax.models.gguf import load_gguf

        config, params = load_gguf(args.gguf)
    else:
        config, params = load_llama2c(args.llama2c)
    params = jax.tree.map(jnp.asarray, params)
    recipe = quant.get_recipe("int8", quantize_vocab=True)
    rollout = quant.requantize(params, recipe)
    int8_dot = quant.make_dot_general(recipe)
    rows = []
    print(f"{args.gguf or args.llama2c}: {config.num_layers} layers, {config.num_kv_heads} kv "
          f"heads of head_dim {config.head_dim}, {config.max_position_embeddings} positions; "
          f"{args.seqs} self-sampled sequences per length; mean per-token KL(fp || rollout), "
          f"nats; per-sequence scales set by the first {args.prompt_len} tokens")
    for length in map(int, args.lengths.split(",")):
        if length > config.max_position_embeddings:
            raise SystemExit(f"--lengths: {length} is past the checkpoint's "
                             f"{config.max_position_embeddings} positions")
        tokens = self_sampled(config, params, args.seqs, length, args.seed)
        fp = log_probs(config, params, tokens, jax.lax.dot_general, KVPrecision.BF16)
        for name, int8_weights, precision, kv_scale in VARIANTS:
            lq = log_probs(config, rollout if int8_weights else params, tokens,
                           int8_dot if int8_weights else jax.lax.dot_general, precision,
                           kv_scale, min(args.prompt_len, length))
            row = {"length": length, "rollout": name, "kl": mean_kl(fp, lq)}
            rows.append(row)
            print(f"  length {length:>5}  {name:<24} {row['kl']:.5f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
