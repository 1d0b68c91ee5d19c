"""Tests for qurl_jax.rl.advantages: GRPO / Dr.GRPO / RLOO values, DAPO filter and overlong penalty.

Expected numbers are worked out by hand in the comments or with plain numpy per group.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.rl import advantages as adv

REWARDS = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0], np.float32)


def test_grpo_hand_values():
    # Group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5.
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735.
    s = 0.5 / np.sqrt(1.0 / 3.0)
    expected = [1.5, -0.5, -0.5, -0.5, s, s, -s, -s]
    got = adv.grpo_advantages(REWARDS, group_size=4)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # Population std: group 0 std sqrt(0.1875) = 0.4330, group 1 std 0.5.
    got = adv.grpo_advantages(REWARDS, group_size=4, unbiased_std=False)
    q = 0.75 / np.sqrt(0.1875)
    np.testing.assert_allclose(got, [q, -q / 3, -q / 3, -q / 3, 1, 1, -1, -1], rtol=1e-5)


def test_dr_grpo_and_rloo_hand_values():
    np.testing.assert_allclose(
        adv.dr_grpo_advantages(REWARDS, group_size=4),
        [0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5],
        rtol=1e-6,
    )
    # RLOO: r_i minus the mean of the other three: group 0 -> 1 - 0, 0 - 1/3; group 1 -> 1 - 1/3.
    np.testing.assert_allclose(
        adv.rloo_advantages(REWARDS, group_size=4),
        [1.0, -1 / 3, -1 / 3, -1 / 3, 2 / 3, 2 / 3, -2 / 3, -2 / 3],
        rtol=1e-6,
    )


def test_matches_numpy_per_group_with_scattered_ids():
    rng = np.random.default_rng(0)
    rewards = rng.normal(size=12).astype(np.float32)
    ids = rng.permutation(np.repeat(np.arange(3), 4)).astype(np.int32)
    got_grpo = np.asarray(adv.grpo_advantages(rewards, ids, eps=0.0))
    got_rloo = np.asarray(adv.rloo_advantages(rewards, ids))
    for g in range(3):
        sel = ids == g
        r = rewards[sel].astype(np.float64)
        np.testing.assert_allclose(got_grpo[sel], (r - r.mean()) / r.std(ddof=1), rtol=1e-5)
        loo = np.array([np.delete(r, i).mean() for i in range(r.size)])
        np.testing.assert_allclose(got_rloo[sel], r - loo, rtol=1e-5, atol=1e-6)


def test_group_ids_and_group_size_agree():
    ids = adv.contiguous_group_ids(8, 4)
    np.testing.assert_array_equal(ids, [0, 0, 0, 0, 1, 1, 1, 1])
    for fn in (adv.grpo_advantages, adv.dr_grpo_advantages, adv.rloo_advantages):
        np.testing.assert_array_equal(fn(REWARDS, ids), fn(REWARDS, group_size=4))


def test_equal_rewards_and_singletons_give_zero():
    rewards = np.array([1.0, 1.0, 1.0, 0.3], np.float32)
    ids = np.array([0, 0, 0, 1], np.int32)  # group 1 has one member
    for fn in (adv.grpo_advantages, adv.dr_grpo_advantages, adv.rloo_advantages):
        got = np.asarray(fn(rewards, ids))
        assert np.all(np.isfinite(got))
        np.testing.assert_array_equal(got, 0.0)


def test_groups_to_keep():
    rewards = np.array([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0], np.float32)
    keep = adv.groups_to_keep(rewards, group_size=4)
    np.testing.assert_array_equal(keep, [False] * 4 + [True] * 4 + [False] * 4)
    near = np.array([0.5, 0.5001, 0.2, 0.9], np.float32)
    np.testing.assert_array_equal(adv.groups_to_keep(near, group_size=2, atol=1e-3), [0, 0, 1, 1])


def test_overlong_penalty_hand_values():
    # L_max = 20, L_c = 4: no penalty up to 16, linear to -1 at 20, -1 beyond.
    lengths = np.array([10, 16, 17, 18, 20, 25])
    np.testing.assert_allclose(
        adv.overlong_penalty(lengths, max_len=20, buffer=4), [0, 0, -0.25, -0.5, -1, -1]
    )
    np.testing.assert_allclose(
        adv.overlong_penalty(lengths, max_len=20, buffer=4, factor=0.5),
        [0, 0, -0.125, -0.25, -0.5, -0.5],
    )


def test_jit_and_vmap():
    ids = jnp.asarray(adv.contiguous_group_ids(8, 4))
    eager = adv.grpo_advantages(REWARDS, ids)
    np.testing.assert_allclose(jax.jit(adv.grpo_advantages)(REWARDS, ids), eager, rtol=1e-6)
    batched = jax.vmap(lambda r: adv.rloo_advantages(r, group_size=4))(jnp.stack([REWARDS] * 3))
    np.testing.assert_allclose(batched[2], adv.rloo_advantages(REWARDS, group_size=4))
    lengths = jnp.asarray([3, 18])
    penalty = jax.jit(lambda n: adv.overlong_penalty(n, 20, 4))(lengths)
    np.testing.assert_allclose(penalty, [0.0, -0.5])


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="group_size"):
        adv.grpo_advantages(REWARDS, group_size=3)
    with pytest.raises(ValueError, match="group_ids / group_size"):
        adv.grpo_advantages(REWARDS)
    with pytest.raises(ValueError, match="group_ids"):
        adv.grpo_advantages(REWARDS, np.zeros(7, np.int32))
    with pytest.raises(ValueError, match="group_ids: must lie"):
        adv.rloo_advantages(REWARDS, np.full(8, 8, np.int32))
    with pytest.raises(ValueError, match="group_ids: expected an integer"):
        adv.groups_to_keep(REWARDS, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="rewards"):
        adv.grpo_advantages(REWARDS[None], group_size=4)
    with pytest.raises(ValueError, match="buffer"):
        adv.overlong_penalty(np.array([3]), max_len=20, buffer=0)
    with pytest.raises(ValueError, match="lengths"):
        adv.overlong_penalty(np.array([[3]]), max_len=20, buffer=4)
