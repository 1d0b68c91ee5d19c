"""Diagnostic: where the rollout's log-probs leave the learner's, op by op and layer by layer.

    python -m qurl_jax.bench.on_policy --model=outlier --precision=fp8_block
    python -m qurl_jax.bench.on_policy --model=smollm2 --precision=fp8_block --numerics=exact

Part 1, end to end: responses drawn by each rollout sampler (the static one, the refilling one
and the refilling one over a paged pool) with `precision`'s rollout actor, then their log-probs
recomputed by the learner as the trainer runs it (packed rows, the same training precision);
per sampler KL(behav || prox) k3, the mean and largest |log-prob gap| and the share of tokens
whose two log-probs are bitwise equal.

Part 2, layer by layer: the static sampler's sequences again, fed token by token through the
rollout's programs (the prompts' prefill, then one cached decode step per response token, over a
dense cache with the sampler's decode attention and over a paged pool) and through the learner's
packed forward, every module's output and every linear layer's input recorded
(`flax.linen.intercept_methods`). For each recorded value: the share of elements that differ and
the largest difference relative to the value's largest magnitude, at prompt tokens (prefill) and
response tokens (decode) apart; for a linear layer's input under an FP8 recipe, the share of its
E4M3 activation codes (1 x 128 groups) that differ. The first value that differs is the first op
that does. Recording changes the compiled programs (every value becomes an output), so part 2
shows where differences arise; part 1's figures are the real programs'.

Part 3 (`--step_ab`), cost: one RL step (requantize, rollout, packed update) with default and
with exact numerics, interleaved round by round in one process.

Models: `smollm2` (SmolLM2-135M-Instruct's real weights from its GGUF file) or `outlier` (a small
Llama-shaped model whose random weights carry real-like activation outliers, `outlier_model`).
Prints tables and one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax import quant
from qurl_jax.learner import packing as packing_lib
from qurl_jax.learner.learner import Learner, OptimConfig
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.models import attention as attn_lib
from qurl_jax.models import exact as exact_lib
from qurl_jax.models.config import NUMERICS
from qurl_jax.models.transformer import Linear
from qurl_jax.parallel import sharding as shd
from qurl_jax.quant._qtensor import quantize_row_groups
from qurl_jax.rl.objectives import ObjectiveConfig, mismatch_metrics
from qurl_jax.sampling import RefillSampler, Sampler, SamplingParams
from qurl_jax.sampling._cache import PagedKV, Paging

Params = dict[str, Any]
SAMPLERS = ("static", "refill", "paged")
PAGE_SIZE = 16

# The outlier model: Llama-shaped (tied head, no bias), small enough for tests.
OUTLIER_CONFIG = ModelConfig(model_type="llama", vocab_size=512, hidden_size=256,
                             intermediate_size=768, num_layers=6, num_heads=4, num_kv_heads=2,
                             head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5)


def outlier_model(config: ModelConfig = OUTLIER_CONFIG, seed: int = 0) -> tuple[ModelConfig,
                                                                               Params]:
    """(config, params): random weights with the activation outliers of trained LLMs.

    Trained decoders carry a few residual-stream channels hundreds of times larger than the rest
    ("massive activations") and heavy-tailed norm gains; the FP8 activation groups that hold such
    a channel then quantize everything else coarsely, and one rounding flip there is large. Here:
    every kernel normal with std 1 / sqrt(fan-in) times a per-input-channel factor drawn
    log-normal (sigma 1), the embedding normal (std 1) plus a constant 40 in two channels, and
    every RMSNorm gain log-normal (sigma 0.7)."""
    params = init_params(config, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    flat = {k: np.asarray(v) for k, v in _flatten(params).items()}
    out = {}
    for path, w in flat.items():
        name = path[-1]
        if name == "kernel":
            fan_in = w.shape[0]
            tails = rng.lognormal(0.0, 1.0, (fan_in, 1))
            out[path] = rng.normal(0.0, 1.0 / np.sqrt(fan_in), w.shape) * tails / np.sqrt(
                np.mean(tails ** 2))
        elif name == "embedding":
            e = rng.normal(0.0, 1.0, w.shape)
            e[:, :2] += 40.0
            out[path] = e
        elif name == "scale":
            out[path] = rng.lognormal(0.0, 0.7, w.shape)
        else:
            out[path] = w
    return config, _unflatten({k: jnp.asarray(v, jnp.float32) for k, v in out.items()})


def _flatten(tree: Params, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def _unflatten(flat: dict[tuple[str, ...], Any]) -> Params:
    out: Params = {}
    for path, v in flat.items():
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


def load_model(name: str, seed: int = 0) -> tuple[ModelConfig, Params]:
    """`outlier` (`outlier_model`) or `smollm2` (the real weights, from the fetched GGUF file)."""
    if name == "outlier":
        return outlier_model(seed=seed)
    if name == "smollm2":
        from qurl_jax.models.fetch import model_path
        from qurl_jax.models.gguf import load_gguf

        return load_gguf(model_path())
    raise ValueError(f"--model={name!r} must be 'outlier' or 'smollm2'")


def random_prompts(config: ModelConfig, count: int, seed: int = 0, shortest: int = 5,
                   longest: int = 29) -> list[list[int]]:
    """`count` prompts of random token ids (ids >= 2), lengths in [shortest, longest]."""
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(2, config.vocab_size, rng.integers(shortest,
                                                                          longest + 1))))
            for _ in range(count)]


# ------------------------------------------------------------------------------------ part 1
def make_sampler(kind: str, config: ModelConfig, precision: str, prompts: Sequence[Sequence[int]],
                 n: int, max_new_tokens: int) -> Any:
    """The rollout sampler `kind` ('static', 'refill', 'paged') for `precision`'s actor, on one
    device, its buckets fitting these prompts; the refilling ones hold a quarter of the rows."""
    rows = len(prompts) * n
    common = dict(max_prompt_len=max(len(p) for p in prompts), max_new_tokens=max_new_tokens,
                  mesh=shd.make_mesh())
    hook = quant.make_dot_general(precision)
    if kind == "static":
        return Sampler(config, hook, **common)
    if kind not in SAMPLERS:
        raise ValueError(f"sampler {kind!r} must be one of {SAMPLERS}")
    slots = max(rows // 4, 1)
    pages = 0
    if kind == "paged":
        longest = max(len(p) for p in prompts) + max_new_tokens
        pages = slots * -(-longest // PAGE_SIZE) + slots
    return RefillSampler(config, hook, max_concurrent_rows=slots, kv_pages=pages,
                         kv_page_size=PAGE_SIZE, **common)


def rollout_params(params: Params, precision: str) -> Params:
    """The rollout actor's parameters: `requantize`d for a quantized recipe (vocabulary tables in
    float, as Jet-RL's rollout keeps them), the float parameters for 'fp'."""
    recipe = quant.get_recipe(precision)
    return quant.requantize(params, recipe) if recipe.quantizes else params


