"""Checks of a run before anything is written: lengths against the model, settings that cannot
learn, and the data itself.

- `check_context(c)`: the longest row the rollout and the evaluation sample (data.max_prompt_len +
  rollout.max_new_tokens, and + eval.max_new_tokens) must fit the model's positions (`model.
  max_positions` where set, else `model.tiny.max_position_embeddings` or `model.path`'s
  config.json).
- `check_learnable(c)`: settings under which nothing learns are errors: one sample per prompt
  (every group advantage is 0), greedy sampling (`top_k=1`: the samples of a prompt are the same,
  so again every advantage is 0), an importance-weight cap below 1 (every on-policy token is
  truncated: the cap no longer corrects a mismatch, it scales every gradient by C), a MIS or
  Sparse-RL band without the on-policy weight 1, a Sparse-RL veto threshold >= 1 (both drop
  nearly every token or sequence).
- `check_packing(c)`: with `train.packing`, a `train.pack_length` shorter than the longest
  sequence, or a `train.tokens_per_micro_batch` under one packed row, is an error.
- `check_exact_numerics(c)`: `train.on_policy_numerics='exact'` with a rollout the learner does
  not run (a per-channel int8 / fp8 actor, int8 vocabulary tables, an 8-bit or compressed KV
  cache) is an error: no fixed order can make those log-probs the learner's.
- `slow_settings(c)`: settings that only make a run slow, as warnings: a rollout that decodes one
  row at a time (`max_concurrent_rows=1`, or a paged KV pool that holds one row).
  `config.validate` runs the first two; the trainer logs the third.
"""

from __future__ import annotations

import json

import ml_collections

from qurl_jax.runtime import paths
from qurl_jax.runtime.errors import ConfigError


def model_positions(c: ml_collections.ConfigDict) -> tuple[int, str] | None:
    """(positions the model was built for, where that number comes from), or None when
    `model.path`'s config.json cannot be read as a supported model (loading it reports why);
    `model.max_positions` where it is set."""
    if c.model.max_positions:
        return c.model.max_positions, "model.max_positions"
    if c.model.source == "tiny":
        return c.model.tiny.max_position_embeddings, "model.tiny.max_position_embeddings"
    if c.model.source == "gguf":
        from qurl_jax.models.gguf import config_from_gguf

        try:
            positions = config_from_gguf(c.model.path).max_position_embeddings
        except (OSError, ValueError):
            return None
        return positions, f"context_length of {c.model.path}"
    from qurl_jax.models.hf import config_from_hf

    path = paths.join(c.model.path, "config.json")
    try:
        with paths.open_file(path, "rb") as f:
            positions = config_from_hf(json.loads(f.read().decode("utf-8"))).max_position_embeddings
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return positions, f"max_position_embeddings of {path}"


def check_context(c: ml_collections.ConfigDict) -> None:
    """`ConfigError` naming the fields when a rollout or evaluation row (prompt + response) is
    longer than the model's positions (the evaluation's only where the run evaluates)."""
    limit = model_positions(c)
    if limit is None:
        return
    positions, source = limit
    evaluates = c.data.task != "math" or bool(c.eval.files)  # a math run without files does not
    for section in ("rollout", "eval") if evaluates else ("rollout",):
        new = c[section].max_new_tokens
        if c.data.max_prompt_len + new > positions:
            raise ConfigError(
                f"config.{section}.max_new_tokens={new}: data.max_prompt_len + {section}."
                f"max_new_tokens = {c.data.max_prompt_len} + {new} = "
                f"{c.data.max_prompt_len + new} tokens, more than the model's {positions} "
                f"positions ({source}); lower one of them")


def check_learnable(c: ml_collections.ConfigDict) -> None:
    """`ConfigError` naming the field of a setting under which no update can change the policy."""
    r, rl = c.rollout, c.rl
    if r.n == 1:
        raise ConfigError(
            f"config.rollout.n=1: rl.advantage={rl.advantage!r} compares the samples of a prompt "
            "with each other, so one sample per prompt makes every advantage 0 and every loss 0; "
            "set rollout.n >= 2")
    if r.top_k == 1:
        raise ConfigError(
            "config.rollout.top_k=1 samples greedily: the rollout.n samples of a prompt are the "
            "same, so every advantage is 0 and nothing learns; set top_k to 0 (off) or >= 2")
    cap_field = {"tis": "cap", "acr": "cap", "sparse_rl": "sparse_cap"}.get(rl.loss_mode)
    if cap_field and rl[cap_field] < 1.0:
        raise ConfigError(
            f"config.rl.{cap_field}={rl[cap_field]} < 1 truncates every token's importance weight "
            f"(it is 1 on policy): rl.loss_mode={rl.loss_mode!r} would scale every gradient by "
            f"{rl[cap_field]} instead of correcting the rollout mismatch; set it >= 1 (the "
            "papers use 1.5 to 8)")
    # Bands that reject the on-policy weight 1: every token (or sequence) whose rollout matches the
    # learner is dropped.
    if rl.loss_mode == "mis" and not rl.mis_lo <= 1.0 <= rl.mis_hi:
        raise ConfigError(
            f"config.rl.mis_lo={rl.mis_lo}, mis_hi={rl.mis_hi}: the band excludes the on-policy "
            "weight 1, so rl.loss_mode='mis' rejects every token whose rollout matches the "
            "learner; keep mis_lo <= 1 <= mis_hi")
    if rl.loss_mode == "sparse_rl":
        band = tuple(rl.sparse_mask_band)
        if band and not band[0] <= 1.0 <= band[1]:
            raise ConfigError(
                f"config.rl.sparse_mask_band={band} excludes the on-policy weight 1, so every "
                "token whose rollout matches the learner is masked; keep lo <= 1 <= hi")
        if rl.veto_tau >= 1.0:
            raise ConfigError(
                f"config.rl.veto_tau={rl.veto_tau} >= 1 vetoes every sequence with one token "
                "below the on-policy weight 1, i.e. nearly all of them; the papers use 1e-4 "
                "(0 = off)")


