"""Compiled FLOPs of a config's learner per RL step, packed vs padded (`bench.learner --flops`).

`python -m qurl_jax.bench.learner --flops --config=configs/deepscaler_r1_1p5b_int8.py
--target=tpu:v5p-16`

One RL step's learner work is the log-prob recomputation (pi_prox unless the update's own forward
gives it, `learner.prox`, and pi_ref when `rl.kl_coef` > 0) of the whole rollout and the update of
each of `rl.num_minibatches` minibatches. Its lengths are drawn from the configs' distribution
(`bench.learner.long_tailed_batch`: responses log-normal with median a quarter of
`rollout.max_new_tokens`, prompts about 120 / 1024 of `data.max_prompt_len`), `prompts_per_step x
n` sequences; the padded layout's shapes do not depend on them, the packed layout's come from
packing these sequences with the learner's own packer (`train.tokens_per_micro_batch` micro-batches
and log-prob slices, or `rl.num_micro_batches` slices of sequences).

The count is the target compiler's: `compiled.cost_analysis()['flops']` of one micro-batch's
update (forward, backward and the optimizer step) and one log-prob slice, each compiled on the
config's mesh over the target's devices (per device: the partitioned program), times how many
the step runs. XLA's cost analysis counts a while loop's body once, whatever its trip count, so
the counted programs have none: the decoder layers unrolled (`scan_layers` off), the LM head in
one chunk of the whole row (`logprob_chunk` = row length), dense attention (blockwise and splash
loop over key blocks; dense computes every query x key score of a row, causal and segment masks
included, which bounds what a blockwise kernel that skips masked blocks computes), and one
micro-batch or slice per program. Each is compiled at 1 and 2 decoder layers and extrapolated
linearly to the model's depth (the layers are identical programs; the full depth unrolled takes
the TPU compiler many minutes per program on a small CPU). Remat, precision, mesh and the
objective are the config's. Nothing runs: these are compiler counts, not measurements.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.bench.sampler import tail_limits
from qurl_jax.config.base import load_config_file
from qurl_jax.config.settings import RunSettings
from qurl_jax.learner import packing
from qurl_jax.learner.learner import batch_spec
from qurl_jax.learner.prox import prox_source
from qurl_jax.models import init_params, positions_from_mask
from qurl_jax.parallel import sharding as shd
from qurl_jax.parallel import targets
from qurl_jax.plan import memory_plan


def long_tailed_batch(rows: int, max_prompt_len: int, max_new_tokens: int, vocab: int,
                      seed: int = 0) -> dict[str, np.ndarray]:
    """A padded learner batch (numpy) at the configs' length distribution (module doc)."""
    rng = np.random.default_rng(seed)
    resp = tail_limits(rows, max_new_tokens, seed)
    prompt = np.clip(np.round(rng.uniform(0.06, 0.18, rows) * max_prompt_len), 1,
                     max_prompt_len).astype(np.int32)
    return padded_batch(rng, prompt, resp, max_prompt_len, max_new_tokens, vocab)


def padded_batch(rng: np.random.Generator, prompt: np.ndarray, resp: np.ndarray,
                 max_prompt_len: int, max_new_tokens: int, vocab: int) -> dict[str, np.ndarray]:
    """A padded learner batch (numpy) of rows with `prompt` and `resp` real tokens (left-padded
    prompts, right-padded responses): random tokens, behaviour log-probs and advantages."""
    rows, p, g = len(prompt), max_prompt_len, max_new_tokens
    mask = np.concatenate([np.arange(p)[None] >= (p - prompt)[:, None],
                           np.arange(g)[None] < resp[:, None]], axis=1)
    return {"tokens": rng.integers(0, vocab, (rows, p + g)).astype(np.int32),
            "positions": positions_from_mask(mask).astype(np.int32), "attn_mask": mask,
            "resp_mask": mask[:, p:].astype(np.float32),
            "logp_behav": -rng.uniform(0.5, 4.0, (rows, g)).astype(np.float32),
            "advantages": rng.normal(size=rows).astype(np.float32)}


