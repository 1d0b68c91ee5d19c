"""What the trainer trains on: the policy's weights and tokenizer, prompts, verifier and evaluation.

`build_model_and_task(settings, workdir)` (a `qurl_jax.config.settings.RunSettings`) returns the
model configuration, the initial float32 parameters and a `Task`:
- `model.source='hf'`: a local Hugging Face directory (`load_hf` + its tokenizer); a missing or
  incomplete checkpoint is an error, never a random initialisation.
- `model.source='gguf'`: a local llama.cpp GGUF file (`load_gguf` + the tokenizer and chat
  template of its metadata).
- `model.source='tiny'`: the embedded default's tiny model, built in code with its supervised warm
  start and cached under the workdir (`qurl_jax.train.warm_start`).
`model_config_for(settings.model)` gives the model configuration alone, without reading weights or
writing anything, so a run can check its workdir's checkpoint first.

A `Task` turns examples into prompt token ids, responses into rewards and the verifier's 0/1
accuracy (math-verify in verifier processes for math, exact match for arithmetic, the final answer
for chains, all on a thread pool; the optional format term is added to the reward, never to the
accuracy), and runs the evaluation (Avg@k / Pass@k, and greedy accuracy) with the full-precision
sampler, per evaluation set. The synthetic tasks build their own held-out set: "arith" for
arithmetic; "chain" and its carry-10 sub-case "chain_carry10" (the same problems, filtered) for
chains.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from absl import logging

from qurl_jax.config.settings import (
    DataSettings,
    EvalSettings,
    ModelSettings,
    RewardSettings,
    RunSettings,
)
from qurl_jax.data import arithmetic as arith
from qurl_jax.data import chains, reward_hook
from qurl_jax.data.datasets import (
    MathExample,
    PromptIterator,
    build_prompt,
    gold_answers,
    load_math_file,
)
from qurl_jax.data.evaluation import evaluate as evaluate_examples
from qurl_jax.data.rewards import RewardComputer, exact_match_reward, format_reward, math_reward
from qurl_jax.data.tokenizer import build_char_tokenizer
from qurl_jax.models import ModelConfig
from qurl_jax.models.gguf import config_from_gguf, load_gguf, load_gguf_tokenizer
from qurl_jax.models.hf import config_from_hf, load_hf, load_tokenizer, save_hf
from qurl_jax.parallel.distributed import is_primary, to_host
from qurl_jax.runtime import paths
from qurl_jax.runtime.errors import DataError
from qurl_jax.runtime.progress import Progress
from qurl_jax.sampling import FinishReason, RefillSampler, Sampler
from qurl_jax.sampling.factory import samples_per_call
from qurl_jax.train.warm_start import tiny_model_config, tiny_policy

ARITH_EVAL_SIZE = 256
ARITH_TRAIN_SIZE = 4000
CHAIN_EVAL_SIZE = 256
CHAIN_TRAIN_SIZE = 4000


def prompt_text(problem: str, tokenizer: Any, *, template: str | None, chat: bool) -> str:
    """The prompt a task gives the policy for `problem` (`template` None: the math template)."""
    kwargs = {} if template is None else {"template": template}
    return build_prompt(problem, tokenizer, chat=chat, **kwargs)


def fitting_prompts(train: Sequence[MathExample], encode: Callable[[str], list[int]],
                    max_prompt_len: int) -> list[MathExample]:
    """The training examples whose encoded prompt fits `max_prompt_len`; `DataError` naming the
    field and the shortest prompt when none does."""
    lengths = [len(encode(ex.problem)) for ex in train]
    kept = [ex for ex, n in zip(train, lengths, strict=True) if n <= max_prompt_len]
    if not kept:
        raise DataError(f"config.data.max_prompt_len={max_prompt_len}: no training prompt fits "
                        f"(the shortest of {len(train)} has {min(lengths, default=0)} tokens)")
    return kept


class Task:
    """Prompts, rewards and evaluation for one run."""

    def __init__(self, tokenizer: Any, train: Sequence[MathExample],
                 eval_sets: dict[str, list[MathExample]], *, reward: RewardComputer,
                 template: str | None, chat: bool, prompts_per_step: int, max_prompt_len: int,
                 seed: int, format_weight: float = 0.0,
                 answer_of: Callable[[MathExample], Any] = gold_answers) -> None:
        """`reward` scores correctness (0/1, or a reward function's own values); `format_weight`
        w mixes in `format_reward`: reward = (1 - w) * correct + w * format. `answer_of` gives
        what `reward` gets as an example's answer (a reward function's: (answer, prompt))."""
        self.tokenizer = tokenizer
        self.answer_of = answer_of
        self.format_weight = format_weight
        self._template = template
        self._chat = chat
        self.reward = reward
        eos = tokenizer.eos_token_id
        self.eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0)
        kept = fitting_prompts(train, self.encode, max_prompt_len)
        self.skipped_long = len(train) - len(kept)
        if self.skipped_long:
            logging.warning("skipped %d training prompts longer than data.max_prompt_len=%d",
                            self.skipped_long, max_prompt_len)
        self.train_examples = kept
        self.eval_sets = eval_sets
        self.iterator = PromptIterator(kept, prompts_per_step, seed=seed)

    # ----------------------------------------------------------------------------------- prompts
    def prompt_text(self, problem: str) -> str:
        return prompt_text(problem, self.tokenizer, template=self._template, chat=self._chat)

    def encode(self, problem: str) -> list[int]:
        return list(self.tokenizer.encode(self.prompt_text(problem), add_special_tokens=False))

    def next_prompts(self, n: int, shard: tuple[int, int] = (0, 1)
                     ) -> tuple[list[list[int]], list[Any]]:
        """The next training prompts (token ids) and reference answers; advances the stream.

        `shard=(i, k)`: only the i-th of k equal contiguous slices of the batch of n is encoded
        and returned (process i's block in a multi-process run); the stream advances by all n, so
        every process stays at the same position."""
        if n != self.iterator.batch_size:
            raise ValueError(f"next_prompts({n}): the iterator yields {self.iterator.batch_size}")
        index, count = shard
        if n % count or not 0 <= index < count:
            raise ValueError(f"next_prompts({n}, shard={shard}): not a slice of the batch")
        batch = next(self.iterator)[index * (n // count):(index + 1) * (n // count)]
        return [self.encode(ex.problem) for ex in batch], [self.answer_of(ex) for ex in batch]

    def sample_prompts(self, n: int) -> tuple[list[list[int]], list[Any]]:
        """The first n training prompts, without touching the stream (benchmarks)."""
        batch = self.train_examples[:n]
        return [self.encode(ex.problem) for ex in batch], [self.answer_of(ex) for ex in batch]

    def state(self) -> dict[str, int]:
        return self.iterator.state()

    def restore(self, state: dict[str, int]) -> None:
        self.iterator.restore(state)

    # ----------------------------------------------------------------------------------- rewards
    def decode(self, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
        lengths = np.asarray(mask).sum(axis=1)
        return [self.tokenizer.decode(np.asarray(tokens)[i, : lengths[i]].tolist(),
                                      skip_special_tokens=True) for i in range(len(lengths))]

    def rewards(self, texts: Sequence[str], answers: Sequence[Any]
                ) -> tuple[np.ndarray, np.ndarray]:
        """(reward f32[N], accuracy f32[N]) of N responses: accuracy is the verifier's 0/1 outcome
        (0 when verification timed out or failed); the reward adds the format term, if any."""
        accuracy = np.asarray(self.reward(list(texts), list(answers)), np.float32)
        if not self.format_weight:
            return accuracy, accuracy
        fmt = np.array([format_reward(t) for t in texts], np.float32)
        w = self.format_weight
        return ((1.0 - w) * accuracy + w * fmt).astype(np.float32), accuracy

    def verifier_stats(self) -> dict[str, int]:
        """Verifier counts since the task was built: calls, timeouts, errors, crashes, and
        worker_failures (a verifier worker could not be started; the response scored 0)."""
        return self.reward.stats

    # -------------------------------------------------------------------------------- evaluation
    @property
    def has_eval(self) -> bool:
        return bool(self.eval_sets)

    def evaluate(self, sampler: Sampler | RefillSampler, params: Any, e: EvalSettings,
                 key: jax.Array, *, bar: bool = True) -> dict[str, float]:
        """Avg@k and Pass@k (sampled at `e.temperature`) per eval set, plus greedy accuracy and
        the share of greedy responses cut off at `e.max_new_tokens` (`greedy_truncated`).

        Each pass over a set (k samples per problem, then greedy) shows its progress
        (`runtime.progress.Progress`: problems done, tokens/s, time left; a bar on a terminal
        when `bar`, else a line at least every 30 s), on process 0 only."""
        calls = iter(range(1 << 30))
        cut = [0, 0]  # greedy responses cut off at e.max_new_tokens, greedy responses

        def generate_fn(prompts: list[str], n: int, greedy: bool = False,
                        report: Progress | None = None) -> list[list[str]]:
            ids = [list(self.tokenizer.encode(p, add_special_tokens=False)) for p in prompts]
            # Rounds of m samples per prompt when the sampler's chunk cannot hold n on every
            # replica (eval.k x replicas > rollout.max_concurrent_rows); one call otherwise.
            m = samples_per_call(sampler, n)
            out_texts: list[list[str]] = [[] for _ in prompts]
            made = 0  # tokens of the finished rounds
            for r in range(n // m):
                def progress(rows: int, tokens: int, r: int = r, made: int = made) -> None:
                    report.update((r * len(prompts) * m + rows) // n, made + tokens)

                out = sampler.sample(params, ids, e.sampling(self.eos_ids, greedy),
                                     key=jax.random.fold_in(key, next(calls)), n=m,
                                     progress=progress if report is not None else None)
                out = to_host(out)  # the whole batch, also from other processes' devices
                made += int(np.asarray(out.lengths).sum())
                texts = self.decode(out.tokens, out.mask)
                if greedy:
                    reasons = np.asarray(out.finish_reason)
                    cut[0] += int((reasons == FinishReason.LENGTH).sum())
                    cut[1] += reasons.size
                for i in range(len(prompts)):
                    out_texts[i].extend(texts[i * m:(i + 1) * m])
            return out_texts

        def run(name: str, examples: list[MathExample], k: int, greedy: bool) -> dict[str, float]:
            what = "greedy" if greedy else f"{k} samples at T={e.temperature:g}"
            report = Progress(f"eval {name}, {what}", len(examples), "problems", bar=bar,
                              enabled=is_primary())
            generate = functools.partial(generate_fn, greedy=greedy, report=report)
            try:
                return evaluate_examples(generate, examples, self.reward, k=k,
                                         prompt_fn=self.prompt_text, answer_fn=self.answer_of)
            finally:
                report.close()

        metrics: dict[str, float] = {}
        for name, examples in self.eval_sets.items():
            if e.max_examples:
                examples = examples[: e.max_examples]
            if not e.greedy_only:
                sampled = run(name, examples, e.k, greedy=False)
                metrics.update({f"{name}/{k.split('/', 1)[1]}": v for k, v in sampled.items()
                                if k.startswith("all/")})
            greedy = run(name, examples, 1, greedy=True)
            metrics[f"{name}/greedy_acc"] = greedy["all/avg@1"]
            metrics[f"{name}/greedy_truncated"] = cut[0] / max(cut[1], 1)
            cut[:] = [0, 0]
        return metrics

    def export(self, path: str, model_config: ModelConfig, params: Any) -> None:
        save_hf(path, model_config, params, tokenizer=self.tokenizer)
        logging.info("exported the policy in Hugging Face format to %s", path)

    def close(self) -> None:
        self.reward.close()


def result_line(metrics: dict[str, float]) -> str:
    """`Task.evaluate`'s metrics in one line, per evaluation set: greedy accuracy, Avg@k and
    Pass@k (when sampled), the share of greedy answers cut off at the length limit, problems."""
    parts = []
    for name in dict.fromkeys(k.split("/", 1)[0] for k in metrics):
        m = {k.split("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"{name}/")}
        fields = [f"greedy {m['greedy_acc']:.1%}"] if "greedy_acc" in m else []
        fields += [f"{k} {v:.1%}" for k, v in m.items() if k.startswith(("avg@", "pass@"))]
        if "greedy_truncated" in m:
            fields.append(f"greedy cut off {m['greedy_truncated']:.1%}")
        if "num_examples" in m:
            fields.append(f"{m['num_examples']:.0f} problems")
        parts.append(f"{name}: " + ", ".join(fields))
    return "; ".join(parts)


# ------------------------------------------------------------------------------------ building
def _reward_computer(data: DataSettings, reward: RewardSettings,
                     reward_fn: Callable[..., Any] | None = None
                     ) -> tuple[RewardComputer, Callable[[MathExample], Any]]:
    """The reward of the run and what it takes as an example's answer: a reward function
    (`reward_fn`, else `reward.function`; `qurl_jax.data.reward_hook`) in the verifier processes,
    else the correctness verifier of `data.task` (the format term is added by `Task.rewards`)."""
    hook = reward_fn if reward_fn is not None else reward.function
    if hook:
        return (reward_hook.hook_computer(hook, workers=reward.workers,
                                          timeout_s=reward.timeout_s),
                reward_hook.answer_and_prompt)
    return _task_verifier(data, reward), gold_answers


def _task_verifier(data: DataSettings, reward: RewardSettings) -> RewardComputer:
    if data.task == "arithmetic":
        return RewardComputer(exact_match_reward, num_workers=1, use_processes=False,
                              stop_if_all_fail=True)
    if data.task == "chain":
        return RewardComputer(chains.chain_reward, num_workers=1, use_processes=False,
                              stop_if_all_fail=True)
    return RewardComputer(math_reward, num_workers=reward.workers, timeout_s=reward.timeout_s,
                          stop_if_all_fail=True)


def model_config_for(model: ModelSettings) -> ModelConfig:
    """The run's model configuration, read from `model.path`'s config.json or built for
    `model.tiny`; reads no weights and writes nothing."""
    if model.source == "hf":
        with open(os.path.join(model.path, "config.json"), encoding="utf-8") as f:
            config = config_from_hf(json.load(f)).replace(dtype=model.dtype)
    elif model.source == "gguf":
        config = config_from_gguf(model.path).replace(dtype=model.dtype)
    else:
        config = tiny_model_config(model)
    return config.replace(attention=model.attention)


def _file_version(path: str) -> tuple[int, int] | None:
    """(size, mtime in ns) of a local file; None for a URL or a missing file."""
    if "://" in path:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _read_version(path: str, keys: tuple[str, str] | None, version: tuple[int, int]
                  ) -> tuple[list[MathExample], Any]:
    del version  # part of the cache key only: a changed file is read again
    return load_math_file(path, keys=keys)


def _read_math_file(path: str, keys: tuple[str, str] | None) -> tuple[list[MathExample], Any]:
    """`load_math_file`, remembered for the latest few unchanged local files: the up-front data
    check (`check_task_data`) and the task then read a large file once, not twice."""
    version = _file_version(path)
    if version is None:
        return load_math_file(path, keys=keys)
    examples, stats = _read_version(path, keys, version)
    return list(examples), stats


def _load_examples(path: str, field: str, data: DataSettings, log: bool = True
                   ) -> list[MathExample]:
    """The examples of one math data file (rows read through `data.prompt_key` / `answer_key`
    when set); `DataError` naming the file and `config.<field>` when it cannot be read or holds
    no usable row (before any line is logged)."""
    keys = (data.prompt_key, data.answer_key) if data.prompt_key else None
    try:
        examples, stats = _read_math_file(path, keys)
    except (OSError, ValueError) as e:
        raise DataError(f"config.{field}: {path}: {e}") from e
    if not examples:
        reasons = ", ".join(f"{reason}: {count}" for reason, count in stats.skipped.items())
        raise DataError(f"config.{field}: {path}: no usable row among {stats.total_rows}"
                        + (f" (skipped: {reasons})" if reasons else ""))
    if log:
        logging.info("loaded %s: %s", path, stats)
    return examples


def task_examples(s: RunSettings, log: bool = True
                  ) -> tuple[list[MathExample], dict[str, list[MathExample]], str]:
    """(training examples, evaluation sets by name, prompt template) of the run's task: the
    synthetic task's splits, or `s.data.train_files` read through `data.prompt_key` /
    `answer_key` with `data.prompt_suffix` after each problem, with `s.eval.files`; `DataError`
    naming the field and file of one that cannot be read or holds no usable row."""
    data = s.data
    eval_sets: dict[str, list[MathExample]] = {}
    if data.task == "arithmetic":
        train, held_out = arith.arithmetic_splits(ARITH_TRAIN_SIZE, ARITH_EVAL_SIZE,
                                                  seed=data.split_seed_of(s.seed),
                                                  config=data.arithmetic)
        eval_sets["arith"] = held_out
        template = arith.ARITHMETIC_TEMPLATE
    elif data.task == "chain":
        train, held_out = chains.chain_splits(CHAIN_TRAIN_SIZE, CHAIN_EVAL_SIZE,
                                              seed=data.split_seed_of(s.seed), config=data.chain)
        eval_sets["chain"] = held_out
        eval_sets["chain_carry10"] = chains.carry10_subset(held_out)
        template = chains.CHAIN_TEMPLATE
    else:
        train = []
        for path in data.train_files:
            train.extend(_load_examples(path, "data.train_files", data, log))
        template = "{problem}" + data.prompt_suffix
    for path in s.eval.files:
        name = os.path.splitext(paths.basename(path))[0]
        eval_sets[name] = _load_examples(path, "eval.files", data, log)
    return train, eval_sets, template


def task_tokenizer(model: ModelSettings) -> Any:
    """The run's tokenizer, without its weights: `model.path`'s, or the tiny model's character
    tokenizer (the one its warm start saves)."""
    if model.source == "gguf":
        return load_gguf_tokenizer(model.path)
    return load_tokenizer(model.path) if model.source == "hf" else build_char_tokenizer()


def build_model_and_task(s: RunSettings, workdir: str,
                         reward_fn: Callable[..., Any] | None = None
                         ) -> tuple[ModelConfig, Any, Task]:
    """(model config, initial float32 params, task) of a validated run's settings: `s.model`,
    the task of `s.data` with `s.eval.files`, the verifier of `s.reward` (or the reward function
    `reward_fn`), the warm start of `s.sft` (tiny model, cached under `workdir`), all seeded with
    `s.seed`."""
    train, eval_sets, template = task_examples(s)
    data, model = s.data, s.model
    if model.source != "tiny":
        logging.info("loading the model's weights and tokenizer from %s", model.path)
    if model.source == "hf":
        model_config, params = load_hf(model.path)
        model_config = model_config.replace(dtype=model.dtype)
        tokenizer = load_tokenizer(model.path)
    elif model.source == "gguf":
        model_config, params = load_gguf(model.path)
        model_config = model_config.replace(dtype=model.dtype)
        tokenizer = load_gguf_tokenizer(model.path)
    else:
        model_config, params, tokenizer = tiny_policy(model, data, s.sft, seed=s.seed,
                                                      workdir=workdir, train=train)
    model_config = model_config.replace(attention=model.attention)
    reward, answer_of = _reward_computer(data, s.reward, reward_fn)
    task = Task(tokenizer, train, eval_sets, reward=reward,
                template=template, chat=data.chat_template,
                prompts_per_step=data.prompts_per_step, max_prompt_len=data.max_prompt_len,
                seed=s.seed, format_weight=s.reward.format_weight, answer_of=answer_of)
    return model_config, params, task


@functools.lru_cache(maxsize=4)
def check_task_data(s: RunSettings) -> None:
    """Reads the run's data as the task will and checks it (files exist, parse and hold usable
    rows; some training prompt fits data.max_prompt_len; every evaluation prompt fits it, as the
    sampler requires), with the run's tokenizer and prompt template and without its weights, the
    warm start or the verifier; `python -m qurl_jax.main` runs it before the workdir is created,
    the trainer before its checkpoints); logs nothing and
    writes nothing; `DataError` (one line naming the field and file) on the first failure. A
    passed check is remembered for the process (`main` and then the trainer ask for the same)."""
    train, eval_sets, template = task_examples(s, log=False)
    tokenizer = task_tokenizer(s.model)
    max_len = s.data.max_prompt_len

    def encode(problem: str) -> list[int]:
        text = prompt_text(problem, tokenizer, template=template, chat=s.data.chat_template)
        return list(tokenizer.encode(text, add_special_tokens=False))

    fitting_prompts(train, encode, max_len)
    for name, examples in eval_sets.items():
        if s.eval.max_examples:
            examples = examples[: s.eval.max_examples]
        lengths = [len(encode(ex.problem)) for ex in examples]
        long = [n for n in lengths if n > max_len]
        if long:
            files = {os.path.splitext(paths.basename(p))[0] for p in s.eval.files}
            field = "eval.files" if name in files else "data.task"
            raise DataError(
                f"config.{field}: {len(long)} of the {len(lengths)} prompts of evaluation set "
                f"{name!r} are longer than data.max_prompt_len={max_len} (the longest has "
                f"{max(long)} tokens), and the sampler takes none longer; raise "
                "data.max_prompt_len or limit eval.max_examples")
