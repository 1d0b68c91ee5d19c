"""The reasoning-chain task: problems, the correct and the buggy teacher's chains, the verifier."""

import numpy as np
import pytest

from qurl_jax.data import chains


def test_solve_writes_every_step_with_its_countdown_and_the_answer():
    reply, answer = chains.solve("47+3*3=")
    assert reply == "3:47+3=50;2:50+3=53;1:53+3=56;answer:56"
    assert answer == 56
    assert chains.solve("12-5*2=") == ("2:12-5=7;1:7-5=2;answer:2", 2)


def test_teacher_forgets_the_carry_of_a_units_sum_of_ten_and_continues_from_it():
    rng = np.random.default_rng(0)
    reply, answer = chains.teacher_reply("47+3*2=", bug_rate=1.0, rng=rng)
    assert reply == "2:47+3=40;1:40+3=43;answer:43"
    assert answer == 43
    # 47+2 carries nothing; 49+1 is the sub-case again; subtraction never is.
    assert chains.teacher_reply("47+2*2=", 1.0, rng)[0] == "2:47+2=49;1:49+2=51;answer:51"
    assert chains.teacher_reply("48+1*2=", 1.0, rng)[0] == "2:48+1=49;1:49+1=40;answer:40"
    assert chains.teacher_reply("51-1*2=", 1.0, rng)[1] == 49
    # With bug_rate 0 the teacher is the solution; in between it slips on some carries only.
    assert chains.teacher_reply("45+5*4=", 0.0, rng)[1] == 65
    answers = {chains.teacher_reply("45+5*4=", 0.5, rng)[1] for _ in range(50)}
    assert answers == {45, 55, 65}  # 45+5 and 55+5 each slip or not


def test_is_carry10_follows_the_correct_chain():
    assert chains.is_carry10("47+3*1=")
    assert not chains.is_carry10("47+2*1=")
    assert chains.is_carry10("44+2*3=")  # 48 + 2
    assert not chains.is_carry10("44+2*1=")
    assert not chains.is_carry10("50-5*4=")  # subtraction never counts
    assert chains.carry10_count("45+5*4=") == 2  # 45+5, 55+5


@pytest.mark.parametrize("problem, parsed", [("47+3*6=", (47, [3] * 6)),
                                             ("120-9*2=", (120, [-9, -9]))])
def test_parse_and_format_round_trip(problem, parsed):
    assert chains.parse_problem(problem) == parsed
    start, steps = parsed
    assert chains.format_problem(start, steps[0], len(steps)) == problem


def test_splits_are_disjoint_with_the_requested_share_of_the_sub_case():
    cfg = chains.ChainConfig(carry10_share=0.5)
    train, held_out = chains.chain_splits(600, 200, seed=1, config=cfg)
    problems = [ex.problem for ex in train + held_out]
    assert len(set(problems)) == 800
    share = np.mean([chains.is_carry10(p) for p in problems])
    assert 0.5 <= share <= 0.75  # forced half plus the unconstrained draws that have one anyway
    assert chains.carry10_subset(held_out) == [ex for ex in held_out
                                               if chains.is_carry10(ex.problem)]
    for ex in held_out:
        start, steps = chains.parse_problem(ex.problem)
        assert cfg.min_steps <= len(steps) <= cfg.max_steps
        assert cfg.start_min <= start <= cfg.start_max
        assert ex.answer == str(start + sum(steps))
        totals = start + np.cumsum(steps)
        assert 0 <= totals.min() and totals.max() <= cfg.max_total
        assert 45 <= len(chains.solve(ex.problem)[0]) <= 110


def test_reward_reads_only_the_final_answer():
    assert chains.chain_reward("1+1=3;answer:48", "48") == 1.0  # a wrong step is not penalised
    assert chains.chain_reward("answer:47;answer:48", ["48"]) == 1.0
    assert chains.chain_reward("47+3=50;answer:50.", "50") == 1.0  # digits only after answer:
    assert chains.chain_reward("47+3=50;50", "50") == 0.0
    assert chains.chain_reward("answer:-2", "2") == 0.0
    assert chains.final_answer("1:47+3=50;answer:50") == "50"


def test_teacher_pairs_are_seeded_prompt_and_reply_with_eos():
    train, _ = chains.chain_splits(20, 0, seed=0)
    pairs = chains.teacher_pairs(train, lambda p: f"<{p}>", 1.0, seed=3, eos="$")
    assert pairs == chains.teacher_pairs(train, lambda p: f"<{p}>", 1.0, seed=3, eos="$")
    rng = np.random.default_rng(3)
    for (prompt, reply), ex in zip(pairs, train, strict=True):
        assert prompt == f"<{ex.problem}>"
        assert reply == chains.teacher_reply(ex.problem, 1.0, rng)[0] + "$"


def test_bad_config_and_problem_name_the_field():
    with pytest.raises(ValueError, match="ChainConfig.carry10_share"):
        chains.ChainConfig(carry10_share=2.0).validate()
    with pytest.raises(ValueError, match="ChainConfig.max_steps=10"):
        chains.ChainConfig(max_steps=10).validate()
    with pytest.raises(ValueError, match="x.start_max=290"):
        chains.ChainConfig(start_max=290).validate(prefix="x.")
    with pytest.raises(ValueError, match="not a chain problem"):
        chains.parse_problem("47+3-8=")