def _spec(mesh: Any, shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=shd.batch_sharding(mesh, len(shape)))


def _flops(compiled: jax.stages.Compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    if not cost or "flops" not in cost:  # XLA's GPU pipeline (jax 0.10.2) returns None
        raise SystemExit("qurl_jax: bad flag --target: its compiler gives no cost analysis of a "
                         "compiled program; compile for a TPU target (tpu:v5p-16, ...)")
    return float(cost["flops"])


def count(config_path: str, target_name: str, seed: int = 0,
          log: Any = print) -> dict[str, Any]:
    """The per-step compiled FLOPs (per device) of the config's learner, padded and packed, and
    the real-token share of what each computes; JSON-able."""

    config = load_config_file(config_path)
    settings = RunSettings.from_config(config)
    shapes_dir = os.path.join(os.path.dirname(os.path.abspath(config_path)), "shapes")
    target = targets.parse(target_name)
    model_config = memory_plan.model_shape(settings.model, shapes_dir).replace(attention="dense")
    p, g = settings.data.max_prompt_len, settings.rollout.max_new_tokens
    t = p + g
    train = dataclasses.replace(settings.train, scan_layers=False,
                                logprob_chunk=max(t, 1 << 20))
    rows = settings.rollout_rows
    minibatches = train.num_minibatches
    epochs = int(config.rl.ppo_epochs)
    host = long_tailed_batch(rows, p, g, model_config.vocab_size, seed)
    mask = host["attn_mask"]
    real = int(mask.sum())
    mesh = shd.make_mesh(settings.mesh.data, settings.mesh.fsdp, settings.mesh.tensor,
                         devices=target.devices())
    devices = int(mesh.shape["data"] * mesh.shape["fsdp"])
    # Log-prob passes: pi_prox unless the update's forward gives it (`learner.prox`, as the
    # trainer decides), and pi_ref with a KL term.
    prox = prox_source(num_minibatches=minibatches, ppo_epochs=epochs, precision=train.precision)
    kl = bool(train.objective.kl_coef)
    ref = int(prox.recompute) + int(kl)
    mb = rows // minibatches
    # pi_prox's pass leaves out the first minibatch's rows when their update's forward gives it
    prox_rows = rows - mb if prox.skip_first else rows
    i32 = jnp.int32
    per_seq = ("resp_mask", "logp_behav", "advantages") + (
        ("logp_prox",) if prox.recompute else ()) + (
        ("prox_from_forward",) if prox.skip_first else ()) + (
        ("logp_ref",) if kl else ())

    def learner(packing_on: bool, budget: int, layers: int):
        tr = dataclasses.replace(train, packing=packing_on, tokens_per_micro_batch=budget,
                                 num_micro_batches=1)
        shape = model_config.replace(num_layers=layers)
        ln = tr.learner(shape, mesh, temperature=settings.rollout.temperature,
                        rollout_rows=rows)
        ln.logprob_batch_size = 0
        params, opt = ln.abstract_state(
            jax.eval_shape(lambda: init_params(shape, jax.random.key(0))))
        return ln, params, opt

    def compile_pair(packing_on: bool, budget: int, update_batch: dict[str, Any] | None,
                     logprob_batch: dict[str, Any]) -> tuple[float, float]:
        """FLOPs per device of one update micro-batch (0 without `update_batch`) and one log-prob
        slice at the model's depth: compiled at 1 and 2 decoder layers, extrapolated linearly
        (every layer is the same program; an unrolled 28-layer compile takes far longer)."""
        counted = {}
        for layers in (1, 2):
            ln, params, opt = learner(packing_on, budget, layers)
            upd = 0.0 if update_batch is None else _flops(ln.update_fn(
                params, opt, update_batch).lower(params, opt, update_batch, None).compile())
            lp = ln.logprobs_fn(params, logprob_batch).lower(params, logprob_batch, None).compile()
            counted[layers] = (upd, _flops(lp))
            log(f"  {layers} layer(s): update micro-batch {counted[layers][0]:.4g}, log-prob "
                f"slice {counted[layers][1]:.4g} FLOPs per device")
        depth = model_config.num_layers
        return tuple(counted[1][i] + (depth - 1) * (counted[2][i] - counted[1][i])
                     for i in range(2))

    out: dict[str, Any] = {"config": config_path, "target": target.name, "rows": rows,
                           "prompt_len": p, "max_new_tokens": g, "real_tokens": real,
                           "minibatches": minibatches, "ppo_epochs": epochs,
                           "logprob_passes": ref, "prox_pass_rows": prox_rows if prox.recompute
                           else 0}

    # Padded: micro-batches of micro_batch_rows sequences of P + G; log-prob slices the same.
    micro = settings.train.micro_batch_rows(rows)
    log(f"padded: micro-batches and log-prob slices of {micro} rows x {t}")
    ub = {k: _spec(mesh, *batch_spec(k, micro, p, g))
          for k in ("tokens", "positions", "attn_mask") + per_seq}
    lb = {k: ub[k] for k in ("tokens", "positions", "attn_mask", "resp_mask", "logp_behav")}
    upd, lp = compile_pair(False, 0, ub, lb)
    n_upd = rows // micro * epochs
    n_lp = (prox_rows // micro if prox.recompute else 0) + (rows // micro if kl else 0)
    out["padded"] = {"update_programs": n_upd, "logprob_programs": n_lp,
                     "update_flops": upd * n_upd, "logprob_flops": lp * n_lp,
                     "computed_tokens": rows * t * epochs, "real_token_share": real / (rows * t)}

    # Packed, as the config's learner packs (its pack length and token budget).
    length = settings.train.pack_length or packing.default_pack_length(t)
    budget = settings.train.tokens_per_micro_batch
    if not budget:
        raise SystemExit("qurl_jax: --flops needs config.train.tokens_per_micro_batch (packed "
                         "slices of micro_batch_rows sequences are as many rows as padded ones "
                         "when a micro-batch is one sequence per device)")
    # each process's rows of a micro-batch, and the processes
    local, count = learner(True, budget, 1)[0]._budget_rows(length)
    shards = devices // count
    per = local * count

    def plan(m: np.ndarray) -> tuple[int, int]:
        """(micro-batches, global sequence slots of one) of these sequences, as
        `Learner.pack_budget_batch` packs them: each process its contiguous block."""
        blocks = np.split(m, count)
        sizes = train.pack_buckets
        num = packing.bucket_rows(max(packing.budget_micro_batches(b, length, local)
                                      for b in blocks), 1, sizes)
        most = max(packing.budget_assignment(b, length, num)[3] for b in blocks)
        return num, packing.bucket_rows(most, shards, sizes) * count

    rng = np.random.default_rng(seed)
    update_micro, update_seqs = 0, 0
    lengths = packing.sequence_lengths(mask)
    first = None  # the first update's rows
    for _ in range(epochs):  # the trainer's minibatches: a random permutation each epoch
        order = rng.permutation(rows)
        for i in range(minibatches):
            idx = np.sort(order[i * mb:(i + 1) * mb])
            if minibatches > 1:  # as `Trainer._update`: each process's block, equal tokens
                idx = packing.balance_blocks(idx, lengths[idx], count)
            first = idx if first is None else first
            num, slots = plan(mask[idx])
            update_micro += num
            update_seqs = max(update_seqs, slots)
    lp_m, lp_seqs = plan(mask)
    if prox.skip_first:  # the pass over the other minibatches' rows
        prox_m, prox_seqs = plan(mask[np.setdiff1d(np.arange(rows), first)])
    else:
        prox_m, prox_seqs = lp_m, lp_seqs
    log(f"packed: rows of {length}, {per} a micro-batch; update {update_micro} micro-batches "
        f"over {minibatches} minibatches x {epochs} epochs, log-probs {lp_m} slices"
        + (f" (pi_prox: {prox_m} slices of {prox_rows} rows)" if prox.skip_first else ""))

    packed_rows = {k: _spec(mesh, (per, length), jnp.bool_ if k == "attn_mask" else i32)
                   for k in ("tokens", "positions", "segment_ids", "attn_mask")}

    def packed_batch(slots: int, seq_rows: int, keys: tuple[str, ...]) -> dict[str, Any]:
        """One update micro-batch's (or with shared prompts one log-prob slice's): the rows,
        their sequence slots and each slot's response index (`packing.SLOT_KEYS`, or with
        shared prompts one per response token)."""
        index = (("resp_index", (slots, g)) if train.share_prompts > 1
                 else ("resp_span", (slots, 3)))
        return {**packed_rows, "seq_index": _spec(mesh, (slots,), i32),
                index[0]: _spec(mesh, index[1], i32),
                **{k: _spec(mesh, *batch_spec(k, seq_rows, p, g)) for k in keys}}

    def logprob_batch(slots: int, seq_rows: int) -> dict[str, Any]:
        """One log-prob slice's: the rows and the sequences' `resp_flat` index
        (`packing.TOKEN_KEYS`), or with shared prompts their slots."""
        if train.share_prompts > 1:
            return packed_batch(slots, seq_rows, ("resp_mask",))
        return {**packed_rows, "resp_flat": _spec(mesh, (seq_rows, g), i32)}

    upd, lp = compile_pair(True, budget, packed_batch(update_seqs, mb, per_seq),
                           logprob_batch(lp_seqs, rows))
    lp_prox = lp
    if prox.recompute and (prox_seqs, prox_rows) != (lp_seqs, rows):
        # The pi_prox pass's slices hold another number of sequence slots: their own program.
        lp_prox = compile_pair(True, budget, None, logprob_batch(prox_seqs, prox_rows))[1]
    lp_flops = (lp_prox * prox_m if prox.recompute else 0.0) + (lp * lp_m if kl else 0.0)
    # Beside it, the same step with pi_prox's pass over every row (as before `prox.skip_first`,
    # and as where the update's forward gives pi_prox the pass would be)
    full_recompute = lp * lp_m * (1 + int(kl))
    out["packed"] = {"pack_length": length, "rows_per_micro_batch": per,
                     "update_programs": update_micro,
                     "logprob_programs": (prox_m if prox.recompute else 0) + (lp_m if kl else 0),
                     "update_flops": upd * update_micro, "logprob_flops": lp_flops,
                     "computed_tokens": update_micro * per * length,
                     "real_token_share": real * epochs / (update_micro * per * length),
                     "logprob_real_token_share": real / (lp_m * per * length),
                     "prox_logprob_programs": prox_m if prox.recompute else 0,
                     "step_flops_full_recompute": upd * update_micro + full_recompute}
    for side in ("padded", "packed"):
        out[side]["step_flops"] = out[side]["update_flops"] + out[side]["logprob_flops"]
    out["fewer_flops"] = out["padded"]["step_flops"] / out["packed"]["step_flops"]
    return out


def describe(out: dict[str, Any]) -> list[str]:
    lines = [f"{out['config']} on {out['target']}: {out['rows']} sequences of "
             f"{out['prompt_len']} + {out['max_new_tokens']} slots, {out['real_tokens']} real "
             f"tokens; compiler FLOPs per device per RL step (cost_analysis, not measured)",
             f"{'layout':<8}{'update':>12}{'log-probs':>12}{'step':>12}{'programs':>10}"
             f"{'real share':>12}"]
    for side in ("padded", "packed"):
        o = out[side]
        lines.append(f"{side:<8}{o['update_flops']:>12.4g}{o['logprob_flops']:>12.4g}"
                     f"{o['step_flops']:>12.4g}"
                     f"{o['update_programs'] + o['logprob_programs']:>10}"
                     f"{o['real_token_share']:>12.3f}")
    lines.append(f"packed: {out['fewer_flops']:.2f}x fewer compiled FLOPs per step")
    full = out["packed"]["step_flops_full_recompute"]
    if full != out["packed"]["step_flops"]:
        lines.append(f"packed, pi_prox recomputed over every row instead: {full:.4g} per step "
                     f"({full / out['packed']['step_flops']:.3f}x this step's)")
    return lines
