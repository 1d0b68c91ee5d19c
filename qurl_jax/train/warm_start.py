"""The embedded default's demo code: the tiny in-code policy and its supervised warm start.

`tiny_policy` builds (or reloads from `<workdir>/sft_model`) the tiny model of `model.tiny` with the
character-level tokenizer, both saved in Hugging Face format so they are reloaded through the
normal path. With `sft.steps > 0` it first trains a supervised warm start; for the arithmetic task
on the completions of a *noisy teacher* (`noisy_teacher_pairs`): correct answers, a share of them
with a stray end character that the exact-match verifier rejects, so that RL has a format to repair;
for the chain task on the chains of a *buggy teacher* (`chains.teacher_pairs`) that forgets the
carry of a units sum of ten with probability `sft.bug_rate`, so that RL has a skill to repair.
The cache is keyed on every setting it depends on (for the math task also the content hash of its
training examples, so a changed data file rebuilds it) and rebuilt when one changes. The math
task's teacher answers `\\boxed{answer}` when `data.prompt_suffix` asks for it, else the bare
answer.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from qurl_jax.config.settings import DataSettings, ModelSettings, SftSettings
from qurl_jax.data import arithmetic as arith
from qurl_jax.data import chains
from qurl_jax.data.datasets import MathExample, build_prompt
from qurl_jax.data.tokenizer import build_char_tokenizer
from qurl_jax.models import (
    ModelConfig,
    Transformer,
    init_params,
    positions_from_mask,
    token_logprobs,
)
from qurl_jax.models.hf import load_hf, save_hf


def tiny_model_config(model: ModelSettings) -> ModelConfig:
    """The `ModelConfig` of `model.tiny` (at `model.dtype`) with the character tokenizer's
    vocabulary."""
    t = model.tiny
    family = t.model_type
    return ModelConfig(
        model_type=family, vocab_size=len(build_char_tokenizer()), hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings,
        max_position_embeddings=t.max_position_embeddings,
        attention_bias=family == "qwen2", qk_norm=family == "qwen3", dtype=model.dtype,
    ).validate()


def supervised_warm_start(model_config: ModelConfig, params: Any,
                          pairs: Sequence[tuple[str, str]], tokenizer: Any, *, steps: int,
                          learning_rate: float, batch_size: int, seed: int) -> Any:
    """Teacher-forced next-token training on (prompt, completion) pairs; loss on completions only.

    All pairs are packed once into one right-padded array; each step draws a random batch of rows.
    """
    rows = [(tokenizer.encode(p, add_special_tokens=False),
             tokenizer.encode(a, add_special_tokens=False)) for p, a in pairs]
    width = max(len(p) + len(a) for p, a in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    loss_mask = np.zeros((len(rows), width), np.float32)
    valid = np.zeros((len(rows), width), bool)
    for i, (p, a) in enumerate(rows):
        tokens[i, : len(p) + len(a)] = p + a
        valid[i, : len(p) + len(a)] = True
        loss_mask[i, len(p): len(p) + len(a)] = 1.0
    positions = positions_from_mask(valid)
    model = Transformer(model_config)
    warmup = max(steps // 20, 1)  # the cosine needs a step after the warm-up (sft.steps=1 too)
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, warmup, max(steps, warmup + 1), learning_rate * 0.1),
        weight_decay=0.0)
    opt_state = tx.init(params)

    def loss_fn(p, tok, pos, val, lm):
        logits, _ = model.apply({"params": p}, tok, pos, val)
        nll = -token_logprobs(logits[:, :-1], tok[:, 1:])
        return jnp.sum(nll * lm[:, 1:]) / jnp.maximum(jnp.sum(lm[:, 1:]), 1.0)

    def train_step(carry, idx):
        p, o = carry
        loss, grads = jax.value_and_grad(loss_fn)(
            p, tokens_d[idx], positions_d[idx], valid_d[idx], mask_d[idx])
        updates, o = tx.update(grads, o, p)
        return (optax.apply_updates(p, updates), o), loss

    # Steps run in chunks of one `lax.scan` per call (one dispatch per step cost 4% of the
    # embedded default's warm start); the batches are the same draws.
    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_steps(p, o, idx):
        (p, o), losses = jax.lax.scan(train_step, (p, o), idx)
        return p, o, losses[-1]

    tokens_d, positions_d, valid_d, mask_d = map(jnp.asarray, (tokens, positions, valid, loss_mask))
    rng = np.random.default_rng(seed)
    every = max(steps // 5, 1)  # a log line every fifth of the run
    chunk = _sft_chunk(every)
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        idx = jnp.asarray(rng.integers(0, len(rows), (n, batch_size)))
        params, opt_state, loss = train_steps(params, opt_state, idx)
        done += n
        if done % every == 0:
            logging.info("warm start step %d/%d: loss %.4f", done, steps, float(loss))
    return params


def _sft_chunk(every: int, most: int = 100) -> int:
    """Steps per compiled call: the largest divisor of the logging interval up to `most`, so every
    call has the same length (one compile) and each log line falls at a call's end."""
    return max(d for d in range(1, min(every, most) + 1) if every % d == 0)


FORMAT_JUNK = ".?!"


