"""Writes train.jsonl and test.jsonl of the countdown-style example (run from anywhere; seeded).

Each row: `query`, three digits and a target ("2 3 8 -> 19"), and `solution`, one expression of
the three digits with + - * that reaches it ("8*2+3"). Any other expression that reaches the
target scores as well (reward.py).
"""

import json
import os
import random


def rows(count: int, rng: random.Random) -> list[dict[str, str]]:
    out = []
    while len(out) < count:
        digits = [rng.randint(1, 9) for _ in range(3)]
        ops = [rng.choice("+-*") for _ in range(2)]
        solution = f"{digits[0]}{ops[0]}{digits[1]}{ops[1]}{digits[2]}"
        shown = sorted(digits)
        out.append({"query": f"{' '.join(map(str, shown))} -> {eval(solution)}",
                    "solution": solution})
    return out


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rng = random.Random(0)
    for name, count in (("train", 400), ("test", 64)):
        with open(os.path.join(here, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for row in rows(count, rng):
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