def slow_settings(c: ml_collections.ConfigDict) -> list[str]:
    """One warning line per setting that makes the rollout decode one row at a time."""
    from qurl_jax.config.settings import refill_enabled

    r = c.rollout
    rows = c.data.prompts_per_step * r.n
    out = []
    if r.max_concurrent_rows == 1 and rows > 1:
        out.append(f"config.rollout.max_concurrent_rows=1: the rollout decodes its {rows} rows one "
                   "at a time, which makes it most of the step; raise it (0 = all rows)")
    if r.kv_pages and refill_enabled(c) and -1 not in (c.mesh.data, c.mesh.fsdp):
        shards = c.mesh.data * c.mesh.dcn.data * c.mesh.fsdp * c.mesh.dcn.fsdp
        tokens = c.data.max_prompt_len + r.max_new_tokens
        per_row = -(-tokens // r.kv_page_size)
        if r.kv_pages // shards < 2 * per_row and rows > shards:
            out.append(
                f"config.rollout.kv_pages={r.kv_pages}: a batch shard's pool of "
                f"{r.kv_pages // shards} pages of {r.kv_page_size} tokens holds one row of "
                f"data.max_prompt_len + rollout.max_new_tokens = {tokens} tokens at a time, so "
                f"the rollout decodes its rows one by one; give it at least {2 * per_row * shards}"
                " pages (`python -m qurl_jax.bench.memory --kv_capacity` sizes it for a target)")
    return out


def check_packing(c: ml_collections.ConfigDict) -> None:
    """`ConfigError` naming `train.pack_length` when packed rows cannot hold the longest sequence
    the config allows (data.max_prompt_len + rollout.max_new_tokens),
    `train.tokens_per_micro_batch` when it is less than one packed row, or `train.pack_buckets`
    when it is not a power of two; only with `train.packing`; `train.share_prompts='on'` where
    `share_prompts_blockers` names a reason it cannot."""
    from qurl_jax.config.settings import SHARE_PROMPTS, share_prompts_blockers

    if c.train.share_prompts not in SHARE_PROMPTS:
        raise ConfigError(f"config.train.share_prompts={c.train.share_prompts!r} is not one of "
                          f"{SHARE_PROMPTS}")
    if c.train.share_prompts == "on" and (blockers := share_prompts_blockers(c)):
        raise ConfigError(f"config.train.share_prompts='on' needs {blockers[0]}")
    if not c.train.packing:
        return
    from qurl_jax.learner import packed_plan, packing

    longest = c.data.max_prompt_len + c.rollout.max_new_tokens
    try:
        length = packed_plan.pack_length(c.train.pack_length, longest)
        if c.train.tokens_per_micro_batch:
            packed_plan.budget_rows(c.train.tokens_per_micro_batch, length, 1)
        packing.check_per_doubling(c.train.pack_buckets)
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None


def check_exact_numerics(c: ml_collections.ConfigDict) -> None:
    """`ConfigError` naming the field when `train.on_policy_numerics='exact'` meets a rollout
    that computes something the learner never does: its products then have no fixed-order form
    shared with the learner (per-channel int8 / fp8 recipes; int8 vocabulary tables,
    `rollout.quantize_vocab`), or its attention reads keys the learner's does not have (an 8-bit
    or compressed KV cache)."""
    if c.train.on_policy_numerics != "exact":
        return
    where = "train.on_policy_numerics='exact'"
    if c.rollout.precision not in ("fp", "fp8_block"):
        raise ConfigError(f"config.rollout.precision={c.rollout.precision!r}: {where} runs the "
                          f"'fp' and 'fp8_block' rollouts (the learner's precisions)")
    if c.rollout.precision != "fp" and c.rollout.quantize_vocab:
        raise ConfigError(f"config.rollout.quantize_vocab=True: {where} needs the vocabulary "
                          f"tables in float, as the learner holds them (set it False)")
    if c.rollout.kv_precision != "bf16":
        raise ConfigError(f"config.rollout.kv_precision={c.rollout.kv_precision!r}: {where} needs "
                          f"the KV cache in the compute dtype ('bf16'), as the learner's keys")
    if c.rollout.kv_policy != "dense":
        raise ConfigError(f"config.rollout.kv_policy={c.rollout.kv_policy!r}: {where} needs every "
                          f"key the learner attends to ('dense')")
    if c.model.lora.rank:
        raise ConfigError(f"config.model.lora.rank={c.model.lora.rank}: {where} is not built for "
                          f"LoRA adapters yet (their products have no fixed-order form); set "
                          f"model.lora.rank=0")
