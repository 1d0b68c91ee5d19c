"""The rollout-precision study: one RL run under each rollout precision, correction and KV cache.

    python -m qurl_jax.study --config=configs/chain_tiny.py --out=/tmp/study
    python -m qurl_jax.study --config=configs/chain_tiny.py --out=/tmp/quick --quick
    python -m qurl_jax.study --rows=smollm2_acr_tis --out=/tmp/papers --jobs=1 \
        --lock=/tmp/qurl_realmodel.lock

Every variant runs the same config (the reasoning-chain task by default) from the same warm start,
built once under `<out>/warm_start` and loaded by every run as `model.source=hf` (a config of a
real checkpoint, `hf` or `gguf`, starts every run from it as it is), with the same
train / held-out split (`data.split_seed`); a variant changes only the fields listed in `VARIANTS`,
and the rows marked * run under every seed (`--seeds`), the others under the first. Nothing is
tuned per variant. Each run is a `python -m qurl_jax.main` subprocess writing to
`<out>/runs/<variant>_s<seed>` (`--jobs` at a time), so a run is what a user gets from the same
command, with its own log, metrics and plots; the runs share one compilation cache
(`<out>/compile_cache`), so a program compiled by one run is loaded by the next. A finished run
is not run again: rerunning the command after a crash goes on where it stopped (an unfinished run
resumes from its checkpoint); a finished run made with another command (other steps, config or
variant; whether it evaluated before RL does not count) stops the study instead of being reused.
A variant's `evals` evaluate its finished run's checkpoint again under a compressed KV cache
(`python -m qurl_jax.evaluate --config.eval.kv_cache=rollout`, one subprocess each, in the run's
workdir). `--lock=FILE` takes that file's lock (flock) for each subprocess and gives it back
after it, so runs of several studies or users on one machine take turns run by run; each run's
wall time counts from when it got the lock, summed over its attempts (a run resumed after a stop
or a crash adds what its earlier attempts took, written down every 10 s while one runs:
`Job.spent`), and its peak resident memory is its processes' (`peak_memory_gb`).

`ROW_SETS` name the papers' comparisons on the real model (SmolLM2-135M-Instruct), each one
command (`--rows=NAME`: config, variants, seeds, steps and, for runs longer than a session, a
save every `checkpoint_every` steps to resume from); their variants' config is checked at
import (`check_rows`: fields exist, minibatches divide the batch, KV budgets at most half the
longest row they compress). Row sets share one `--out`, so a row two sets name runs once.

Written to `<out>`:
- `study.md` (`study_<rows>.md` for a row set): the table, mean +- std over seeds: held-out
  accuracy after RL (greedy and Avg@k per evaluation set, and under each compressed cache of
  `evals`), training reward (mean of the last quarter of the steps), KL(behav || prox) k3, clip
  and truncated fractions, vetoed sequences and the share of sequences vetoed per step, ACR's
  bound share and its gradient's distance from TIS's, the update-capture fraction of the
  quantized actor (all kernels and q/k/v), KV bytes per rollout row, step and rollout seconds
  and the rollout's and learner's shares of a step (steps after the first, which compiles), and
  each run's wall time and peak memory; then one line per run;
- `study.json` (`study_<rows>.json`): the same per run and per variant;
- `plots/*.png`: reward, rollout accuracy and mismatch against step, one figure per comparison.

`--quick` runs two variants, one seed and two steps of a shrunk run (its test is
tests/test_study.py). Measured results: docs/study.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ml_collections
import numpy as np

from qurl_jax.config.base import base_config, load_config_file, validate
from qurl_jax.runtime import paths, report

# The compressed caches' size: 64 tokens kept, recompressed every 16 decode steps (a cache of 80
# slots per row). On the word problems (prompts of 55-65 tokens with the chat template, up to 96
# new tokens) that is at most half the longest row (161 tokens), Sparse-RL's 35-53% saving.
KV_BUDGET = {"rollout.kv_budget": 64, "rollout.kv_interval": 16}
RKV = {"rollout.kv_policy": "rkv", **KV_BUDGET}
SNAPKV = {"rollout.kv_policy": "snapkv", **KV_BUDGET}
# Several optimizer steps per RL step, as QuRL's PPO (FlashRL's GSM8K recipe) and Sparse-RL's
# slime runs take (4 minibatches per rollout batch): only there do ACR and TIS differ. 2
# micro-batches keep the update's 8 rows at a time of the single-minibatch config. The learner
# rematerialises its layers in a scan and glibc keeps 2 malloc arenas (configs/
# smollm2_135m_step.py: the 135M step's peak 8 GB instead of 14, no slower): the same objective in
# less memory, for a machine that other jobs share (a run of 9.3 GB was killed for memory).
MB4 = {"rl.num_minibatches": 4, "rl.num_micro_batches": 2, "train.remat": "full",
       "train.scan_layers": True, "train.malloc_arenas": 2}
WARMUP16 = {"optim.warmup_steps": 16}


@dataclasses.dataclass(frozen=True)
class Variant:
    """One row of the study: config fields it sets on top of the base config."""

    name: str
    overrides: Mapping[str, Any]
    seeded: bool  # * rows: run under every seed
    label: str
    # KV policies ('rkv', 'snapkv', ...) to evaluate the finished run's policy under (with the
    # run's own budget, else `KV_BUDGET`), besides its dense evaluation: Sparse-RL's robustness
    # check.
    evals: tuple[str, ...] = ()

    def eval_overrides(self, policy: str) -> dict[str, Any]:
        """The run's fields plus those of its evaluation under the compressed cache `policy`."""
        return {**KV_BUDGET, **self.overrides, "rollout.kv_policy": policy,
                "eval.kv_cache": "rollout"}


