"""Avg@k / Pass@k: the unbiased estimator against hand values and a scripted generator."""

from math import comb

import pytest

from qurl_jax.data import (
    MathExample,
    RewardComputer,
    build_prompt,
    evaluate,
    exact_match_reward,
    pass_at_k,
)


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (5, 2, 1, 0.4),  # pass@1 = c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 0, 2, 0.0),
        (4, 3, 2, 1.0),  # fewer than k wrong samples: some k-subset always has a correct one
        (1, 1, 1, 1.0),
        (16, 1, 16, 1.0),
        (16, 1, 8, 0.5),  # 1 - C(15,8)/C(16,8) = 1 - 8/16
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_binomials():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - comb(n - c, k) / comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 1, 5), (4, 1, 0), (4, 5, 2), (4, -1, 2)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


EXAMPLES = [
    MathExample("1+0=", "1", "A", 0),
    MathExample("1+1=", "2", "A", 1),
    MathExample("1+2=", "3", "B", 2),
]
# Scripted samples: A/0 has 2 of 4 right, A/1 none, B/2 all four.
SAMPLES = {
    "1+0=": ["1", "0", "\\boxed{1}", "11"],
    "1+1=": ["3", "3", "", "22"],
    "1+2=": ["3", "3", "3", "\\boxed{3}"],
}


def scripted_generate(prompts, n):
    return [SAMPLES[p][:n] for p in prompts]


def _expected(k):
    # Hand computation for n = 4: avg = mean over samples, pass@k averaged over problems.
    p2 = 1 - comb(2, k) / comb(4, k)  # 2 correct of 4
    return {
        f"A/avg@{k}": 0.25,
        f"A/pass@{k}": (p2 + 0.0) / 2,
        "A/num_examples": 2.0,
        f"B/avg@{k}": 1.0,
        f"B/pass@{k}": 1.0,
        "B/num_examples": 1.0,
        f"all/avg@{k}": 0.5,
        f"all/pass@{k}": (p2 + 0.0 + 1.0) / 3,
        "all/num_examples": 3.0,
    }


@pytest.mark.parametrize("k", [1, 2, 4])
def test_evaluate_scripted(k):
    metrics = evaluate(scripted_generate, EXAMPLES, exact_match_reward, k=k, n=4,
                       prompt_fn=lambda p: p, batch_size=2)
    assert metrics == pytest.approx(_expected(k))


def test_evaluate_with_reward_computer_and_default_n():
    with RewardComputer(exact_match_reward, num_workers=2, use_processes=False) as rc:
        metrics = evaluate(scripted_generate, EXAMPLES, rc, k=4, prompt_fn=lambda p: p)
    assert metrics == pytest.approx(_expected(4))


def test_evaluate_default_prompt_and_checks():
    seen = []

    def generate(prompts, n):
        seen.extend(prompts)
        return [["\\boxed{1}"] * n for _ in prompts]

    metrics = evaluate(generate, EXAMPLES[:1], exact_match_reward, k=1)
    assert seen == [build_prompt("1+0=")]
    assert metrics["all/avg@1"] == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        evaluate(generate, EXAMPLES, exact_match_reward, k=4, n=2)
    with pytest.raises(ValueError, match="generate_fn must return"):
        evaluate(lambda prompts, n: [["1"]], EXAMPLES, exact_match_reward, k=1)
