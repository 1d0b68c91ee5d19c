"""The reasoning-chain task: problems, the correct and the buggy teacher's chains, the verifier."""

import numpy as np
import pytest

from qurl_jax.data import chains


def test_solve_writes_every_step_and_the_answer():
    reply, answer = chains.solve("47+3-8+6=")
    assert reply == "47+3=50;50-8=42;42+6=48;answer:48"
    assert answer == 48


def test_teacher_forgets_the_carry_of_a_units_sum_of_ten_and_continues_from_it():
    rng = np.random.default_rng(0)
    reply, answer = chains.teacher_reply("47+3-8=", bug_rate=1.0, rng=rng)
    assert reply == "47+3=40;40-8=32;answer:32"
    # 47+2 carries nothing; 49+1 is the sub-case again.
    assert chains.teacher_reply("47+2+1=", 1.0, rng)[0] == "47+2=49;49+1=40;answer:40"
    assert chains.teacher_reply("41+9=", 1.0, rng)[1] == 40
    assert chains.teacher_reply("41+8=", 1.0, rng)[1] == 49


def test_is_carry10_follows_the_correct_chain():
    assert chains.is_carry10("47+3=")
    assert not chains.is_carry10("47+2=")
    assert chains.is_carry10("40+5+5=")  # 45 + 5
    assert not chains.is_carry10("43-3+9=")  # subtraction never counts; 40+9 has units sum 9


def test_splits_are_disjoint_with_the_requested_share_of_the_sub_case():
    cfg = chains.ChainConfig(carry10_share=0.5)
    train, held_out = chains.chain_splits(600, 200, seed=1, config=cfg)
    problems = [ex.problem for ex in train + held_out]
    assert len(set(problems)) == 800
    share = np.mean([chains.is_carry10(p) for p in problems])
    assert 0.5 <= share <= 0.75  # forced half plus the unconstrained draws that have one anyway
    for ex in held_out[:50]:
        start, steps = chains.parse_problem(ex.problem)
        assert cfg.min_steps <= len(steps) <= cfg.max_steps
        assert ex.answer == str(start + sum(steps))
        assert 40 <= len(chains.solve(ex.problem)[0]) <= 120


def test_reward_reads_only_the_final_answer():
    assert chains.chain_reward("1+1=3;answer:48", "48") == 1.0  # a wrong step is not penalised
    assert chains.chain_reward("answer:47;answer:48", ["48"]) == 1.0
    assert chains.chain_reward("47+3=50;answer:50.", "50") == 1.0  # digits only after answer:
    assert chains.chain_reward("47+3=50;50", "50") == 0.0
    assert chains.chain_reward("answer:-2", "2") == 0.0


def test_bad_config_and_problem_name_the_field():
    with pytest.raises(ValueError, match="carry10_share"):
        chains.ChainConfig(carry10_share=2.0).validate()
    with pytest.raises(ValueError, match="not a chain problem"):
        chains.parse_problem("12*3=")