VARIANTS = (
    Variant("fp", {"rollout.precision": "fp"}, True, "fp rollout (reference)"),
    Variant("int8_naive", {"rollout.precision": "int8", "rl.loss_mode": "naive"}, True,
            "int8 rollout, naive"),
    Variant("int8_tis", {"rollout.precision": "int8", "rl.loss_mode": "tis"}, True,
            "int8 rollout, TIS"),
    Variant("int8_acr", {"rollout.precision": "int8", "rl.loss_mode": "acr"}, True,
            "int8 rollout, ACR (s = 1)"),
    Variant("int8_kv8_naive", {"rollout.precision": "int8", "rollout.kv_precision": "int8",
                               "rl.loss_mode": "naive"}, True,
            "int8 rollout + int8 KV cache, naive"),
    Variant("int8_kv8_acr", {"rollout.precision": "int8", "rollout.kv_precision": "int8",
                             "rl.loss_mode": "acr"}, True,
            "int8 rollout + int8 KV cache, ACR"),
    Variant("int8_acr_s1.5", {"rollout.precision": "int8", "rl.loss_mode": "acr",
                              "rollout.invariant_scaling": 1.5}, False,
            "int8 rollout, ACR, invariant scaling s = 1.5"),
    Variant("fp8_naive", {"rollout.precision": "fp8", "rl.loss_mode": "naive"}, True,
            "fp8 rollout, naive"),
    Variant("fp8_tis", {"rollout.precision": "fp8", "rl.loss_mode": "tis"}, True,
            "fp8 rollout, TIS"),
    Variant("fp8_acr", {"rollout.precision": "fp8", "rl.loss_mode": "acr"}, True,
            "fp8 rollout, ACR"),
    # Both fp8_block rows keep the vocabulary tables in the compute dtype, as the Jet-RL config
    # does: its learner does not quantize them, so int8 tables in the rollout alone would put an
    # uncorrected mismatch into the unified flow.
    Variant("fp_train_fp8_block_rollout", {"rollout.precision": "fp8_block",
                                           "rollout.quantize_vocab": False,
                                           "rl.loss_mode": "naive"}, False,
            "fp train + fp8_block rollout, naive"),
    Variant("jetrl_fp8_block", {"rollout.precision": "fp8_block", "train.precision": "fp8_block",
                                "rollout.quantize_vocab": False, "rl.loss_mode": "naive"}, True,
            "fp8_block train + rollout (Jet-RL), naive"),
    # The same with exact on-policy numerics: pi_behav == pi_prox bit for bit (models.exact).
    Variant("jetrl_fp8_block_exact", {"rollout.precision": "fp8_block",
                                      "train.precision": "fp8_block",
                                      "rollout.quantize_vocab": False, "rl.loss_mode": "naive",
                                      "train.on_policy_numerics": "exact"}, True,
            "fp8_block train + rollout (Jet-RL), exact numerics, naive"),
    Variant("rkv_tis", {**RKV, "rl.loss_mode": "tis"}, False,
            "rkv rollout, uncorrected (TIS on the sparse log-probs)"),
    Variant("rkv_sparse_rl", {**RKV, "rl.loss_mode": "sparse_rl"}, True,
            "rkv rollout, Sparse-RL correction"),
    Variant("int8_rkv_acr_sparse_rl", {**RKV, "rollout.precision": "int8",
                                       "rl.loss_mode": "sparse_rl", "rl.sparse_base": "acr"},
            False, "int8 + rkv rollout, Sparse-RL with ACR"),
    # The papers' settings on the real model (`ROW_SETS`): 4 minibatches per RL step.
    Variant("fp_mb4", {"rollout.precision": "fp", **MB4}, True,
            "fp rollout, 4 minibatches (reference)", evals=("rkv", "snapkv")),
    Variant("int8_naive_mb4", {"rollout.precision": "int8", "rl.loss_mode": "naive", **MB4},
            True, "int8 rollout, naive, 4 minibatches"),
    Variant("int8_tis_mb4", {"rollout.precision": "int8", "rl.loss_mode": "tis", **MB4}, True,
            "int8 rollout, TIS, 4 minibatches"),
    Variant("int8_acr_mb4", {"rollout.precision": "int8", "rl.loss_mode": "acr", **MB4}, True,
            "int8 rollout, ACR, 4 minibatches"),
    # The same two with a linear learning-rate warm-up over the first 16 AdamW steps (4 RL
    # steps), which kept both seeds' 8-step runs off the response limit: the longer rows.
    Variant("int8_tis_mb4_wu16", {"rollout.precision": "int8", "rl.loss_mode": "tis", **MB4,
                                  **WARMUP16}, True,
            "int8 rollout, TIS, 4 minibatches, warm-up 16"),
    Variant("int8_acr_mb4_wu16", {"rollout.precision": "int8", "rl.loss_mode": "acr", **MB4,
                                  **WARMUP16}, True,
            "int8 rollout, ACR, 4 minibatches, warm-up 16"),
    # The same two at the smallest TIS cap the papers' released configs take (C = 1.5, Sparse-RL's;
    # FlashRL's GSM8K recipe and the rows above: 2): more tokens are truncated, so ACR's wider
    # bound has more tokens to act on.
    Variant("int8_tis_mb4_wu16_c1.5", {"rollout.precision": "int8", "rl.loss_mode": "tis", **MB4,
                                       **WARMUP16, "rl.cap": 1.5}, True,
            "int8 rollout, TIS, 4 minibatches, warm-up 16, C = 1.5"),
    Variant("int8_acr_mb4_wu16_c1.5", {"rollout.precision": "int8", "rl.loss_mode": "acr", **MB4,
                                       **WARMUP16, "rl.cap": 1.5}, True,
            "int8 rollout, ACR, 4 minibatches, warm-up 16, C = 1.5"),
    Variant("int8_acr_mb4_s1.5", {"rollout.precision": "int8", "rl.loss_mode": "acr",
                                  "rollout.invariant_scaling": 1.5, **MB4}, True,
            "int8 rollout, ACR, invariant scaling s = 1.5, 4 minibatches"),
    Variant("int8_kv8_acr_mb4", {"rollout.precision": "int8", "rollout.kv_precision": "int8",
                                 "rl.loss_mode": "acr", **MB4}, True,
            "int8 rollout + int8 KV cache, ACR, 4 minibatches"),
    Variant("rkv_naive_mb4", {"rollout.precision": "fp", **RKV, "rl.loss_mode": "naive", **MB4},
            True, "rkv rollout, naive, 4 minibatches", evals=("rkv",)),
    Variant("rkv_sparse_rl_mb4", {"rollout.precision": "fp", **RKV, "rl.loss_mode": "sparse_rl",
                                  **MB4}, True,
            "rkv rollout, Sparse-RL correction, 4 minibatches", evals=("rkv",)),
    Variant("snapkv_naive_mb4", {"rollout.precision": "fp", **SNAPKV, "rl.loss_mode": "naive",
                                 **MB4}, True,
            "snapkv rollout, naive, 4 minibatches", evals=("snapkv",)),
    Variant("snapkv_sparse_rl_mb4", {"rollout.precision": "fp", **SNAPKV,
                                     "rl.loss_mode": "sparse_rl", **MB4}, True,
            "snapkv rollout, Sparse-RL correction, 4 minibatches", evals=("snapkv",)),
)


