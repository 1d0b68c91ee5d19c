"""Checkpointer: round trip, keep-N, fallback past a corrupt latest checkpoint, a hard stop on a
checkpoint of another shape or structure, and restoring onto another mesh."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from qurl_jax.parallel.sharding import make_mesh
from qurl_jax.runtime import checkpoint as checkpoint_lib
from qurl_jax.runtime import sizes
from qurl_jax.runtime.checkpoint import Checkpointer, CheckpointMismatchError


def _state(v: float):
    return {"params": {"w": jnp.full((4, 3), float(v))}, "step_count": jnp.asarray(int(v))}


def test_round_trip_and_keep(tmp_path):
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=2)
    for step in (1, 2, 3):
        ckpt.save(step, _state(step), {"step": step, "data": {"position": step * 10}})
    assert ckpt.steps() == [2, 3]
    step, state, meta = ckpt.restore_latest(_state(0.0))
    assert step == 3 and meta["data"]["position"] == 30
    np.testing.assert_array_equal(state["params"]["w"], np.full((4, 3), 3.0))
    ckpt.close()


def test_space_check_refuses_no_room_and_warns_short_of_keep(tmp_path, monkeypatch):
    """Before anything is written: no room for one checkpoint stops the run (one line naming the
    directory); room for fewer than keep + 1 (less those already saved) warns; URLs pass."""
    one = sizes.tree_bytes(_state(0.0))
    assert one == 4 * 3 * 4 + 4  # float32 [4, 3] and an int32 scalar
    free = {"bytes": 0}
    monkeypatch.setattr(checkpoint_lib.shutil, "disk_usage",
                        lambda path: type("Usage", (), {"free": free["bytes"]})())
    ckpt = Checkpointer(str(tmp_path / "ckpt"), interval=1, keep=2)
    free["bytes"] = one - 1
    with pytest.raises(checkpoint_lib.CheckpointSpaceError, match=f"^{tmp_path}/ckpt: 0.00 GiB "
                       "free, one checkpoint of this run is"):
        ckpt.check_space(_state(0.0))
    free["bytes"] = 2 * one  # room for two of the three (keep 2 + the one written first)
    assert "train.keep_checkpoints=2" in ckpt.check_space(_state(0.0))
    free["bytes"] = 3 * one
    assert ckpt.check_space(_state(0.0)) is None
    free["bytes"] = 2 * one
    ckpt.save(1, _state(1), {"step": 1})  # one already there: two more at most
    assert ckpt.check_space(_state(0.0)) is None
    ckpt.close()
    assert checkpoint_lib.free_bytes("gs://bucket/run") is None


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


def _files(directory: str) -> dict[str, int]:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns
            for d, _, files in os.walk(directory) for f in files}


@pytest.mark.parametrize("template, message", [
    ({"params": {"w": jnp.zeros((4, 5))}, "step_count": jnp.asarray(0)},
     r"tensor 'params\.w' has shape \(4, 3\) in the checkpoint but \(4, 5\) in this run"),
    ({"params": {"w": jnp.zeros((4, 3), jnp.bfloat16)}, "step_count": jnp.asarray(0)},
     r"tensor 'params\.w' has dtype float32 in the checkpoint but bfloat16"),
    ({"params": {"w": jnp.zeros((4, 3)), "b": jnp.zeros(3)}, "step_count": jnp.asarray(0)},
     r"tensor 'params\.b' \(3,\) of this run is not in the checkpoint"),
    ({"params": {}, "step_count": jnp.asarray(0)},
     r"tensor 'params\.w' \(4, 3\) of the checkpoint is not in this run"),
])
def test_mismatch_stops_before_anything_is_touched(tmp_path, template, message):
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=2)
    ckpt.save(1, _state(1), {"step": 1})
    ckpt.save(2, _state(2), {"step": 2})
    ckpt.close()
    before = _files(str(tmp_path))
    reopened = Checkpointer(str(tmp_path), interval=1, keep=2)
    with pytest.raises(CheckpointMismatchError, match=message):
        reopened.check_compatible(jax.eval_shape(lambda: template))
    with pytest.raises(CheckpointMismatchError, match="step 2"):
        reopened.restore_latest(template)
    assert _files(str(tmp_path)) == before and reopened.steps() == [1, 2]


def test_restore_onto_another_mesh(tmp_path):
    w = jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16)
    saved_on = NamedSharding(make_mesh(8, 1, 1), PartitionSpec("data", None))
    ckpt = Checkpointer(str(tmp_path), interval=1, keep=1)
    ckpt.save(1, {"w": jax.device_put(w, saved_on)}, {"step": 1})
    ckpt.close()
    wanted = NamedSharding(make_mesh(1, 2, 4), PartitionSpec("fsdp", "tensor"))
    template = {"w": jax.device_put(jnp.zeros_like(w), wanted)}
    step, state, _ = Checkpointer(str(tmp_path), interval=1, keep=1).restore_latest(template)
    assert step == 1 and state["w"].sharding == wanted
    np.testing.assert_array_equal(state["w"], w)


def test_orbax_event_loop_noise_is_silenced(tmp_path, caplog):
    import logging

    Checkpointer(str(tmp_path), interval=1, keep=1).close()
    with caplog.at_level(logging.ERROR):
        try:
            raise RuntimeError("Event loop is closed")
        except RuntimeError:
            logging.getLogger("asyncio").exception("Task exception was never retrieved")
        logging.getLogger("asyncio").error("a real asyncio error")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["a real asyncio error"]
