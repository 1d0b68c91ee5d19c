"""One learner update of a full fine-tune against LoRA updates on a frozen int8 base, in one run.

    python -m qurl_jax.bench.lora [--layers=30] [--rank=16] [--rows=64] [--rounds=3]
        [--products=weight_only,w8a8] [--lora_micro_batches=16]

SmolLM2-135M's shapes (`bench.learner_vs_torch.smollm2_shapes`, random weights), the word-problem
config's learner (prompts up to 128 tokens, responses 16..96, packed, 8 micro-batches, AdamW,
the ACR objective) for the full fine-tune; LoRA (rank-16 adapters on every projection) once per
`--products` (`model.lora.learner_products`: the base read weight-only, or the rollout's W8A8
product), with `--lora_micro_batches` micro-batches. Every learner is compiled first, then timed
in mirrored order (A B C C B A) `rounds` times (each side's median of its 2 x rounds updates), so
load drifts hit every side alike. A ratio, not an absolute time: it leaves out the rollout, which
both runs share (the whole step's ratio is lower; docs/lora.md).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from qurl_jax import lora, quant
from qurl_jax.bench.learner_vs_torch import batch, smollm2_shapes
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import init_params
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig

_LAYERS = flags.DEFINE_integer("layers", 30, "Decoder layers of the SmolLM2-shaped model.")
_RANK = flags.DEFINE_integer("rank", 16, "LoRA rank (alpha = 2 x rank).")
_ROWS = flags.DEFINE_integer("rows", 64, "Sequences in the update's batch.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Mirrored rounds (A B C C B A).")
_PRODUCTS = flags.DEFINE_list("products", list(lora.LEARNER_PRODUCTS),
                              "model.lora.learner_products to time, one LoRA side each.")
_LORA_MICRO = flags.DEFINE_integer("lora_micro_batches", 8, "Micro-batches of the LoRA sides.")


def run(layers: int = 30, rank: int = 16, rows: int = 64, rounds: int = 3,
        products: tuple[str, ...] = lora.LEARNER_PRODUCTS, lora_micro_batches: int = 8
        ) -> dict[str, float]:
    """Median seconds per update of each side ('full', 'lora_<products>') and each LoRA side's
    speed-up over the full fine-tune ('full_over_lora_<products>')."""
    config = smollm2_shapes(layers)
    mesh = shd.make_mesh(1, 1, 1)
    objective = ObjectiveConfig(mode="acr", cap=2.0)
    optim = OptimConfig(learning_rate=1e-5, weight_decay=0.0)
    kwargs = dict(temperature=0.7, logprob_chunk=128, packing=True)
    params = init_params(config, jax.random.key(0))
    cfgs = {f"lora_{p}": lora.LoraConfig(rank=rank, alpha=2.0 * rank, learner_products=p)
            for p in products}
    base = lora.quantize_base(params, lora.LoraConfig(rank=rank),
                              quant.get_recipe("int8", quantize_vocab=True), jnp.float32)
    adapter = lora.init_adapter(jax.random.key(1), params, lora.LoraConfig(rank=rank))
    host = batch(rows, 128, 96, config.vocab_size)
    rng = np.random.default_rng(1)
    host["logp_behav"] = -rng.uniform(0.5, 3.0, host["resp_mask"].shape).astype(np.float32)
    host["advantages"] = rng.normal(size=rows).astype(np.float32)
    sides = {}
    for name, learner_cfg in (("full", None), *cfgs.items()):
        learner = Learner(config, objective, optim, mesh, lora=learner_cfg,
                          num_micro_batches=lora_micro_batches if learner_cfg else 8, **kwargs)
        state = [learner.shard_params(adapter if learner_cfg else params)]
        state.append(learner.init_opt_state(state[0]))
        frozen = base if learner_cfg else None

        def update(learner=learner, state=state, frozen=frozen) -> float:
            start = time.perf_counter()
            state[0], state[1], m = learner.update(state[0], state[1],
                                                   learner.shard_batch(host), frozen)
            jax.block_until_ready((state[0], m))
            return time.perf_counter() - start

        update()  # compile
        sides[name] = (update, [])
    del params
    order = list(sides)
    for _ in range(rounds):
        for name in order + order[::-1]:
            sides[name][1].append(sides[name][0]())
    out = {f"{name}_s": float(np.median(times)) for name, (_, times) in sides.items()}
    for name in cfgs:
        out[f"full_over_{name}"] = out["full_s"] / out[f"{name}_s"]
    return out


def main(argv: list[str]) -> None:
    del argv
    print(run(_LAYERS.value, _RANK.value, _ROWS.value, _ROUNDS.value, tuple(_PRODUCTS.value),
              _LORA_MICRO.value))


if __name__ == "__main__":
    app.run(main)
