"""What the trainer trains on: the policy's weights and tokenizer, prompts, verifier and evaluation.

`build_model_and_task(config, workdir)` returns the model configuration, the initial float32
parameters and a `Task`:
- `model.source='hf'`: a local Hugging Face directory (`load_hf` + its tokenizer); a missing or
  incomplete checkpoint is an error, never a random initialisation.
- `model.source='tiny'`: a tiny model of `model.tiny`'s family with the character-level tokenizer,
  both built in code and saved in Hugging Face format under the workdir, so they are reloaded
  through the normal path. For the arithmetic task a supervised warm start (`sft.steps`) is trained
  once and cached in `<workdir>/sft_model`; a second run (or a resumed one) reuses it.

A `Task` turns examples into prompt token ids, responses into rewards (math-verify in verifier
processes for math, exact match for arithmetic, both on a thread pool), and runs the evaluation
(Avg@k / Pass@k, and greedy accuracy) with the full-precision sampler.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

from qurl_jax.data import arithmetic as arith
from qurl_jax.data.datasets import MathExample, PromptIterator, build_prompt, load_math_file
from qurl_jax.data.evaluation import evaluate as evaluate_examples
from qurl_jax.data.rewards import (
    RewardComputer,
    exact_match_reward,
    math_format_reward,
    math_reward,
)
from qurl_jax.data.tokenizer import build_char_tokenizer
from qurl_jax.models import (
    ModelConfig,
    Transformer,
    init_params,
    positions_from_mask,
    token_logprobs,
)
from qurl_jax.models.hf import load_hf, load_tokenizer, save_hf
from qurl_jax.sampling import Sampler

ARITH_EVAL_SIZE = 256
ARITH_TRAIN_SIZE = 4000


class Task:
    """Prompts, rewards and evaluation for one run."""

    def __init__(self, tokenizer: Any, train: Sequence[MathExample],
                 eval_sets: dict[str, list[MathExample]], *, reward: RewardComputer,
                 template: str | None, chat: bool, prompts_per_step: int, max_prompt_len: int,
                 seed: int) -> None:
        self.tokenizer = tokenizer
        self._template = template
        self._chat = chat
        self.reward = reward
        eos = tokenizer.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        kept, self.skipped_long = [], 0
        for ex in train:
            if len(self.encode(ex.problem)) <= max_prompt_len:
                kept.append(ex)
            else:
                self.skipped_long += 1
        if not kept:
            raise ValueError(f"no training prompt fits data.max_prompt_len={max_prompt_len}")
        if self.skipped_long:
            logging.warning("skipped %d training prompts longer than data.max_prompt_len=%d",
                            self.skipped_long, max_prompt_len)
        self.train_examples = kept
        self.eval_sets = eval_sets
        self.iterator = PromptIterator(kept, prompts_per_step, seed=seed)

    # ----------------------------------------------------------------------------------- prompts
    def prompt_text(self, problem: str) -> str:
        kwargs = {} if self._template is None else {"template": self._template}
        return build_prompt(problem, self.tokenizer, chat=self._chat, **kwargs)

    def encode(self, problem: str) -> list[int]:
        return list(self.tokenizer.encode(self.prompt_text(problem), add_special_tokens=False))

    def next_prompts(self, n: int) -> tuple[list[list[int]], list[Any]]:
        """The next training prompts (token ids) and reference answers; advances the stream."""
        if n != self.iterator.batch_size:
            raise ValueError(f"next_prompts({n}): the iterator yields {self.iterator.batch_size}")
        batch = next(self.iterator)
        return [self.encode(ex.problem) for ex in batch], [ex.gold_answers for ex in batch]

    def sample_prompts(self, n: int) -> tuple[list[list[int]], list[Any]]:
        """The first n training prompts, without touching the stream (benchmarks)."""
        batch = self.train_examples[:n]
        return [self.encode(ex.problem) for ex in batch], [ex.gold_answers for ex in batch]

    def state(self) -> dict[str, int]:
        return self.iterator.state()

    def restore(self, state: dict[str, int]) -> None:
        self.iterator.restore(state)

    # ----------------------------------------------------------------------------------- rewards
    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        lengths = np.asarray(mask).sum(axis=1)
        return [self.tokenizer.decode(np.asarray(tokens)[i, : lengths[i]].tolist(),
                                      skip_special_tokens=True) for i in range(len(lengths))]

    def rewards(self, texts: Sequence[str], answers: Sequence[Any]) -> np.ndarray:
        return np.asarray(self.reward(list(texts), list(answers)), np.float32)

    # -------------------------------------------------------------------------------- evaluation
    @property
    def has_eval(self) -> bool:
        return bool(self.eval_sets)

    def evaluate(self, sampler: Sampler, params: Any, config: ml_collections.ConfigDict,
                 key: jax.Array) -> dict[str, float]:
        """Avg@k and Pass@k (sampled at eval.temperature) per eval set, plus greedy accuracy."""
        e = config.eval
        calls = iter(range(1 << 30))

        def generate_fn(prompts: list[str], n: int, greedy: bool = False) -> list[list[str]]:
            ids = [list(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
            out = sampler.sample(params, ids, key=jax.random.fold_in(key, next(calls)), n=n,
                                 max_new_tokens=e.max_new_tokens, temperature=e.temperature,
                                 greedy=greedy, eos_ids=self.eos_ids)
            out = jax.device_get(out)
            texts = self.decode(out.tokens, out.mask)
            return [texts[i * n:(i + 1) * n] for i in range(len(prompts))]

        metrics: dict[str, float] = {}
        for name, examples in self.eval_sets.items():
            if e.max_examples:
                examples = examples[: e.max_examples]
            if not e.greedy:
                sampled = evaluate_examples(generate_fn, examples, self.reward, k=e.k,
                                            prompt_fn=self.prompt_text)
                metrics.update({f"{name}/{k.split('/', 1)[1]}": v for k, v in sampled.items()
                                if k.startswith("all/")})
            greedy = evaluate_examples(functools.partial(generate_fn, greedy=True), examples,
                                       self.reward, k=1, prompt_fn=self.prompt_text)
            metrics[f"{name}/greedy_acc"] = greedy["all/avg@1"]
        return metrics

    def export(self, path: str, model_config: ModelConfig, params: Any) -> None:
        save_hf(path, model_config, params, tokenizer=self.tokenizer)
        logging.info("exported the policy in Hugging Face format to %s", path)

    def close(self) -> None:
        self.reward.close()


# ------------------------------------------------------------------------------------ building
def _tiny_model_config(c: ml_collections.ConfigDict, vocab_size: int) -> ModelConfig:
    t = c.model.tiny
    family = t.model_type
    return ModelConfig(
        model_type=family, vocab_size=vocab_size, hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size, num_layers=t.num_layers, num_heads=t.num_heads,
        num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rope_theta=t.rope_theta,
        tie_word_embeddings=t.tie_word_embeddings,
        max_position_embeddings=t.max_position_embeddings,
        attention_bias=family == "qwen2", qk_norm=family == "qwen3", dtype=c.model.dtype,
    ).validate()


def _arith_config(c: ml_collections.ConfigDict) -> arith.ArithmeticConfig:
    return arith.ArithmeticConfig(max_digits=c.data.arith_digits,
                                  operators=tuple(c.data.arith_ops))


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
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(
        0.0, learning_rate, max(steps // 20, 1), steps, learning_rate * 0.1), weight_decay=0.0)
    opt_state = tx.init(params)

    def loss_fn(p, tok, pos, val, lm):
        logits, _ = model.apply({"params": p}, tok, pos, val)
        nll = -token_logprobs(logits[:, :-1], tok[:, 1:])
        return jnp.sum(nll * lm[:, 1:]) / jnp.maximum(jnp.sum(lm[:, 1:]), 1.0)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def train_step(p, o, idx):
        loss, grads = jax.value_and_grad(loss_fn)(
            p, tokens_d[idx], positions_d[idx], valid_d[idx], mask_d[idx])
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, loss

    tokens_d, positions_d, valid_d, mask_d = map(jnp.asarray, (tokens, positions, valid, loss_mask))
    rng = np.random.default_rng(seed)
    loss = jnp.nan
    for step in range(steps):
        idx = jnp.asarray(rng.integers(0, len(rows), batch_size))
        params, opt_state, loss = train_step(params, opt_state, idx)
        if (step + 1) % max(steps // 5, 1) == 0:
            logging.info("warm start step %d/%d: loss %.4f", step + 1, steps, float(loss))
    return params


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


def _warm_start_key(c: ml_collections.ConfigDict) -> dict[str, Any]:
    """Everything the cached warm start depends on; a cache with another key is rebuilt."""
    return {"seed": c.seed, "tiny": c.model.tiny.to_dict(), "sft": c.sft.to_dict(),
            "task": c.data.task, "digits": c.data.arith_digits, "ops": c.data.arith_ops}


def _tiny_policy(c: ml_collections.ConfigDict, workdir: str, train: list[MathExample]
                 ) -> tuple[ModelConfig, Any, Any]:
    """The tiny in-code policy: loaded from the workdir's cache, or built (and warm-started)."""
    sft_dir = os.path.join(workdir, "sft_model")
    key_file = os.path.join(sft_dir, "warm_start.json")
    key = json.loads(json.dumps(_warm_start_key(c)))
    if c.sft.steps and os.path.isfile(key_file):
        with open(key_file, encoding="utf-8") as f:
            cached = json.load(f)
        if cached == key:
            logging.info("reusing the cached warm start in %s", sft_dir)
            model_config, params = load_hf(sft_dir)
            return model_config.replace(dtype=c.model.dtype), params, load_tokenizer(sft_dir)
        logging.warning("the cached warm start in %s was built with other settings; rebuilding",
                        sft_dir)
    tokenizer = build_char_tokenizer()
    model_config = _tiny_model_config(c, len(tokenizer))
    params = init_params(model_config, jax.random.key(c.seed))
    if c.sft.steps:
        if c.data.task == "arithmetic":
            pairs = noisy_teacher_pairs(arith.sft_pairs(train, tokenizer), c.sft.format_noise,
                                        c.seed, tokenizer.eos_token)
        else:
            pairs = [(build_prompt(ex.problem, tokenizer),
                      f"\\boxed{{{ex.answer}}}{tokenizer.eos_token}") for ex in train]
        logging.info("supervised warm start: %d steps on %d examples", c.sft.steps, len(pairs))
        params = supervised_warm_start(model_config, params, pairs, tokenizer, steps=c.sft.steps,
                                       learning_rate=c.sft.learning_rate,
                                       batch_size=c.sft.batch_size, seed=c.seed)
        params = jax.device_get(params)
        save_hf(sft_dir, model_config, params, tokenizer=tokenizer)
        with open(key_file, "w", encoding="utf-8") as f:
            json.dump(key, f, sort_keys=True)
    return model_config, params, tokenizer