@dataclasses.dataclass(frozen=True)
class RowSet:
    """One comparison of the papers on the real model: `--rows=NAME` runs these variants of this
    config (a path in the repository) under `seeds` seeds for `steps` RL steps."""

    config: str
    variants: tuple[str, ...]
    seeds: int = 2
    steps: int = 8
    # Save every this many steps, the latest save kept (0: at the last step only), so a run
    # longer than a session resumes where the stopped one left it.
    checkpoint_every: int = 0


_WORD = "configs/smollm2_135m_word_compare.py"
ROW_SETS = {
    # QuRL: ACR against TIS (and naive) where they differ, several optimizer steps per RL step.
    "smollm2_acr_tis": RowSet(_WORD, ("int8_naive_mb4", "int8_tis_mb4", "int8_acr_mb4")),
    # The same, longer (QuRL's TIS failure is a long-run one), with a warm-up that keeps the
    # several-minibatch runs off the response limit; saved every 8 steps so a run spans sessions.
    "smollm2_acr_tis_long": RowSet(_WORD, ("int8_tis_mb4_wu16", "int8_acr_mb4_wu16"), steps=48,
                                   checkpoint_every=8),
    # The pair at C = 1.5, where ACR's bound has more truncated tokens to act on; 16 steps, saved
    # every 8 so that a later session can take it further.
    "smollm2_acr_tis_cap": RowSet(_WORD, ("int8_tis_mb4_wu16_c1.5", "int8_acr_mb4_wu16_c1.5"),
                                  steps=16, checkpoint_every=8),
    # QuRL's invariant scaling (UAQ) at the paper's s = 1.5, with and without.
    "smollm2_invariant_scaling": RowSet(_WORD, ("int8_acr_mb4", "int8_acr_mb4_s1.5")),
    # Sparse-RL: R-KV and SnapKV rollouts, naive and corrected, against the dense fp rollout;
    # each trained policy evaluated under its compressed cache, the dense one under both.
    "smollm2_sparse_rl": RowSet(_WORD, ("fp_mb4", "rkv_naive_mb4", "rkv_sparse_rl_mb4",
                                        "snapkv_naive_mb4", "snapkv_sparse_rl_mb4")),
    # The 8-bit KV cache in training: int8 weights + int8 KV against int8 weights alone.
    "smollm2_kv8": RowSet(_WORD, ("int8_acr_mb4", "int8_kv8_acr_mb4")),
    # Jet-RL: the unified fp8_block flow (learner and rollout), default against exact on-policy
    # numerics, beside the fp32 reference; one minibatch a step like the config's other rows.
    "smollm2_jetrl": RowSet(_WORD, ("fp", "jetrl_fp8_block", "jetrl_fp8_block_exact")),
}
QUICK_VARIANTS = ("fp", "int8_acr")
# The figures: file -> (title, variants, metrics).
FIGURES = {
    "study.png": ("Rollout precision and correction: training reward and mismatch", (
        "fp", "int8_naive", "int8_acr", "fp8_naive", "fp8_tis", "fp8_acr", "rkv_tis",
        "rkv_sparse_rl"), ("rollout/reward_mean", "kl_behav_prox_k3")),
    "quantized.png": ("Quantized rollouts: naive, TIS, ACR", (
        "fp", "int8_naive", "int8_tis", "int8_acr", "fp8_naive", "fp8_tis", "fp8_acr"),
        ("rollout/reward_mean", "rollout/accuracy", "kl_behav_prox_k3", "truncated_frac")),
    "kv_quant.png": ("8-bit KV cache: int8 weights alone vs int8 weights + int8 KV", (
        "fp", "int8_naive", "int8_acr", "int8_kv8_naive", "int8_kv8_acr"),
        ("rollout/reward_mean", "kl_behav_prox_k3")),
    "invariant_scaling.png": ("Invariant scaling: int8 + ACR with s = 1 and s = 1.5", (
        "int8_acr", "int8_acr_s1.5"), ("rollout/reward_mean", "quant/code_change_fraction",
                                       "kl_behav_prox_k3")),
    "jetrl.png": ("Jet-RL: fp train + fp8_block rollout vs the unified fp8_block flow", (
        "fp", "fp_train_fp8_block_rollout", "jetrl_fp8_block", "jetrl_fp8_block_exact"),
        ("kl_behav_prox_k3", "rollout/reward_mean")),
    "sparse_rl.png": ("Sparse-RL: rkv rollout (budget 64), uncorrected vs corrected", (
        "fp", "rkv_tis", "rkv_sparse_rl", "int8_rkv_acr_sparse_rl"),
        ("rollout/reward_mean", "kl_behav_prox_k3", "vetoed_seq_frac")),
    "smollm2_acr_tis.png": ("int8 rollout, 4 minibatches per RL step: naive, TIS, ACR", (
        "int8_naive_mb4", "int8_tis_mb4", "int8_acr_mb4"),
        ("rollout/reward_mean", "rollout/response_len", "acr/bound_frac", "acr/grad_rel_diff")),
    "smollm2_acr_tis_long.png": ("int8 rollout, 4 minibatches, warm-up 16, 48 steps: TIS, ACR", (
        "int8_tis_mb4_wu16", "int8_acr_mb4_wu16"),
        ("rollout/reward_mean", "rollout/response_len", "acr/bound_frac", "acr/grad_rel_diff",
         "kl_behav_prox_k3")),
    "smollm2_acr_tis_cap.png": ("int8 rollout, 4 minibatches, warm-up 16, TIS cap C = 1.5: TIS, "
                                "ACR", ("int8_tis_mb4_wu16_c1.5", "int8_acr_mb4_wu16_c1.5"),
        ("rollout/reward_mean", "rollout/response_len", "truncated_frac", "acr/bound_frac",
         "acr/grad_rel_diff", "kl_behav_prox_k3")),
    "smollm2_invariant_scaling.png": ("int8 + ACR with and without invariant scaling (s = 1.5)", (
        "int8_acr_mb4", "int8_acr_mb4_s1.5"),
        ("rollout/reward_mean", "quant/code_change_fraction", "quant/code_change_fraction_qkv",
         "kl_behav_prox_k3")),
    "smollm2_sparse_rl.png": ("Sparse-RL: R-KV and SnapKV rollouts (budget 64), naive vs "
                              "corrected", (
        "fp_mb4", "rkv_naive_mb4", "rkv_sparse_rl_mb4", "snapkv_naive_mb4",
        "snapkv_sparse_rl_mb4"),
        ("rollout/reward_mean", "rollout/response_len", "kl_behav_prox_k3", "vetoed_seq_frac")),
    "smollm2_kv8.png": ("int8 weights with and without an int8 KV cache, ACR", (
        "int8_acr_mb4", "int8_kv8_acr_mb4"), ("rollout/reward_mean", "kl_behav_prox_k3")),
}
# Metrics averaged over the steps after the first (which compiles) for the table.
STEP_MEANS = ("kl_behav_prox_k3", "clipfrac", "truncated_frac", "vetoed_seq_frac",
              "acr/bound_frac", "acr/grad_rel_diff", "quant/code_change_fraction",
              "quant/code_change_fraction_qkv", "rollout/kv_bytes_per_row", "time/step_s",
              "time/rollout_s", "time/rollout_share")
