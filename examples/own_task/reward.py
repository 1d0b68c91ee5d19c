"""A countdown-style reward for examples/own_task (`--config.reward.function=
examples/own_task/reward.py:score`).

The prompt names three digits and a target ("2 3 8 -> 19"). A response scores 1.0 when it is an
expression of exactly those digits, each once, with + - * only, that equals the target; 0.1 when
it is such an expression with another value (the format is right); 0.0 otherwise. The reference
solution in `answers` is one of possibly several right expressions, so it is not compared to.
"""

import re

_PROMPT = re.compile(r"^\s*([\d ]+?)\s*->\s*(-?\d+)\s*$")
_EXPRESSION = re.compile(r"^\d[+\-*]\d[+\-*]\d$")


def _one(response: str, prompt: str) -> float:
    match = _PROMPT.match(prompt)
    if match is None:
        raise ValueError(f"not a countdown prompt: {prompt!r}")
    digits, target = sorted(match.group(1).split()), int(match.group(2))
    expression = response.strip()
    if not _EXPRESSION.match(expression) or sorted(re.findall(r"\d", expression)) != digits:
        return 0.0
    return 1.0 if eval(expression) == target else 0.1  # digits and + - * only: safe


def score(responses: list[str], answers: list[str], prompts: list[str]) -> list[float]:
    """One reward per response (the `prompts` parameter asks the trainer for the prompts)."""
    return [_one(r, p) for r, p in zip(responses, prompts, strict=True)]
