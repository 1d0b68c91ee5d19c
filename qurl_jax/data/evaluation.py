"""Avg@k and Pass@k of a generator over math sets, scored with the same verifier as training.

For each problem the generator draws n >= k responses. Avg@k is the mean reward over the samples
(with n == k: the accuracy averaged over k samples); Pass@k is the unbiased estimator of the chance
that at least one of k samples is correct, 1 - C(n-c, k) / C(n, k) with c correct out of n (Chen
et al. 2021, the Codex paper). Greedy evaluation is n = k = 1 with a greedy generator. Results are
reported per data set (`MathExample.source`) and pooled over all problems ("all").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from qurl_jax.data.datasets import MathExample, build_prompt, gold_answers
from qurl_jax.data.rewards import RewardComputer, RewardFn

GenerateFn = Callable[[list[str], int], list[list[str]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased Pass@k from c correct among n samples: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k / i), which avoids huge binomials.

    Raises:
      ValueError: unless 0 <= c <= n and 1 <= k <= n (names the bad argument).
    """
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: k must be in [1, n={n}], got k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c must be in [0, n={n}], got c={c}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _default_prompt(problem: str) -> str:
    return build_prompt(problem)


def evaluate(
    generate_fn: GenerateFn,
    examples: Sequence[MathExample],
    reward_fn: RewardFn | RewardComputer,
    k: int,
    n: int | None = None,
    prompt_fn: Callable[[str], str] = _default_prompt,
    batch_size: int | None = None,
    threshold: float = 0.5,
    answer_fn: Callable[[MathExample], object] = gold_answers,
) -> dict[str, float]:
    """Generates n samples per problem, scores them and reports Avg@k and Pass@k.

    Args:
      generate_fn: `generate_fn(prompts, n)` -> for each prompt a list of n response strings.
      examples: problems; their `source` groups the results.
      reward_fn: `reward_fn(response, answer) -> float` called per sample, or a `RewardComputer`
        scoring the whole batch in parallel. The reference is `answer_fn(example)`.
      k: the k of Avg@k / Pass@k.
      n: samples per problem (>= k; default k). Avg@k averages all n samples.
      prompt_fn: problem text -> prompt string (default `build_prompt` without a tokenizer; pass
        e.g. `functools.partial(build_prompt, tokenizer=tok)`).
      batch_size: prompts per `generate_fn` call (default: all at once).
      threshold: a sample counts as correct for Pass@k when its reward is > threshold.
      answer_fn: an example's reference as `reward_fn` takes it (default `gold_answers`).

    Returns:
      Flat metrics: for each source and for "all", f"{name}/avg@{k}", f"{name}/pass@{k}" and
      f"{name}/num_examples".
    """
    n = k if n is None else n
    if k < 1 or n < k:
        raise ValueError(f"evaluate: need 1 <= k <= n, got k={k}, n={n}")
    if not examples:
        raise ValueError("evaluate: examples is empty")
    batch_size = batch_size or len(examples)
    prompts = [prompt_fn(ex.problem) for ex in examples]
    responses: list[list[str]] = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        out = generate_fn(chunk, n)
        if len(out) != len(chunk) or any(len(samples) != n for samples in out):
            raise ValueError(
                f"evaluate: generate_fn must return {len(chunk)} lists of {n} responses, got "
                f"{[len(s) for s in out]}"
            )
        responses.extend(out)

    flat_responses = [r for samples in responses for r in samples]
    flat_answers = [answer_fn(ex) for ex in examples for _ in range(n)]
    if isinstance(reward_fn, RewardComputer):
        flat_rewards = reward_fn(flat_responses, flat_answers)
    else:
        flat_rewards = [reward_fn(r, a) for r, a in zip(flat_responses, flat_answers, strict=True)]
    rewards = np.asarray(flat_rewards, dtype=np.float64).reshape(len(examples), n)

    groups: dict[str, list[int]] = defaultdict(list)
    for i, ex in enumerate(examples):
        groups[ex.source].append(i)
    groups["all"] = list(range(len(examples)))
    metrics: dict[str, float] = {}
    for name, rows in groups.items():
        group = rewards[rows]
        correct = (group > threshold).sum(axis=1)
        metrics[f"{name}/avg@{k}"] = float(group.mean())
        metrics[f"{name}/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct]))
        metrics[f"{name}/num_examples"] = float(len(rows))
    return metrics