# The learner's phases of a step (`Trainer.step`): its share is their seconds over the step's.
LEARNER_PHASES = ("time/logp_recompute_s", "time/update_s")
COLUMNS = (  # table column -> (summary key, format); a column no row fills is left out
    ("reward", "reward_last_quarter", ".3f"),
    ("KL k3", "kl_behav_prox_k3", ".1e"),
    ("clipfrac", "clipfrac", ".1e"),
    ("w truncated", "truncated_frac", ".1e"),
    ("vetoed seqs", "vetoed_sequences", ".0f"),
    ("vetoed / step", "vetoed_seq_frac", ".3f"),
    ("ACR bound", "acr/bound_frac", ".1e"),
    ("ACR-TIS grad", "acr/grad_rel_diff", ".1e"),
    ("capture", "quant/code_change_fraction", ".3f"),
    ("capture qkv", "quant/code_change_fraction_qkv", ".3f"),
    ("KV KiB/row", "kv_kib_per_row", ".0f"),
    ("step s", "time/step_s", ".2f"),
    ("rollout s", "time/rollout_s", ".2f"),
    ("rollout share", "time/rollout_share", ".2f"),
    ("learner share", "learner_share", ".2f"),
    ("run min", "wall_min", ".1f"),
    ("peak GB", "peak_rss_gb", ".1f"),
)
DONE = "study_done.json"


# What --quick's table says about itself: its numbers check the machinery, not the method.
QUICK_NOTE = ("--quick is a smoke test: two RL steps after a 30-step warm start, so accuracy "
              "columns of 0.000 are expected; they show that every variant runs end to end, not "
              "what a variant does. Run without --quick for the study.")


def quick_overrides() -> dict[str, Any]:
    """What --quick shrinks: a short warm start, two steps of a small batch, a small evaluation."""
    return {"sft.steps": 30, "data.prompts_per_step": 4, "rollout.n": 4, "train.num_steps": 2,
            "rollout.max_new_tokens": 48, "eval.max_new_tokens": 48, "eval.max_examples": 8,
            "eval.k": 2, "rl.num_minibatches": 1}


def build_warm_start(config_path: str, out: str, base: Mapping[str, Any]) -> str:
    """Builds (or reuses) the warm start every run loads; returns its Hugging Face directory."""
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.train import tasks

    c = load_config_file(config_path)
    c.update_from_flattened_dict(dict(base))
    if c.model.source != "tiny":
        return c.model.path  # a real checkpoint: every run starts from it as it is
    validate(c)
    workdir = os.path.join(out, "warm_start")
    _, _, task = tasks.build_model_and_task(RunSettings.from_config(c), workdir)
    task.close()
    return os.path.join(workdir, "sft_model")


class RowError(ValueError):
    """A variant's fields do not fit the config they run on (`check_rows`)."""


def _configured(config: ml_collections.ConfigDict, overrides: Mapping[str, Any], what: str
                ) -> ml_collections.ConfigDict:
    """A copy of `config` with `overrides` set; RowError naming `what` and the field when one
    does not exist or does not take the value's type."""
    c = config.copy_and_resolve_references()
    for field, value in overrides.items():
        try:
            c.update_from_flattened_dict({field: value})
        except (KeyError, TypeError, AttributeError) as e:
            raise RowError(f"{what}: config field {field}={value!r}: "
                           f"{str(e).splitlines()[0][:200]}") from None
    return c


