"""The reasoning-chain task: a repeated one-digit step worked out clause by clause, verified on the
final answer only.

A problem is a start value, a signed one-digit step and a count, "47+3*6=" (add 3 six times; the
usual precedence gives the same value, 65). The reply works through it one step per clause, each
clause headed by the number of steps still to do, and ends with the answer:

    6:47+3=50;5:50+3=53;4:53+3=56;3:56+3=59;2:59+3=62;1:62+3=65;answer:65

and only the number after the last "answer:" is checked (`chain_reward`). Every clause needs only
the clause before it (the countdown, the running total, the step), which a two-layer character
model learns within minutes on a CPU; problems that list different steps ("47+3-8+6=") make it
find the i-th step of the prompt, which the same model did not learn in that time. Replies are
about 60-110 characters (one token per character with the embedded tokenizer), so a 64-token KV
budget evicts part of the history of every reply.

The warm start imitates a *buggy teacher* (`teacher_reply`): with probability `bug_rate` it forgets
the carry of an addition whose units digits sum to exactly ten ("47+3=40" instead of "47+3=50"),
and continues the chain from its wrong total. Nothing in its replies marks the slip, so a model that
imitates it inherits the error, greedy decoding included; only the verifier's reward on the final
answer can teach the carry. `is_carry10(problem)` tells whether a problem contains such a step (the
"sub-case", evaluated separately); `ChainConfig.carry10_share` sets how many problems do.
Subtraction chains never contain one: the teacher is right on them (borrows included).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from qurl_jax.data.datasets import MathExample

CHAIN_SOURCE = "chain"
# The prompt is the bare problem, as for the arithmetic task.
CHAIN_TEMPLATE = "{problem}"
_PROBLEM = re.compile(r"(\d+)([+-])([1-9])\*([1-9])=")
_ANSWER = re.compile(r"answer:(-?\d+)")


@dataclasses.dataclass(frozen=True)
class ChainConfig:
    """Shape of the problems.

    Attributes:
      min_steps / max_steps: how many times the step is applied, in [1, 9] (one countdown digit).
      start_min / start_max: range of the start value.
      max_total: every running total stays in [0, max_total].
      carry10_share: share of problems drawn to contain at least one carry-10 step (an addition
        whose units digits sum to exactly ten); the rest are drawn without constraint.
    """

    min_steps: int = 5
    max_steps: int = 8
    start_min: int = 10
    start_max: int = 199
    max_total: int = 299
    carry10_share: float = 0.5

    def validate(self, prefix: str = "ChainConfig.") -> ChainConfig:
        """Returns self; raises ValueError naming the first bad field, as `prefix` + its name
        (the run config passes "config.data.chain_")."""
        if not 1 <= self.min_steps <= self.max_steps <= 9:
            raise ValueError(f"need 1 <= {prefix}min_steps={self.min_steps} <= {prefix}max_steps="
                             f"{self.max_steps} <= 9")
        if not 0 <= self.start_min <= self.start_max <= self.max_total - 9 * self.max_steps:
            raise ValueError(f"need 0 <= {prefix}start_min={self.start_min} <= {prefix}start_max="
                             f"{self.start_max} <= {prefix}max_total={self.max_total} - 9 * "
                             f"{prefix}max_steps")
        if not 0.0 <= self.carry10_share <= 1.0:
            raise ValueError(f"{prefix}carry10_share={self.carry10_share} must be in [0, 1]")
        return self


def format_problem(start: int, step: int, count: int) -> str:
    """ "47+3*6=" for start 47, step +3, count 6."""
    return f"{start}{'+' if step > 0 else '-'}{abs(step)}*{count}="


def parse_problem(problem: str) -> tuple[int, list[int]]:
    """(start, signed steps) of "47+3*6=" (six steps of +3). Raises ValueError on anything else."""
    m = _PROBLEM.fullmatch(problem)
    if m is None:
        raise ValueError(f"not a chain problem: {problem!r}")
    step = int(m.group(3)) * (1 if m.group(2) == "+" else -1)
    return int(m.group(1)), [step] * int(m.group(4))


def _is_carry10_step(total: int, step: int) -> bool:
    return step > 0 and total % 10 + step == 10


def carry10_count(problem: str) -> int:
    """How many additions of the correct chain of `problem` have units digits summing to ten."""
    total, steps = parse_problem(problem)
    count = 0
    for s in steps:
        count += _is_carry10_step(total, s)
        total += s
    return count


def is_carry10(problem: str) -> bool:
    """Whether the correct chain of `problem` has an addition whose units digits sum to ten."""
    return carry10_count(problem) > 0


def solve(problem: str) -> tuple[str, int]:
    """(correct reply without EOS, final answer)."""
    return teacher_reply(problem, bug_rate=0.0, rng=np.random.default_rng(0))


def teacher_reply(problem: str, bug_rate: float, rng: np.random.Generator) -> tuple[str, int]:
    """The buggy teacher's reply and its final answer: each carry-10 addition it meets (in its own,
    possibly already wrong, chain) comes out ten too small with probability `bug_rate`."""
    total, steps = parse_problem(problem)
    clauses = []
    for left, s in zip(range(len(steps), 0, -1), steps, strict=True):
        result = total + s
        if _is_carry10_step(total, s) and rng.random() < bug_rate:
            result -= 10
        clauses.append(f"{left}:{total}{'+' if s > 0 else '-'}{abs(s)}={result};")
        total = result
    return "".join(clauses) + f"answer:{total}", total


def _draw(rng: np.random.Generator, cfg: ChainConfig, want_carry10: bool) -> str:
    while True:
        count = int(rng.integers(cfg.min_steps, cfg.max_steps + 1))
        step = int(rng.integers(1, 10)) * (1 if want_carry10 or rng.random() < 0.5 else -1)
        start = int(rng.integers(cfg.start_min, cfg.start_max + 1))
        if start + step * count < 0:  # a subtraction below zero; additions fit by validate()
            continue
        problem = format_problem(start, step, count)
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


def carry10_subset(examples: Sequence[MathExample]) -> list[MathExample]:
    """The examples whose correct chain has a carry-10 addition (the sub-case), in order."""
    return [ex for ex in examples if is_carry10(ex.problem)]


def teacher_pairs(examples: Sequence[MathExample], prompt_fn: Callable[[str], str],
                  bug_rate: float, seed: int, eos: str) -> list[tuple[str, str]]:
    """(prompt, reply + eos) pairs of the buggy teacher for the supervised warm start; each
    example's slips are drawn once (seeded), so the pairs are a fixed data set."""
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
