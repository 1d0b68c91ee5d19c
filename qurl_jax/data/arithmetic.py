"""The synthetic arithmetic task of the embedded default: "12+7=" -> "19", scored by exact match.

Problems are `a op b [op c ...]=` with operands of `min_digits..max_digits` digits and operators
from `+ - *` (usual precedence, `*` first); the answer is the exact integer result in decimal. The
model is meant to reply with just the answer followed by end-of-sequence: the shortest reply a tiny
character-level model can learn, and one that `exact_match_reward` checks as is. Generation is
seeded and `arithmetic_splits` returns disjoint train and evaluation sets. `sft_pairs` gives the
(prompt, completion) strings of the supervised warm start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from qurl_jax.data.datasets import MathExample, build_prompt

# The prompt is the bare problem; no instruction text for a model that only knows arithmetic.
ARITHMETIC_TEMPLATE = "{problem}"
ARITHMETIC_SOURCE = "arith"
OPERATORS = ("+", "-", "*")


@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Difficulty knobs of the arithmetic task.

    Attributes:
      min_digits: fewest digits of an operand (>= 1; 1-digit operands include 0).
      max_digits: most digits of an operand (>= min_digits).
      operators: operators to draw from, a subset of "+", "-", "*".
      num_operands: operands per problem (>= 2).
      allow_negative: when False, problems whose result is negative are redrawn.
    """

    min_digits: int = 1
    max_digits: int = 2
    operators: tuple[str, ...] = ("+", "-")
    num_operands: int = 2
    allow_negative: bool = False

    def validate(self) -> None:
        """Raises ValueError naming the first bad field."""
        if self.min_digits < 1:
            raise ValueError(f"ArithmeticConfig.min_digits must be >= 1, got {self.min_digits}")
        if self.max_digits < self.min_digits:
            raise ValueError(
                f"ArithmeticConfig.max_digits ({self.max_digits}) < min_digits ({self.min_digits})"
            )
        if not self.operators or any(op not in OPERATORS for op in self.operators):
            raise ValueError(
                f"ArithmeticConfig.operators must be a non-empty subset of {OPERATORS}, "
                f"got {self.operators}"
            )
        if self.num_operands < 2:
            raise ValueError(
                f"ArithmeticConfig.num_operands must be >= 2, got {self.num_operands}"
            )


def evaluate_expression(operands: Sequence[int], operators: Sequence[str]) -> int:
    """Integer value of operands[0] op[0] operands[1] ... with `*` binding tighter than `+ -`."""
    if len(operators) != len(operands) - 1:
        raise ValueError(
            f"evaluate_expression: {len(operands)} operands need {len(operands) - 1} operators, "
            f"got {len(operators)}"
        )
    # Fold products into terms, then add the signed terms.
    terms = [operands[0]]
    signs = [1]
    for op, value in zip(operators, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def _draw_operand(rng: np.random.Generator, config: ArithmeticConfig) -> int:
    digits = int(rng.integers(config.min_digits, config.max_digits + 1))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(low, 10**digits))


def _draw_problem(rng: np.random.Generator, config: ArithmeticConfig) -> tuple[str, str]:
    while True:
        operands = [_draw_operand(rng, config) for _ in range(config.num_operands)]
        ops = [str(rng.choice(config.operators)) for _ in range(config.num_operands - 1)]
        value = evaluate_expression(operands, ops)
        if value >= 0 or config.allow_negative:
            break
    text = str(operands[0]) + "".join(op + str(x) for op, x in zip(ops, operands[1:], strict=True))
    return text + "=", str(value)


def generate_arithmetic(
    num_examples: int, seed: int = 0, config: ArithmeticConfig | None = None
) -> list[MathExample]:
    """`num_examples` problems (repeats possible) drawn from `np.random.default_rng(seed)`.

    Returns:
      Examples with problem "a+b=", answer the decimal result, source "arith", index 0..N-1.
    """
    config = config or ArithmeticConfig()
    config.validate()
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(num_examples):
        problem, answer = _draw_problem(rng, config)
        examples.append(MathExample(problem, answer, ARITHMETIC_SOURCE, i))
    return examples


def arithmetic_splits(
    num_train: int,
    num_eval: int,
    seed: int = 0,
    config: ArithmeticConfig | None = None,
    max_draws_per_example: int = 50,
) -> tuple[list[MathExample], list[MathExample]]:
    """Train and evaluation sets of distinct problems (no problem appears twice or in both).

    Raises:
      ValueError: the configuration has too few distinct problems for num_train + num_eval.
    """
    config = config or ArithmeticConfig()
    config.validate()
    rng = np.random.default_rng(seed)
    wanted = num_train + num_eval
    seen: dict[str, str] = {}
    draws = 0
    while len(seen) < wanted:
        draws += 1
        if draws > max_draws_per_example * max(wanted, 1):
            raise ValueError(
                f"arithmetic_splits: found only {len(seen)} distinct problems for "
                f"num_train + num_eval = {wanted}; widen ArithmeticConfig (digits, operators)"
            )
        problem, answer = _draw_problem(rng, config)
        seen.setdefault(problem, answer)
    items = list(seen.items())
    train = [MathExample(p, a, ARITHMETIC_SOURCE, i) for i, (p, a) in enumerate(items[:num_train])]
    evaluation = [
        MathExample(p, a, ARITHMETIC_SOURCE, i) for i, (p, a) in enumerate(items[num_train:])
    ]
    return train, evaluation


def arithmetic_prompt(problem: str, tokenizer: Any = None, chat: bool = True) -> str:
    """The prompt of one arithmetic problem (`build_prompt` with `ARITHMETIC_TEMPLATE`)."""
    return build_prompt(problem, tokenizer, chat=chat, template=ARITHMETIC_TEMPLATE)


def sft_pairs(
    examples: Sequence[MathExample], tokenizer: Any = None, chat: bool = True
) -> list[tuple[str, str]]:
    """(prompt, completion) strings for the supervised warm start.

    The completion is the answer followed by the tokenizer's end-of-sequence token (if any), so a
    model trained on it stops right after the number. Encode both without adding special tokens;
    the loss covers the completion tokens only.
    """
    eos = getattr(tokenizer, "eos_token", None) or ""
    return [(arithmetic_prompt(ex.problem, tokenizer, chat), ex.answer + eos) for ex in examples]