def check_rows(config: ml_collections.ConfigDict, variants: Sequence[Variant]) -> None:
    """Each variant's fields (and those of its compressed evaluations) on `config`: they exist
    and take their values, its minibatches divide the rollout batch and its micro-batches the
    minibatch, and a compressed KV cache keeps at most half of the longest row the config allows
    (data.max_prompt_len + the response limit), with its window and interval inside the budget
    and the response. RowError naming the variant and the field; reads no file."""
    for variant in variants:
        settings = [(variant.name, variant.overrides)] + [
            (f"{variant.name} evaluated under {p}", variant.eval_overrides(p))
            for p in variant.evals]
        for what, overrides in settings:
            c = _configured(config, overrides, what)
            batch = c.data.prompts_per_step * c.rollout.n
            if batch % c.rl.num_minibatches:
                raise RowError(f"{what}: rl.num_minibatches={c.rl.num_minibatches} does not "
                               f"divide the rollout batch of {batch} rows")
            minibatch = batch // c.rl.num_minibatches
            if minibatch % c.rl.num_micro_batches:
                raise RowError(f"{what}: rl.num_micro_batches={c.rl.num_micro_batches} does not "
                               f"divide the minibatch of {minibatch} rows")
            if c.rollout.kv_policy == "dense":
                continue
            longest = c.data.max_prompt_len + c.rollout.max_new_tokens
            if 2 * c.rollout.kv_budget > longest:
                raise RowError(f"{what}: rollout.kv_budget={c.rollout.kv_budget} keeps more than "
                               f"half of the longest row (data.max_prompt_len + "
                               f"rollout.max_new_tokens = {longest} tokens)")
            if not c.rollout.kv_window < c.rollout.kv_budget:
                raise RowError(f"{what}: rollout.kv_window={c.rollout.kv_window} must be below "
                               f"rollout.kv_budget={c.rollout.kv_budget}")
            if c.rollout.kv_interval > c.rollout.max_new_tokens:
                raise RowError(f"{what}: rollout.kv_interval={c.rollout.kv_interval} exceeds "
                               f"the response of {c.rollout.max_new_tokens} tokens: it would "
                               "never compress")


def _check_fields(variants: Sequence[Variant]) -> None:
    """Every variant's fields exist in `base_config()` and take their values (at import)."""
    base = base_config()
    for variant in variants:
        _configured(base, variant.overrides, variant.name)
        for policy in variant.evals:
            _configured(base, variant.eval_overrides(policy), f"{variant.name} under {policy}")


def _check_row_sets() -> None:
    """Every row set names known variants, and its variants fit its config (`check_rows`)."""
    known = {v.name: v for v in VARIANTS}
    for name, rows in ROW_SETS.items():
        if unknown := [v for v in rows.variants if v not in known]:
            raise RowError(f"ROW_SETS[{name!r}]: unknown variants {unknown}")
        if rows.checkpoint_every and rows.steps % rows.checkpoint_every:
            raise RowError(f"ROW_SETS[{name!r}]: checkpoint_every={rows.checkpoint_every} does "
                           f"not divide steps={rows.steps}")
        path = os.path.join(paths.REPO_ROOT, rows.config)
        if os.path.isfile(path):  # an installed package has no configs/: main() says so
            check_rows(load_config_file(path), [known[v] for v in rows.variants])


_check_fields(VARIANTS)
_check_row_sets()


@dataclasses.dataclass
class Run:
    variant: Variant
    seed: int
    workdir: str

    @property
    def name(self) -> str:
        return f"{self.variant.name}_s{self.seed}"

    def done(self) -> dict[str, Any] | None:
        return _read_json(os.path.join(self.workdir, DONE))


@dataclasses.dataclass
class Job:
    """One subprocess of the study: a run, or an evaluation of a finished run's checkpoint (in
    the run's workdir), which starts once the job named `needs` has finished."""

    name: str
    workdir: str
    marker: str  # file in `workdir` written when the job exits 0
    command: list[str]
    needs: str | None = None

    def done(self) -> dict[str, Any] | None:
        return _read_json(os.path.join(self.workdir, self.marker))

    @property
    def spent_path(self) -> str:
        """The wall time its attempts have taken so far, kept while it runs and after an attempt
        that failed or was stopped, so a resumed job's marker counts every attempt."""
        return os.path.join(self.workdir, f"spent_{self.marker}")

    def spent(self) -> tuple[float, float | None]:
        """(wall s, peak GB) of its attempts so far."""
        kept = _read_json(self.spent_path) or {}
        return float(kept.get("wall_s", 0.0)), kept.get("peak_rss_gb")

    def keep_spent(self, wall_s: float, peak_gb: float | None = None) -> None:
        with open(self.spent_path, "w", encoding="utf-8") as f:
            json.dump({"wall_s": wall_s, "peak_rss_gb": peak_gb}, f)


def _read_json(path: str) -> dict[str, Any] | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _flag(field: str, value: Any) -> str:
    return f"--config.{field}={value}"


def command(config_path: str, run: Run, overrides: Mapping[str, Any],
            module: str = "qurl_jax.main") -> list[str]:
    return [sys.executable, "-m", module, f"--config={config_path}",
            f"--workdir={run.workdir}", *(_flag(k, v) for k, v in overrides.items())]


def eval_marker(policy: str) -> str:
    """The file a finished evaluation of a run under the compressed cache `policy` leaves."""
    return f"study_eval_{policy}.json"


def checkpointing(steps: int, every: int) -> dict[str, int]:
    """A run's checkpoint fields: saved at its last step only (`every` 0, so the config's
    `keep_checkpoints` holds one save), or every `every` steps keeping the latest (a resume needs
    no other)."""
    if not every:
        return {"train.checkpoint_every": steps}
    return {"train.checkpoint_every": every, "train.keep_checkpoints": 1}


def same_command(a: Sequence[str], b: Sequence[str]) -> bool:
    """Whether two runs' commands make the same run: equal but for `eval.before` (the first run
    of each invocation evaluates before RL, so a run another row set made is reused) and for how
    the config file is named (`--rows` names it by its absolute path, `--config=` as typed; a
    relative path is read from the repository root, where the study's commands run)."""
    def strip(c: Sequence[str]) -> list[str]:
        flag = "--config="
        return [flag + os.path.realpath(os.path.join(paths.REPO_ROOT, x.removeprefix(flag)))
                if x.startswith(flag) else x
                for x in c if not x.startswith("--config.eval.before=")]

    return strip(a) == strip(b)


class FileLock:
    """The exclusive lock (flock) of the file `path`, held from `acquire` to `release`: the
    machine-wide turn of one run when several studies or users share a machine."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def acquire(self, name: str) -> float:
        """Blocks until the lock is held (saying so when it must wait); returns the seconds it
        waited."""
        start = time.monotonic()
        self._file = open(self.path, "a", encoding="utf-8")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"[study] {name}: waiting for the lock {self.path}", flush=True)
            fcntl.flock(self._file, fcntl.LOCK_EX)
        return time.monotonic() - start

    def release(self) -> None:
        fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def peak_memory_gb(pid: int) -> float | None:
    """The peak resident memory (GB) of process `pid` so far (Linux's VmHWM: the high-water
    mark of its own address space since it started its program), or None when it cannot be read
    (gone, or no /proc)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024 / 1e9  # kB
    except OSError:
        return None
    return None


