"""Checkpointer: round trip, keep-N, and fallback past a corrupt latest checkpoint."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.checkpoint import Checkpointer


def _state(v: float):
    return {"params": {"w": jnp.full((4, 3), v)}, "step_count": jnp.asarray(int(v))}


def test_round_trip_and_keep(tmp_path):
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step, "data": {"position": step * 10}})
    assert ckpt.steps() == [2, 3]
    step, state, meta = ckpt.restore_latest(_state(0.0))
    assert step == 3 and meta["data"]["position"] == 30
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 3.0))
    ckpt.close()


def test_corrupt_latest_falls_back_to_previous(tmp_path):
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=3)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.save(2, _state(2), {"step": 2})
    ckpt.close()
    # Corrupt step 2: remove every array file of its state item.
    state_dir = os.path.join(str(tmp_path), "2", "state")
    removed = 0
    for root, _, files in os.walk(state_dir):
        for f in files:
            os.remove(os.path.join(root, f))
            removed += 1
    assert removed
    reopened = Checkpointer(str(tmp_path), interval=1, keep=3)
    step, state, meta = reopened.restore_latest(_state(0.0))
    assert step == 1 and meta["step"] == 1
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 1.0))


def test_empty_directory_and_bad_settings(tmp_path):
    assert Checkpointer(str(tmp_path / "none")).restore_latest(_state(0.0)) is None
    with pytest.raises(ValueError, match="interval"):
        Checkpointer(str(tmp_path), interval=0)
