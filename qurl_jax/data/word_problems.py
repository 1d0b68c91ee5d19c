"""One-step arithmetic word problems, and a verifier that reads the response's final number.

    python -m qurl_jax.data.word_problems --out DIR [--train N] [--test N] [--seed S]

writes DIR/train.jsonl and DIR/test.jsonl (rows {"problem", "answer"}), generated with a fixed
seed, every test problem's text absent from the training file. Each problem is one operation on
small whole numbers, told as a story: someone gets more, gives some away, buys boxes of several,
or shares equally ("Mia has 23 stickers. She gets 18 more. How many stickers does Mia have now?").
The bundled set for SmolLM2-135M-Instruct (configs/smollm2_135m_word.py) is
examples/word_problems/, made with the defaults.

`final_number_reward(responses, answers)` (a `reward.function`): 1.0 when the response's final
answer equals the reference, else 0.0. The final answer is the last `\\boxed{...}` when there is
one, else the last number written in the response (thousands commas allowed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
from collections.abc import Sequence

from qurl_jax.data.rewards import last_boxed

NAMES = ("Mia", "Tom", "Ava", "Leo", "Zoe", "Sam", "Lily", "Ben", "Emma", "Noah", "Ella", "Max",
         "Ruby", "Jack", "Nora", "Owen")
PRONOUNS = {"Mia": "She", "Ava": "She", "Zoe": "She", "Lily": "She", "Emma": "She", "Ella": "She",
            "Ruby": "She", "Nora": "She"}
ITEMS = ("apples", "stickers", "marbles", "pencils", "cookies", "books", "stamps", "shells",
         "cards", "balloons", "coins", "crayons")
CONTAINERS = ("boxes", "bags", "packs", "jars", "baskets")


def problem(rng: random.Random) -> tuple[str, int]:
    """One (problem text, whole-number answer)."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    they = PRONOUNS.get(name, "He")
    kind = rng.choice(("add", "sub", "mul", "div"))
    if kind == "add":
        a, b = rng.randint(10, 89), rng.randint(10, 89)
        return (f"{name} has {a} {item}. {they} gets {b} more. How many {item} does {name} have "
                "now?", a + b)
    if kind == "sub":
        a = rng.randint(20, 99)
        b = rng.randint(5, a - 5)
        return (f"{name} has {a} {item}. {they} gives {b} of them to a friend. How many {item} "
                f"does {name} have left?", a - b)
    if kind == "mul":
        a, b = rng.randint(2, 9), rng.randint(3, 12)
        box = rng.choice(CONTAINERS)
        return (f"{name} buys {a} {box} of {item}. Each of the {box} has {b} {item}. How many "
                f"{item} does {name} buy in all?", a * b)
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return (f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each "
            "friend get?", a)


def splits(train: int, test: int, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train rows, test rows): `test` distinct problems first, then `train` distinct problems
    none of whose texts is a test problem's."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[list[dict]] = [[], []]
    for part, count in ((1, test), (0, train)):
        while len(out[part]) < count:
            text, answer = problem(rng)
            if text in seen:
                continue
            seen.add(text)
            out[part].append({"problem": text, "answer": str(answer)})
    return out[0], out[1]


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(response: str) -> float | None:
    """The response's final answer as a number: its last \\boxed{} content's last number, else
    its last number; None when it writes none."""
    boxed = last_boxed(response)
    numbers = _NUMBER.findall(response if boxed is None else boxed)
    if not numbers:
        return None
    try:
        return float(numbers[-1].replace(",", ""))
    except ValueError:
        return None


def final_number_reward(responses: Sequence[str], answers: Sequence[str]) -> list[float]:
    """1.0 per response whose final number equals the reference answer, else 0.0."""
    out = []
    for response, answer in zip(responses, answers, strict=True):
        value = final_number(response)
        out.append(1.0 if value is not None and value == float(answer) else 0.0)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for train.jsonl and test.jsonl")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--test", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    train, test = splits(args.train, args.test, args.seed)
    for name, rows in (("train", train), ("test", test)):
        with open(os.path.join(args.out, f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