SPENT_EVERY_S = 10.0  # how often a running job's wall time so far is written down


def run_all(jobs: Sequence[Job], parallel: int, lock: FileLock | None = None) -> list[str]:
    """Runs the unfinished jobs, `parallel` at a time (1 with a `lock`, taken for each job), each
    once the job it needs has finished; writes each finished job's marker (its wall time from
    when it started, summed over its attempts: `Job.spent`, kept every `SPENT_EVERY_S` while it
    runs; lock wait, peak memory, command). The peak is its process's VmHWM, read
    every half second while it runs, up to the last read before it exits (None where /proc
    has none); the verifier's worker processes are not in it. Returns the jobs that failed or
    whose prerequisite did."""
    if lock is not None and parallel != 1:
        raise ValueError(f"a lock is taken per job: run one at a time, not {parallel}")
    waiting = [j for j in jobs if j.done() is None]
    failed: list[str] = []
    active: list[tuple[Job, subprocess.Popen, float, Any, float, tuple[float, Any]]] = []
    peaks: dict[str, float] = {}  # job -> its process's peak memory, sampled while it runs
    kept: dict[str, float] = {}  # job -> when its spent time was last written
    total, finished = len(waiting), 0
    while waiting or active:
        while len(active) < parallel:
            for job in [j for j in waiting if j.needs in failed]:
                waiting.remove(job)
                failed.append(job.name)
            pending = {j.name for j in waiting} | {a[0].name for a in active}
            ready = [j for j in waiting if j.needs not in pending]
            if not ready:
                break
            job = ready[0]
            waiting.remove(job)
            waited = lock.acquire(job.name) if lock is not None else 0.0
            os.makedirs(job.workdir, exist_ok=True)
            log_name = f"log_{job.marker.removesuffix('.json')}.txt" if job.needs else "log.txt"
            log = open(os.path.join(job.workdir, log_name), "a", encoding="utf-8")
            print(f"[study] start {job.name}", flush=True)
            proc = subprocess.Popen(job.command, stdout=log, stderr=subprocess.STDOUT)
            active.append((job, proc, time.monotonic(), log, waited, job.spent()))
        time.sleep(0.5)
        for item in list(active):
            job, proc, start, log, waited, (before, before_peak) = item
            peak = peak_memory_gb(proc.pid)  # before poll() reaps it: /proc then still has it
            if peak is not None or before_peak is not None:
                peaks[job.name] = max(peaks.get(job.name, 0.0), peak or 0.0, before_peak or 0.0)
            now = time.monotonic()
            if proc.poll() is None:
                if now - kept.get(job.name, start) >= SPENT_EVERY_S:
                    # a stop loses at most this interval
                    job.keep_spent(before + now - start, peaks.get(job.name))
                    kept[job.name] = now
                continue
            peak = peaks.get(job.name)
            wall = before + now - start
            job.keep_spent(wall, peak)
            active.remove(item)
            log.close()
            if lock is not None:
                lock.release()
            finished += 1
            print(f"[study] {finished}/{total} {job.name}: exit {proc.returncode}, "
                  f"{now - start:.0f} s" + (f" ({wall:.0f} s over its attempts)" if before else "")
                  + ("" if peak is None else f", peak {peak:.1f} GB"), flush=True)
            if proc.returncode == 0:
                with open(os.path.join(job.workdir, job.marker), "w", encoding="utf-8") as f:
                    json.dump({"wall_s": wall, "lock_wait_s": waited, "peak_rss_gb": peak,
                               "command": job.command}, f, indent=1)
            else:
                failed.append(job.name)
    return failed


def _series_mean(values: np.ndarray, steps: np.ndarray) -> float:
    """Mean over the steps after the first (which compiles), or over all of them if only one."""
    return float(np.nanmean(values[steps > 1] if (steps > 1).any() else values))


