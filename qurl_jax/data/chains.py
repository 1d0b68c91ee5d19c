"""The reasoning-chain task: running sums written step by step, verified on the final answer only.

A problem is a start value and a list of one-digit steps, "47+3-8+6=". The reply works through it
one step per clause and ends with the answer:

    47+3=50;50-8=42;42+6=48;answer:48

and only the number after the last "answer:" is checked (`chain_reward`). Replies are 40-120
characters (one token per character with the embedded tokenizer), long enough that a 64-token KV
budget evicts part of the history.

The warm start imitates a *buggy teacher* (`teacher_reply`): with probability `bug_rate` it forgets
the carry of an addition whose units digits sum to exactly ten ("47+3=40" instead of "47+3=50"),
and continues the chain from its wrong total. Nothing in its replies marks the slip, so a model that
imitates it inherits the error, greedy decoding included; only the verifier's reward on the final
answer can teach the carry. `is_carry10(problem)` tells whether a problem contains such a step (the
"sub-case", evaluated separately); `ChainConfig.carry10_share` sets how many problems do.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import numpy as np

from qurl_jax.data.datasets import MathExample

CHAIN_SOURCE = "chain"
_STEP = re.compile(r"([+-])(\d)")
_ANSWER = re.compile(r"answer:(-?\d+)")


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """Shape of the problems.

    Attributes:
      min_steps / max_steps: one-digit steps per problem (>= 1).
      start_min / start_max: range of the start value (two digits by default).
      max_total: every running total stays in [0, max_total].
      carry10_share: share of problems drawn to contain at least one carry-10 step (an addition
        whose units digits sum to exactly ten); the rest are drawn without constraint.
    """

    min_steps: int = 5
    max_steps: int = 8
    start_min: int = 10
    start_max: int = 99
    max_total: int = 199
    carry10_share: float = 0.5

    def validate(self) -> ChainConfig:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"ChainConfig: need 1 <= min_steps ({self.min_steps}) <= max_steps "
                             f"({self.max_steps})")
        if not 0 <= self.start_min <= self.start_max <= self.max_total:
            raise ValueError(f"ChainConfig: need 0 <= start_min ({self.start_min}) <= start_max "
                             f"({self.start_max}) <= max_total ({self.max_total})")
        if not 0.0 <= self.carry10_share <= 1.0:
            raise ValueError(f"ChainConfig.carry10_share={self.carry10_share} must be in [0, 1]")
        return self


def parse_problem(problem: str) -> tuple[int, list[int]]:
    """(start, signed steps) of "47+3-8=". Raises ValueError on anything else."""
    m = re.fullmatch(r"(\d+)((?:[+-]\d)+)=", problem)
    if m is None:
        raise ValueError(f"not a chain problem: {problem!r}")
    steps = [int(d) if op == "+" else -int(d) for op, d in _STEP.findall(m.group(2))]
    return int(m.group(1)), steps


def _is_carry10_step(total: int, step: int) -> bool:
    return step > 0 and total % 10 + step == 10


def is_carry10(problem: str) -> bool:
    """Whether the correct chain of `problem` has an addition whose units digits sum to ten."""
    total, steps = parse_problem(problem)
    for s in steps:
        if _is_carry10_step(total, s):
            return True
        total += s
    return False


def _clause(total: int, step: int, result: int) -> str:
    return f"{total}{'+' if step > 0 else '-'}{abs(step)}={result};"


def solve(problem: str) -> tuple[str, int]:
    """(correct reply without EOS, final answer)."""
    return teacher_reply(problem, bug_rate=0.0, rng=np.random.default_rng(0))


def teacher_reply(problem: str, bug_rate: float, rng: np.random.Generator) -> tuple[str, int]:
    """The buggy teacher's reply and its final answer: each carry-10 addition it meets (in its own,
    possibly already wrong, chain) comes out ten too small with probability `bug_rate`."""
    total, steps = parse_problem(problem)
    clauses = []
    for s in steps:
        result = total + s
        if _is_carry10_step(total, s) and rng.random() < bug_rate:
            result -= 10
        clauses.append(_clause(total, s, result))
        total = result
    return "".join(clauses) + f"answer:{total}", total


def _draw(rng: np.random.Generator, cfg: ChainConfig, want_carry10: bool) -> str:
    while True:
        total = int(rng.integers(cfg.start_min, cfg.start_max + 1))
        start, steps, ok = total, [], True
        for _ in range(int(rng.integers(cfg.min_steps, cfg.max_steps + 1))):
            s = int(rng.integers(1, 10)) * (1 if rng.random() < 0.5 else -1)
            if not 0 <= total + s <= cfg.max_total:
                s = -s
            if not 0 <= total + s <= cfg.max_total:
                ok = False
                break
            steps.append(s)
            total += s
        if not ok:
            continue
        problem = str(start) + "".join(f"{'+' if s > 0 else '-'}{abs(s)}" for s in steps) + "="
        if not want_carry10 or is_carry10(problem):
            return problem


def chain_splits(num_train: int, num_eval: int, seed: int = 0,
                 config: ChainConfig | None = None) -> tuple[list[MathExample], list[MathExample]]:
    """Disjoint train and evaluation sets of distinct problems; answers are the correct totals."""
    cfg = (config or ChainConfig()).validate()
    rng = np.random.default_rng(seed)
    seen: dict[str, str] = {}
    wanted = num_train + num_eval
    for _ in range(50 * wanted):
        if len(seen) == wanted:
            break
        problem = _draw(rng, cfg, want_carry10=rng.random() < cfg.carry10_share)
        seen.setdefault(problem, str(solve(problem)[1]))
    if len(seen) < wanted:
        raise ValueError(f"chain_splits: only {len(seen)} distinct problems for {wanted}; widen "
                         "ChainConfig")
    items = list(seen.items())
    make = lambda rows: [MathExample(p, a, CHAIN_SOURCE, i)  # noqa: E731
                         for i, (p, a) in enumerate(rows)]
    return make(items[:num_train]), make(items[num_train:])


def teacher_pairs(examples: Sequence[MathExample], prompt_fn, bug_rate: float, seed: int,
                  eos: str) -> list[tuple[str, str]]:
    """(prompt, reply + eos) pairs of the buggy teacher for the supervised warm start."""
    rng = np.random.default_rng(seed)
    return [(prompt_fn(ex.problem), teacher_reply(ex.problem, bug_rate, rng)[0] + eos)
            for ex in examples]


def final_answer(response: str) -> str | None:
    """The number after the last "answer:", or None."""
    found = _ANSWER.findall(response)
    return found[-1] if found else None


def chain_reward(response: str, answer: str | Sequence[str]) -> float:
    """1.0 when the final answer equals the reference; the steps are not checked."""
    golds = [answer] if isinstance(answer, str) else list(answer)
    predicted = final_answer(response)
    return 1.0 if predicted is not None and any(predicted == g.strip() for g in golds) else 0.0