def _reward_computer(c: ml_collections.ConfigDict) -> RewardComputer:
    if c.data.task == "arithmetic":
        return RewardComputer(exact_match_reward, num_workers=1, use_processes=False)
    fn = math_reward if c.reward.format_weight == 0 else functools.partial(
        math_format_reward, format_weight=c.reward.format_weight)
    return RewardComputer(fn, num_workers=c.reward.workers, timeout_s=c.reward.timeout_s)


def build_model_and_task(c: ml_collections.ConfigDict, workdir: str
                         ) -> tuple[ModelConfig, Any, Task]:
    """(model config, initial float32 params, task) for a validated run config."""
    eval_sets: dict[str, list[MathExample]] = {}
    if c.data.task == "arithmetic":
        train, held_out = arith.arithmetic_splits(ARITH_TRAIN_SIZE, ARITH_EVAL_SIZE, seed=c.seed,
                                                  config=_arith_config(c))
        eval_sets["arith"] = held_out
        template = arith.ARITHMETIC_TEMPLATE
    else:
        train = []
        for path in c.data.train_files:
            examples, stats = load_math_file(path)
            logging.info("loaded %s: %s", path, stats)
            train.extend(examples)
        template = None
    for path in c.eval.files:
        examples, stats = load_math_file(path)
        eval_sets[os.path.splitext(os.path.basename(path))[0]] = examples

    if c.model.source == "hf":
        model_config, params = load_hf(c.model.path)
        model_config = model_config.replace(dtype=c.model.dtype)
        tokenizer = load_tokenizer(c.model.path)
    else:
        model_config, params, tokenizer = _tiny_policy(c, workdir, train)
    task = Task(tokenizer, train, eval_sets, reward=_reward_computer(c), template=template,
                chat=c.data.chat_template, prompts_per_step=c.data.prompts_per_step,
                max_prompt_len=c.data.max_prompt_len, seed=c.seed)
    return model_config, params, task