def make_learner(config: ModelConfig, precision: str, temperature: float) -> Learner:
    """A one-device learner with packing on, as the trainer builds it."""
    return Learner(config, ObjectiveConfig(), OptimConfig(), shd.make_mesh(),
                   temperature=temperature, precision=precision, packing=True)


def end_to_end(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
               precision: str, sampler: str, n: int = 2, max_new_tokens: int = 24,
               temperature: float = 0.7, greedy: bool = False, seed: int = 0
               ) -> tuple[dict[str, float], Any]:
    """(mismatch figures, the sample output) of one rollout by `sampler` against the learner's
    recomputation: `mismatch_metrics` plus `tokens` (response tokens compared) and
    `equal_share` (share of them whose log-probs are bitwise equal)."""
    s = make_sampler(sampler, config, precision, prompts, n, max_new_tokens)
    settings = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature,
                              greedy=greedy)
    out = s.sample(rollout_params(params, precision), prompts, settings,
                   key=jax.random.key(seed), n=n)
    tokens, attn_mask, positions = out.sequences()
    learner = make_learner(config, precision, temperature)
    batch = learner.shard_batch({"tokens": tokens, "positions": positions,
                                 "attn_mask": attn_mask,
                                 "resp_mask": out.mask.astype(jnp.float32)})
    logp_prox = learner.logprobs(learner.shard_params(params), batch)
    metrics = {k: float(v) for k, v in mismatch_metrics(logp_prox, out.logp, out.mask).items()}
    mask = np.asarray(out.mask)
    metrics["tokens"] = float(mask.sum())
    equal = np.asarray(logp_prox) == np.asarray(out.logp)
    metrics["equal_share"] = float(equal[mask].mean()) if mask.any() else 1.0
    return metrics, out


# ------------------------------------------------------------------------------------ part 2
Record = dict[str, jax.Array]


