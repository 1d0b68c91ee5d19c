"""A checkpoint that fails to restore is moved aside (never deleted) before the fallback, so the
run saves that step afresh and later restarts restore it instead of falling back again."""

import os

import jax.numpy as jnp
import numpy as np

from qurl_jax.runtime.checkpoint import CORRUPT_DIR, Checkpointer


def _state(v: float):
    return {"params": {"w": jnp.full((64, 32), float(v))}}


def _truncate_largest_file(directory: str) -> str:
    files = [os.path.join(root, f) for root, _, names in os.walk(directory) for f in names]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        f.truncate(os.path.getsize(largest) // 2)
    return largest


def test_truncated_checkpoint_is_moved_aside_and_saved_again(tmp_path):
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=3)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.save(2, _state(2), {"step": 2})
    ckpt.close()
    truncated = _truncate_largest_file(os.path.join(str(tmp_path), "2", "state"))
    size = os.path.getsize(truncated)

    reopened = Checkpointer(str(tmp_path), interval=1, keep=3)
    reopened.check_compatible(_state(0.0))  # reads metadata only: moves nothing
    assert reopened.steps() == [1, 2]
    step, state, _ = reopened.restore_latest(_state(0.0))
    assert step == 1
    np.testing.assert_array_equal(state["params"]["w"], np.full((64, 32), 1.0))
    # Step 2 is out of the step list, kept byte for byte under corrupt/<step>-<time>.
    assert reopened.steps() == [1]
    aside = os.listdir(os.path.join(str(tmp_path), CORRUPT_DIR))
    assert len(aside) == 1 and aside[0].startswith("2-")
    moved = os.path.join(str(tmp_path), CORRUPT_DIR, aside[0],
                         os.path.relpath(truncated, os.path.join(str(tmp_path), "2")))
    assert os.path.getsize(moved) == size

    # The redone step 2 is saved again, and the next restart restores it.
    assert reopened.save(2, _state(2.5), {"step": 2}, force=True)
    reopened.close()
    again = Checkpointer(str(tmp_path), interval=1, keep=3)
    step, state, _ = again.restore_latest(_state(0.0))
    assert step == 2
    np.testing.assert_array_equal(state["params"]["w"], np.full((64, 32), 2.5))
    again.close()