def noisy_teacher_pairs(pairs: Sequence[tuple[str, str]], format_noise: float, seed: int,
                        eos: str) -> list[tuple[str, str]]:
    """The (prompt, "<answer><eos>") pairs of a sloppy teacher: with probability `format_noise` a
    completion gets a stray character before EOS ("19." instead of "19"), which an exact-match
    verifier scores as wrong. The answers themselves stay correct.
    """
    rng = np.random.default_rng(seed)
    out = []
    for prompt, completion in pairs:
        if rng.random() < format_noise:
            junk = FORMAT_JUNK[int(rng.integers(len(FORMAT_JUNK)))]
            completion = completion.removesuffix(eos) + junk + eos
        out.append((prompt, completion))
    return out


def data_hash(examples: Sequence[MathExample]) -> str:
    """SHA-256 of the problems and answers a warm start trains on (their content, in order)."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps([ex.problem, ex.answer, list(ex.alternatives)]).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def _warm_start_key(model: ModelSettings, data: DataSettings, sft: SftSettings,
                    seed: int, train: Sequence[MathExample] = ()) -> dict[str, Any]:
    """Everything the cached warm start depends on; a cache with another key is rebuilt. A math
    task's includes the content hash of its training examples (`data_hash`) and how they are
    prompted, so a changed data file is never met with a stale warm start."""
    key = {"seed": seed, "tiny": dataclasses.asdict(model.tiny), "sft": dataclasses.asdict(sft),
           "task": data.task, "digits": data.arith_digits, "ops": data.arith_ops}
    if data.split_seed >= 0:  # the examples it trains on come from this split
        key.update(split_seed=data.split_seed)
    if data.task == "chain":
        key.update(chain_steps=[data.chain.min_steps, data.chain.max_steps],
                   chain_carry10_share=data.chain.carry10_share,
                   chat_template=data.chat_template)
    if data.task == "math":
        key.update(data_sha256=data_hash(train), prompt_suffix=data.prompt_suffix,
                   chat_template=data.chat_template)
    return key


def math_completion(answer: str, prompt_suffix: str) -> str:
    """The warm-start teacher's answer to a math problem: `\\boxed{answer}` when the prompt suffix
    asks for a boxed answer, else the bare answer."""
    return f"\\boxed{{{answer}}}" if "\\boxed" in prompt_suffix else answer


def tiny_policy(model: ModelSettings, data: DataSettings, sft: SftSettings, *, seed: int,
                workdir: str, train: Sequence[MathExample]) -> tuple[ModelConfig, Any, Any]:
    """The tiny in-code policy of `model.tiny`: loaded from the workdir's cache, or built (and
    warm-started on `train` per `sft`, seeded with `seed`)."""
    sft_dir = os.path.join(workdir, "sft_model")
    key_file = os.path.join(sft_dir, "warm_start.json")
    key = json.loads(json.dumps(_warm_start_key(model, data, sft, seed, train)))
    if sft.steps and os.path.isfile(key_file):
        with open(key_file, encoding="utf-8") as f:
            cached = json.load(f)
        if cached == key:
            logging.info("reusing the cached warm start in %s", sft_dir)
            model_config, params = load_hf(sft_dir)
            # The character tokenizer is built in code: transformers' AutoTokenizer reloads the
            # saved one as the model family's tokenizer (Qwen2's byte-level pre-tokenizer), which
            # drops spaces, so a cached warm start would see other prompts than a fresh one.
            return model_config.replace(dtype=model.dtype), params, build_char_tokenizer()
        logging.warning("the cached warm start in %s was built with other settings; rebuilding",
                        sft_dir)
    tokenizer = build_char_tokenizer()
    model_config = tiny_model_config(model)
    params = init_params(model_config, jax.random.key(seed))
    if sft.steps:
        if data.task == "arithmetic":
            pairs = noisy_teacher_pairs(arith.sft_pairs(train, tokenizer), sft.format_noise,
                                        seed, tokenizer.eos_token)
        elif data.task == "chain":
            prompt_fn = functools.partial(build_prompt, tokenizer=tokenizer,
                                          chat=data.chat_template,
                                          template=chains.CHAIN_TEMPLATE)
            pairs = chains.teacher_pairs(train, prompt_fn, sft.bug_rate, seed,
                                         tokenizer.eos_token)
        else:
            template = "{problem}" + data.prompt_suffix
            pairs = [(build_prompt(ex.problem, tokenizer, chat=data.chat_template,
                                   template=template),
                      math_completion(ex.answer, data.prompt_suffix) + tokenizer.eos_token)
                     for ex in train]
        logging.info("supervised warm start: %d steps on %d examples", sft.steps, len(pairs))
        params = supervised_warm_start(model_config, params, pairs, tokenizer, steps=sft.steps,
                                       learning_rate=sft.learning_rate,
                                       batch_size=sft.batch_size, seed=seed)
        params = jax.device_get(params)
        if jax.process_index() == 0:  # every process trains the same warm start; one saves it
            save_hf(sft_dir, model_config, params, tokenizer=tokenizer)
            with open(key_file, "w", encoding="utf-8") as f:
                json.dump(key, f, sort_keys=True)
    return model_config, params, tokenizer