def summarize_run(workdir: str, evals: Sequence[str] = ()) -> dict[str, float]:
    """The table's numbers of one finished run, from its metrics.jsonl, its study marker and its
    evaluations under the compressed caches `evals` (`eval/step_<N>_<policy>.json`)."""
    data = report.read_series(workdir)
    out: dict[str, float] = {}
    for key, s in data.items():
        if key.startswith("eval/") and (key.endswith(("/greedy_acc", "/greedy_truncated"))
                                        or "/avg@" in key):
            out[key] = float(s.values[-1])  # the evaluation after RL
    reward = data.get("rollout/reward_mean")
    if reward is not None:
        tail = reward.values[-max(1, len(reward.values) // 4):]
        out["reward_last_quarter"] = float(np.nanmean(tail))
    for key in STEP_MEANS:
        s = data.get(key)
        if s is not None:
            out[key] = _series_mean(s.values, s.steps)
    step = data.get("time/step_s")
    if step is not None and all(k in data for k in LEARNER_PHASES):
        learner = sum(data[k].values for k in LEARNER_PHASES)
        out["learner_share"] = _series_mean(learner / step.values, step.steps)
    elif step is not None and "time/update_s" in data:  # no separate log-prob pass
        out["learner_share"] = _series_mean(data["time/update_s"].values / step.values,
                                            step.steps)
    if "rollout/kv_bytes_per_row" in out:
        out["kv_kib_per_row"] = out["rollout/kv_bytes_per_row"] / 1024
    vetoed = data.get("sparse/vetoed_sequences")
    if vetoed is not None:
        out["vetoed_sequences"] = float(np.nansum(vetoed.values))
    done = _read_json(os.path.join(workdir, DONE)) or {}
    if "wall_s" in done:
        out["wall_min"] = done["wall_s"] / 60
    if done.get("peak_rss_gb") is not None:
        out["peak_rss_gb"] = done["peak_rss_gb"]
    last = int(data["rollout/reward_mean"].steps[-1]) if reward is not None else 0
    for policy in evals:
        record = _read_json(os.path.join(workdir, "eval", f"step_{last}_{policy}.json"))
        for key, value in ((record or {}).get("metrics") or {}).items():
            if key.endswith(("/greedy_acc", "/greedy_truncated")) or "/avg@" in key:
                out[f"eval/{policy}_cache/{key}"] = float(value)
    return out


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    v = np.asarray(values, np.float64)
    return float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else 0.0


def aggregate(runs: Sequence[Run]) -> dict[str, dict[str, Any]]:
    """Per variant: its seeds' summaries and the mean and std of each number."""
    out: dict[str, dict[str, Any]] = {}
    for run in runs:
        if run.done() is None:
            continue
        entry = out.setdefault(run.variant.name, {"label": run.variant.label, "runs": {}})
        entry["runs"][run.name] = summarize_run(run.workdir, run.variant.evals)
    for entry in out.values():
        keys = sorted({k for s in entry["runs"].values() for k in s})
        entry["mean_std"] = {k: _mean_std([s[k] for s in entry["runs"].values() if k in s])
                             for k in keys}
    return out


def _cell(stats: tuple[float, float] | None, fmt: str, seeds: int) -> str:
    if stats is None or not math.isfinite(stats[0]):
        return "-"
    mean, std = stats
    return f"{mean:{fmt}}" + (f" ± {std:{fmt}}" if seeds > 1 else "")


def _eval_order(key: str) -> tuple[int, int, str]:
    """Table order of the evaluation columns: dense before compressed caches, carry-10 last."""
    return ("_cache/" in key, key.count("carry"), key)


def table(results: Mapping[str, dict[str, Any]], before: Mapping[str, float]) -> str:
    """The markdown table: one row per variant, the warm start's evaluation first; columns no
    row fills are left out."""
    eval_keys = sorted({k for r in results.values() for k in r["mean_std"]
                        if k.startswith("eval/")}, key=_eval_order)
    columns = [c for c in COLUMNS if any(c[1] in r["mean_std"] for r in results.values())]
    head = ["variant", "seeds", *(k.removeprefix("eval/").replace("/", " ") for k in eval_keys),
            *(c for c, _, _ in columns)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    if before:
        lines.append("| " + " | ".join(["warm start (before RL)", "", *(
            f"{before[k]:.3f}" if k in before else "-" for k in eval_keys),
            *("" for _ in columns)]) + " |")
    for variant in VARIANTS:
        r = results.get(variant.name)
        if r is None:
            continue
        seeds = len(r["runs"])
        stats = r["mean_std"]
        cells = [f"{variant.label}{' *' if variant.seeded else ''}", str(seeds),
                 *(_cell(stats.get(k), ".3f", seeds) for k in eval_keys),
                 *(_cell(stats.get(key), fmt, seeds) for _, key, fmt in columns)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def job_lines(jobs: Sequence[Job]) -> str:
    """One line per finished job: wall time (from when it started), lock wait, peak memory."""
    lines = []
    for job in jobs:
        done = job.done()
        if done is not None:
            peak = done.get("peak_rss_gb")
            lines.append(f"- {job.name}: {done['wall_s'] / 60:.1f} min"
                         + (f" (after {done['lock_wait_s'] / 60:.1f} min waiting for the lock)"
                            if done.get("lock_wait_s", 0) >= 60 else "")
                         + ("" if peak is None else f", peak {peak:.1f} GB"))
    return "\n".join(lines)


def write_figures(runs: Sequence[Run], out: str) -> list[str]:
    """The comparison PNGs of `FIGURES`, over the variants that finished."""
    groups: dict[str, list[str]] = {}
    labels = {v.name: v.label for v in VARIANTS}
    logged: dict[str, set[str]] = {}  # workdir -> the metrics it logged
    for run in runs:
        if run.done() is not None:
            groups.setdefault(run.variant.name, []).append(run.workdir)
            logged[run.workdir] = set(report.read_series(run.workdir))
    written = []
    for file, (title, variants, metrics) in FIGURES.items():
        selected = {labels[v]: groups[v] for v in variants if v in groups}
        if len(selected) < 2:
            continue
        present = [m for m in metrics if any(m in logged[w] for ws in selected.values()
                                             for w in ws)]
        written.append(report.compare_runs(selected, present, os.path.join(out, "plots", file),
                                           title=title))
    return written


def _before(out: str) -> dict[str, float]:
    """The start's evaluation, logged at step 0 by the study's run that evaluated before RL (in
    this invocation or, for a row set, in another that shares `out`)."""
    runs = os.path.join(out, "runs")
    for name in sorted(os.listdir(runs)) if os.path.isdir(runs) else ():
        data = report.read_series(os.path.join(runs, name))
        values = {k: float(s.values[0]) for k, s in data.items()
                  if k.startswith("eval/") and s.steps[0] == 0}
        if values:
            return values
    return {}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qurl_jax.study",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="", help="base config file (default: "
                        "configs/chain_tiny.py, or the row set's)")
    parser.add_argument("--out", required=True, help="study directory")
    parser.add_argument("--steps", type=int, default=0, help="RL steps per run (default 30, or "
                        "the row set's)")
    parser.add_argument("--seeds", type=int, default=0, help="seeds of the * rows (0, 1, ...; "
                        "default 3, or the row set's)")
    parser.add_argument("--first_seed", type=int, default=0,
                        help="seed offset of this invocation's runs (runs <variant>_s<N> for N "
                             "in first_seed..first_seed + seeds - 1): adds seeds to a study "
                             "whose earlier seeds ran elsewhere")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time")
    parser.add_argument("--variants", default="", help="comma-separated subset of the variants")
    parser.add_argument("--rows", default="", help=f"a row set: its config, variants, seeds and "
                        f"steps (one of {list(ROW_SETS)}); its table is study_<rows>.md")
    parser.add_argument("--lock", default="", help="a lock file taken (flock) for each run and "
                        "evaluation and given back after it; needs --jobs=1")
    parser.add_argument("--quick", action="store_true",
                        help="two variants, one seed, two steps of a shrunk run (a smoke test)")
    args = parser.parse_args(argv)
    rows = ROW_SETS.get(args.rows)
    if args.rows and rows is None:
        parser.error(f"--rows={args.rows!r} is not one of {list(ROW_SETS)}")
    if rows is not None:
        if args.variants or args.config or args.quick:
            parser.error(f"--rows={args.rows} sets the config and variants: leave out "
                         "--config, --variants and --quick")
        args.config = os.path.join(paths.REPO_ROOT, rows.config)
        args.variants = ",".join(rows.variants)
        args.seeds, args.steps = args.seeds or rows.seeds, args.steps or rows.steps
    args.config = args.config or "configs/chain_tiny.py"
    args.seeds, args.steps = args.seeds or 3, args.steps or 30
    if not os.path.isfile(args.config):
        parser.error(f"--config={args.config!r} does not exist")
    for name in ("steps", "seeds", "jobs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name}={getattr(args, name)} must be >= 1")
    if args.first_seed < 0:
        parser.error(f"--first_seed={args.first_seed} must be >= 0")
    if args.lock and args.jobs != 1:
        parser.error(f"--lock is taken for one run at a time: use --jobs=1, not {args.jobs}")
    known = {v.name: v for v in VARIANTS}
    names = [n for n in args.variants.split(",") if n] or (
        list(QUICK_VARIANTS) if args.quick else list(known))
    if unknown := [n for n in names if n not in known]:
        parser.error(f"--variants: unknown {unknown}; known: {list(known)}")
    first = 0 if args.quick else args.first_seed
    if first and (unseeded := [n for n in names if not known[n].seeded]):
        parser.error(f"--first_seed={first}: {unseeded} run under the first seed only; "
                     "leave them out or run them without --first_seed")
    seeds = 1 if args.quick else args.seeds
    base = load_config_file(args.config)
    shared = {"train.num_steps": args.steps, **(quick_overrides() if args.quick else {})}
    try:
        check_rows(_configured(base, shared, "the study's settings"),
                   [known[n] for n in names])
    except RowError as e:
        parser.error(str(e))

    start = time.monotonic()
    os.makedirs(args.out, exist_ok=True)
    model_path = build_warm_start(args.config, args.out, shared)
    # The tiny model's warm start is a Hugging Face directory; a real checkpoint keeps its format.
    source = "hf" if base.model.source == "tiny" else base.model.source
    shared.update({
        "model.source": source, "model.path": model_path, "data.split_seed": base.seed,
        "train.progress": False,
        **checkpointing(shared["train.num_steps"], rows.checkpoint_every if rows else 0),
        # One persistent compilation cache for all runs: most programs are the same in every run.
        "train.compilation_cache_dir": os.path.join(os.path.abspath(args.out), "compile_cache")})
    runs, jobs = [], []
    for seed in range(first, first + seeds):  # every variant's first seed before any second one
        for name in names:
            variant = known[name]
            if seed and not variant.seeded:
                continue
            run = Run(variant, base.seed + seed, os.path.join(args.out, "runs", f"{name}_s{seed}"))
            overrides = {**shared, "seed": run.seed, "eval.before": not runs}
            jobs.append(Job(run.name, run.workdir, DONE,
                            command(args.config, run, {**overrides, **variant.overrides})))
            jobs.extend(Job(f"{run.name} under {policy}", run.workdir, eval_marker(policy),
                            command(args.config, run, {**overrides,
                                                       **variant.eval_overrides(policy)},
                                    module="qurl_jax.evaluate"), needs=run.name)
                        for policy in variant.evals)
            runs.append(run)
    stale = [j.name for j in jobs
             if (done := j.done()) and not same_command(done["command"], j.command)]
    if stale:
        sys.exit(f"python -m qurl_jax.study: {args.out} holds finished runs made with other "
                 f"settings ({', '.join(stale)}); use another --out")
    print(f"[study] {len(runs)} runs of {shared['train.num_steps']} steps and "
          f"{len(jobs) - len(runs)} evaluations, {args.jobs} at a time, in {args.out}",
          flush=True)
    run_all(jobs, args.jobs, FileLock(args.lock) if args.lock else None)

    results = aggregate(runs)
    before = _before(args.out)
    failed = [j.name for j in jobs if j.done() is None]
    wall = time.monotonic() - start
    run_wall = sum(done["wall_s"] for j in jobs if (done := j.done()) is not None)
    text = "\n".join([
        f"# Rollout-precision study ({args.rows or args.config})", "",
        f"{len(jobs) - len(failed)} of {len(jobs)} runs and evaluations finished, "
        f"{shared['train.num_steps']} RL steps each, seeds "
        f"{base.seed + first}..{base.seed + first + seeds - 1} for the * rows. They took "
        f"{run_wall / 60:.1f} min of wall time summed over runs; this invocation "
        f"{wall / 60:.1f} min with {args.jobs} runs at a time (runs finished before it are not "
        "run again).",
        "Accuracy: the full-precision policy after RL (`<policy>_cache`: under that compressed "
        "KV cache); reward: mean of the last quarter of the steps; other columns: mean over "
        "steps 2.. (step 1 compiles); vetoed seqs: total over the run; run min and peak GB: the "
        "whole run (evaluations included; a run resumed after a stop: over its attempts); "
        "mean ± std over seeds.", "",
        table(results, before), "", "Per run and evaluation:", "", job_lines(jobs), ""]
        + ([QUICK_NOTE, ""] if args.quick else [])
        + ([f"Failed (see their log*.txt): {', '.join(failed)}", ""] if failed else []))
    stem = f"study_{args.rows}" if args.rows else "study"
    with open(os.path.join(args.out, f"{stem}.md"), "w", encoding="utf-8") as f:
        f.write(text)
    with open(os.path.join(args.out, f"{stem}.json"), "w", encoding="utf-8") as f:
        json.dump({"config": args.config, "rows": args.rows, "steps": shared["train.num_steps"],
                   "before": before, "variants": results, "failed": failed, "wall_s": wall,
                   "run_wall_s": run_wall, "jobs": {j.name: j.done() for j in jobs}}, f,
                  indent=1)
    plots = write_figures(runs, args.out)
    print(text)
    print("\n".join(plots))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