def _recording(fn: Callable[[], Any], order: list[str] | None = None) -> tuple[Any, Record]:
    """fn()'s result and every module output it computed ('layers_3/mlp/up_proj') and every
    `Linear` input ('layers_3/mlp/up_proj:in'); their names in call order (a module's output
    after its children's) go to `order` (a jitted function's dict output comes back sorted)."""
    records: Record = {}

    def interceptor(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        path = "/".join(context.module.path) or "model"
        if context.method_name == "attend":
            path += ":attend"
        elif context.method_name != "__call__":
            return out
        if isinstance(context.module, Linear):
            records[path + ":in"] = args[0]
        value = out[0] if isinstance(out, tuple) else out
        if isinstance(value, jax.Array):
            records[path] = value
        return out

    with nn.intercept_methods(interceptor):
        result = fn()
    if order is not None:
        order[:] = list(records)
    return result, records


def _learner_record(learner: Learner, params: Params, tokens: np.ndarray, mask: np.ndarray,
                    response_len: int) -> tuple[Record, list[str], np.ndarray, np.ndarray]:
    """The learner's packed forward over sequences tokens i32[B, T] (real where mask): its
    records [R, L, ...], their names in call order and each sequence's packed (row, offset)."""
    order: list[str] = []
    lengths = packing_lib.sequence_lengths(mask)
    length = packing_lib.default_pack_length(tokens.shape[1])
    packed = packing_lib.pack(tokens, mask, response_len, length).arrays
    row, offset = packing_lib.first_fit_decreasing(lengths, length)

    @jax.jit
    def forward(params: Params, rows: dict[str, jax.Array]) -> Record:
        model, bound = quant.bind_train_precision(learner.model, params, learner.precision,
                                                  token_mask=rows["attn_mask"])
        _, rec = _recording(lambda: model.apply(
            {"params": bound}, rows["tokens"], rows["positions"], rows["attn_mask"],
            segment_ids=rows["segment_ids"]), order)
        return rec

    rows = {k: jnp.asarray(packed[k]) for k in ("tokens", "positions", "segment_ids",
                                                "attn_mask")}
    rec = forward(params, rows)
    return rec, order, row, offset


def _rollout_record(config: ModelConfig, params: Params, precision: str,
                    prompts: Sequence[Sequence[int]], n: int, responses: np.ndarray,
                    resp_mask: np.ndarray, paged: bool) -> tuple[Record, list[Record], int]:
    """The rollout's programs fed the given responses i32[B, G] (B = prompts x n, real where
    resp_mask): the prefill of the prompts (left-padded to their bucket, one row per prompt, the
    cache repeated n times as the static sampler does) and one decode step per response column,
    over the engine's dense cache and decode model or over a paged pool. Returns the prefill's
    records [P, p_len, ...], each step's [B, 1, ...] and the prompt bucket p_len."""
    sampler = Sampler(config, quant.make_dot_general(precision),
                      max_prompt_len=max(len(p) for p in prompts),
                      max_new_tokens=responses.shape[1], mesh=shd.make_mesh())
    engine = sampler.engine
    rp = rollout_params(params, precision)
    p_len, g_len = engine.buckets(max(len(p) for p in prompts), responses.shape[1])
    tokens = np.zeros((len(prompts), p_len), np.int32)
    pmask = np.zeros((len(prompts), p_len), bool)
    for i, p in enumerate(prompts):
        tokens[i, p_len - len(p):] = p
        pmask[i, p_len - len(p):] = True

    @jax.jit
    def prefill(params: Params, tokens: jax.Array, mask: jax.Array) -> tuple[Any, Record]:
        return _recording(lambda: engine.layout.prefill(engine.prompt_model, params, tokens,
                                                        mask))

    (_, cache), pre = prefill(rp, jnp.asarray(tokens), jnp.asarray(pmask))
    b = len(prompts) * n
    prepared = engine.preparer(b)(rp)
    model = engine.decode_model(prepared)
    if paged:
        layout = PagedKV(config, engine.kv_policy, engine.sharding,
                         Paging(b * -(-(p_len + g_len) // PAGE_SIZE), PAGE_SIZE))
        engine = type(engine)(config, engine.model.dot_general, max_prompt_len=p_len,
                              max_new_tokens=g_len, mesh=shd.make_mesh(),
                              paging=layout.paging)
        model = engine.decode_model(prepared)
        per_row = layout.pages_per_row(p_len + g_len)
        state = layout.with_table(layout.empty(b, p_len + g_len),
                                  jnp.arange(b * per_row, dtype=jnp.int32).reshape(b, per_row))
        state = layout.admit(state, jnp.arange(b, dtype=jnp.int32),
                             cache.repeat(n, cache.length))
    else:
        layout = engine.layout
        state = layout.repeat(cache, n, p_len + g_len)

    @jax.jit
    def step(params: Params, tok: jax.Array, cache: Any, live: jax.Array) -> tuple[Any, Record]:
        return _recording(lambda: layout.forward(model, params, tok, cache, live, False))

    steps = []
    for t in range(responses.shape[1]):
        live = jnp.asarray(resp_mask[:, t])
        (_, state), rec = step(prepared, jnp.asarray(responses[:, t]), state, live)
        steps.append(rec)
    return pre, steps, p_len


def _codes(x: np.ndarray) -> np.ndarray:
    """E4M3 codes of x[..., K] in 1 x 128 groups (the FP8 recipes' activation quantization)."""
    k = x.shape[-1]
    codes, _ = quantize_row_groups(jnp.asarray(x.reshape(-1, k)), quant.QuantFormat.FP8_E4M3,
                                   min(128, k))
    return np.asarray(codes.astype(jnp.float32))


def compare_layers(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]],
                   out: Any, *, precision: str, n: int, paged: bool = False
                   ) -> list[dict[str, Any]]:
    """Per recorded value, in the learner's call order: {'name', 'prefill' / 'decode': {'differ'
    (share of elements), 'rel' (largest |difference| / largest |learner value|), 'codes' (share
    of FP8 activation codes, for a linear input under a quantized recipe)}} for the sequences of
    `out` (a `SampleOutput` of these prompts, n samples each)."""
    tokens, attn_mask, _ = out.sequences()
    tokens, attn_mask = np.asarray(tokens), np.asarray(attn_mask)
    responses, resp_mask = np.asarray(out.tokens), np.asarray(out.mask)
    g = responses.shape[1]
    learner = make_learner(config, precision, 1.0)
    rec, order, row, offset = _learner_record(learner, params, tokens, attn_mask, g)
    pre, steps, p_len = _rollout_record(config, params, precision, prompts, n, responses,
                                        resp_mask, paged)
    quantized = quant.get_recipe(precision).quantizes
    rows = []
    for name in order:
        value = rec[name]
        if name not in pre or name.endswith(":attend") or not name.startswith("layers_") and (
                name not in ("embed_tokens", "norm")):
            continue
        lv = np.asarray(value)
        lrn_p, rol_p, lrn_d, rol_d = [], [], [], []
        for s in range(tokens.shape[0]):
            prompt = prompts[s // n]
            plen = len(prompt)
            base = int(offset[s])
            lrn_p.append(lv[row[s], base:base + plen])
            rol_p.append(np.asarray(pre[name])[s // n, p_len - plen:])
            for t in range(g):
                if resp_mask[s, t] and t + 1 < g and resp_mask[s, t + 1]:
                    lrn_d.append(lv[row[s], base + plen + t][None])
                    rol_d.append(np.asarray(steps[t][name])[s, 0][None])
        entry: dict[str, Any] = {"name": name}
        for part, a, b in (("prefill", lrn_p, rol_p), ("decode", lrn_d, rol_d)):
            if not a:
                continue
            a, b = np.concatenate(a), np.concatenate(b)
            stats = {"differ": float(np.mean(a != b)),
                     "rel": float(np.max(np.abs(a - b)) / max(np.max(np.abs(a)), 1e-30))}
            if quantized and name.endswith(":in"):
                stats["codes"] = float(np.mean(_codes(a) != _codes(b)))
            entry[part] = stats
        rows.append(entry)
    return rows


def first_difference(rows: Sequence[dict[str, Any]]) -> dict[str, str | None]:
    """The first recorded value (call order) that differs, at prefill and at decode tokens."""
    out: dict[str, str | None] = {}
    for part in ("prefill", "decode"):
        out[part] = next((r["name"] for r in rows if r.get(part, {}).get("differ", 0) > 0), None)
    return out


def _per_layer(rows: Sequence[dict[str, Any]], part: str) -> list[dict[str, float]]:
    """Per decoder layer: its output's relative difference and the mean share of FP8 activation
    codes that differ over its linear inputs."""
    out = []
    for i in range(1 + max(int(r["name"].split("/")[0][7:]) for r in rows
                           if r["name"].startswith("layers_"))):
        mine = [r for r in rows if r["name"].split("/")[0] == f"layers_{i}" and part in r]
        if not mine:
            continue
        layer = next((r[part] for r in mine if r["name"] == f"layers_{i}"), {})
        codes = [r[part]["codes"] for r in mine if "codes" in r[part]]
        out.append({"layer": i, "rel": layer.get("rel", float("nan")),
                    "differ": layer.get("differ", float("nan")),
                    "codes": float(np.mean(codes)) if codes else float("nan")})
    return out


def _xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                   k_valid: jax.Array, implementation: str,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """`models.exact.attention`'s signature, XLA's attention (`--xla_attention`)."""
    return attn_lib.attention(q, k, v, q_pos, k_pos, k_valid, implementation,
                              segment_ids=segment_ids)


# ------------------------------------------------------------------------------------ part 3
def step_ab(config: ModelConfig, params: Params, prompts: Sequence[Sequence[int]], *,
            precision: str, n: int = 8, max_new_tokens: int = 96, temperature: float = 0.7,
            micro_batches: int = 8, logprob_chunk: int = 128, rounds: int = 3, seed: int = 0
            ) -> dict[str, float]:
    """Seconds of one RL step with default and with exact numerics, interleaved round by round
    in one process (after a warm-up round each, which compiles): the actor requantized, the
    prompts sampled n times by the static sampler, one packed learner update whose pi_prox is
    its own forward (one minibatch, as configs/smollm2_135m_word.py). Returns per side the
    median step, rollout and update seconds, and exact / default."""
    mesh = shd.make_mesh()
    recipe = quant.get_recipe(precision)
    rows = len(prompts) * n
    settings = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    sides: dict[str, dict[str, Any]] = {}
    for numerics in ("default", "exact"):
        cfg = config.replace(numerics=numerics)
        learner = Learner(cfg, ObjectiveConfig(), OptimConfig(learning_rate=2e-5), mesh,
                          temperature=temperature, precision=precision, packing=True,
                          num_micro_batches=micro_batches,
                          logprob_batch_size=rows // micro_batches, logprob_chunk=logprob_chunk)
        p = learner.shard_params(params)
        sides[numerics] = dict(
            learner=learner, params=p, opt=learner.init_opt_state(p),
            sampler=Sampler(cfg, quant.make_dot_general(precision), mesh=mesh,
                            max_prompt_len=max(len(q) for q in prompts),
                            max_new_tokens=max_new_tokens),
            requantize=jax.jit(lambda w: quant.requantize(w, recipe) if recipe.quantizes else w),
            step=[], rollout=[], update=[], tokens=[])
    advantages = np.random.default_rng(seed).normal(size=rows).astype(np.float32)

    def one_round(side: dict[str, Any], r: int) -> None:
        learner = side["learner"]
        start = time.perf_counter()
        actor = side["requantize"](side["params"])
        out = side["sampler"].sample(actor, prompts, settings, key=jax.random.key(seed + r), n=n)
        tokens, attn_mask, positions = out.sequences()
        jax.block_until_ready(out.logp)
        middle = time.perf_counter()
        batch = learner.shard_batch({"tokens": tokens, "positions": positions,
                                     "attn_mask": attn_mask,
                                     "resp_mask": out.mask.astype(jnp.float32),
                                     "logp_behav": out.logp, "advantages": advantages})
        side["params"], side["opt"], metrics = learner.update(side["params"], side["opt"], batch)
        jax.block_until_ready((side["params"], metrics))
        end = time.perf_counter()
        if r:
            side["step"].append(end - start)
            side["rollout"].append(middle - start)
            side["update"].append(end - middle)
            side["tokens"].append(float(np.sum(np.asarray(out.mask))))

    for r in range(rounds + 1):
        for side in sides.values():
            one_round(side, r)
    report: dict[str, float] = {}
    for name, side in sides.items():
        for key in ("step", "rollout", "update", "tokens"):
            report[f"{name}/{key}"] = float(np.median(side[key]))
    for key in ("step", "rollout", "update"):
        report[f"exact_over_default/{key}"] = report[f"exact/{key}"] / report[f"default/{key}"]
    return report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="outlier", choices=("outlier", "smollm2"))
    parser.add_argument("--precision", default="fp8_block", choices=("fp", "fp8_block"))
    parser.add_argument("--numerics", default="default", choices=NUMERICS,
                        help="ModelConfig.numerics of both sides (train.on_policy_numerics)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--max_new_tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--greedy", action="store_true")
    parser.add_argument("--samplers", default=",".join(SAMPLERS))
    parser.add_argument("--no_layers", action="store_true", help="skip part 2")
    parser.add_argument("--step_ab", action="store_true",
                        help="instead: one RL step's seconds with default and exact numerics, "
                             "interleaved (part 3; --prompts x --n rows)")
    parser.add_argument("--rounds", type=int, default=3, help="with --step_ab")
    parser.add_argument("--xla_attention", action="store_true",
                        help="with --numerics=exact: attention left to XLA (the default path's), "
                             "every other op exact: what remains where only attention is not "
                             "invariant (the TPU and GPU formulation)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    config, params = load_model(args.model, args.seed)
    if args.step_ab:
        prompts = random_prompts(config, args.prompts, args.seed, 60, 110)
        r = step_ab(config, params, prompts, precision=args.precision, n=args.n,
                    max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                    rounds=args.rounds, seed=args.seed)
        print(f"{args.model}, {args.precision}: one RL step ({args.prompts} prompts x {args.n}, "
              f"up to {args.max_new_tokens} tokens), medians of {args.rounds} interleaved rounds")
        for name in ("default", "exact"):
            step, roll, upd = (r[f"{name}/{k}"] for k in ("step", "rollout", "update"))
            print(f"  {name:8s} step {step:7.2f} s  rollout {roll:6.2f} s  update {upd:6.2f} s "
                  f"({r[name + '/tokens']:.0f} tokens)")
        ratio = {k: r[f"exact_over_default/{k}"] for k in ("step", "rollout", "update")}
        print(f"  exact / default: step {ratio['step']:.2f}x, rollout {ratio['rollout']:.2f}x, "
              f"update {ratio['update']:.2f}x")
        print(json.dumps(r))
        return
    config = config.replace(numerics=args.numerics)
    if args.xla_attention:
        exact_lib.attention = _xla_attention
    prompts = random_prompts(config, args.prompts, args.seed)
    report: dict[str, Any] = {"model": args.model, "precision": args.precision,
                              "numerics": args.numerics}
    print(f"{args.model}: {config.num_layers} layers, hidden {config.hidden_size}; "
          f"precision {args.precision}, numerics {args.numerics}; {args.prompts} prompts x "
          f"{args.n}, up to {args.max_new_tokens} tokens, T = {args.temperature}"
          f"{' greedy' if args.greedy else ''}")
    print(f"{'sampler':8s} {'tokens':>6s} {'KL k3':>10s} {'mean|gap|':>10s} {'max|gap|':>10s} "
          f"{'bit-equal':>9s}")
    static_out = None
    for kind in args.samplers.split(","):
        m, out = end_to_end(config, params, prompts, precision=args.precision, sampler=kind,
                            n=args.n, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, greedy=args.greedy, seed=args.seed)
        static_out = out if kind == "static" else static_out
        report[kind] = m
        print(f"{kind:8s} {m['tokens']:6.0f} {m['kl_behav_prox_k3']:10.3e} "
              f"{m['logp_gap_abs_mean']:10.3e} {m['logp_gap_abs_max']:10.3e} "
              f"{m['equal_share']:9.1%}")
    if not args.no_layers and static_out is not None:
        for paged in (False, True):
            label = "paged" if paged else "dense"
            rows = compare_layers(config, params, prompts, static_out,
                                  precision=args.precision, n=args.n, paged=paged)
            first = first_difference(rows)
            report[f"layers_{label}"] = rows
            report[f"first_{label}"] = first
            print(f"\n{label} cache: first value that differs: prefill {first['prefill']}, "
                  f"decode {first['decode']}")
            print(f"{'layer':>5s} | {'prefill: out differ':>19s} {'rel':>9s} {'codes':>9s} | "
                  f"{'decode: out differ':>18s} {'rel':>9s} {'codes':>9s}")
            pre, dec = _per_layer(rows, "prefill"), _per_layer(rows, "decode")
            for p, d in zip(pre, dec, strict=False):
                print(f"{p['layer']:5d} | {p['differ']:19.1%} {p['rel']:9.2e} {p['codes']:9.2e} "
                      f"| {d['differ']:18.1%} {d['rel']:9.2e} {d['codes']:9.2e}")
    print(json.dumps(report))


if __name__ == "__main__":
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()
    main(sys.argv[1:])
