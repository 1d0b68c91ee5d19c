"""Orbax checkpoints of the RL training state: resume, fallback past a corrupt checkpoint, and a
hard stop on a checkpoint that belongs to another model or optimizer.

A checkpoint holds the learner's parameters and optimizer state (one pytree, restored with the
shardings of a template, so a resumed run lands on its own mesh even when that differs from the
mesh that saved it) and a JSON record of the step, the data iterator position and the seed. Orbax
writes each step into a temporary directory and renames it when complete, so a run killed mid-save
leaves the previous checkpoint intact.

In a multi-process run every process saves and restores together (each writes and reads the
shards its devices hold; every leaf of the state is a global array on the mesh, scalars
included), so the directory must be shared by all hosts, e.g. a gs:// bucket.

Restoring tells two failures apart:
- the checkpoint does not fit this run (another tree structure, a tensor of another shape or dtype,
  e.g. `model.tiny.intermediate_size` changed between runs): `CheckpointMismatchError`, raised
  before anything is read or written, naming the first mismatching tensor and both shapes. The
  checkpoints are left as they are: starting over would let keep-N delete them.
- the checkpoint cannot be read (truncated or deleted files): moved aside to
  `<directory>/corrupt/<step>-<UTC time>` (never deleted: it may still be salvaged) with a warning,
  and the next older one restored, so a crash never loses more than one interval and the run saves
  that step again when it gets there.
"""

from __future__ import annotations

import logging as std_logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from qurl_jax.runtime import malloc, sizes
from qurl_jax.runtime.errors import UserError

# Sub-directory of the checkpoint directory that unreadable checkpoints are moved to.
CORRUPT_DIR = "corrupt"


class CheckpointMismatchError(UserError):
    """A checkpoint's tensors do not match the run's state (structure, shape or dtype)."""

    what = "cannot resume"


class CheckpointSpaceError(UserError):
    """The checkpoint directory's file system has no room for one checkpoint of the run."""

    what = "no room for a checkpoint"


def free_bytes(directory: str) -> int | None:
    """Free bytes of the file system that holds `directory` (its nearest existing ancestor), or
    None for a URL (gs://...), whose room is not the host's to know."""
    if "://" in directory:
        return None
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def _key_name(key: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _tensors(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Dotted path ('params.layers_0.mlp.up_proj.kernel', 'opt_state.1.0.mu...') -> (shape, dtype)
    of every array leaf. Named-tuple fields and list indices are named as orbax names them in its
    metadata, so a run's template and a checkpoint's metadata compare directly. A top-level dict
    keeps its insertion order (parameters before optimizer state), so the first mismatch reported
    is a parameter's when a parameter differs.
    """
    parts = tree.items() if isinstance(tree, Mapping) else [(None, tree)]
    out = {}
    for top, subtree in parts:
        for path, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]:
            names = ([] if top is None else [str(top)]) + [_key_name(k) for k in path]
            out[".".join(names)] = (tuple(leaf.shape), np.dtype(leaf.dtype))
    return out


def _first_mismatch(saved: dict[str, tuple[tuple[int, ...], np.dtype]],
                    wanted: dict[str, tuple[tuple[int, ...], np.dtype]]) -> str | None:
    """A sentence naming the first tensor (in the run's order) that differs, or None."""
    for name, (shape, dtype) in wanted.items():
        if name not in saved:
            return f"tensor {name!r} {shape} of this run is not in the checkpoint"
        saved_shape, saved_dtype = saved[name]
        if saved_shape != shape:
            return (f"tensor {name!r} has shape {saved_shape} in the checkpoint but {shape} in "
                    "this run")
        if saved_dtype != dtype:
            return (f"tensor {name!r} has dtype {saved_dtype} in the checkpoint but {dtype} in "
                    "this run")
    extra = [name for name in saved if name not in wanted]
    if extra:
        return f"tensor {extra[0]!r} {saved[extra[0]][0]} of the checkpoint is not in this run"
    return None


class _OrbaxAsyncNoise(std_logging.Filter):
    """Drops the "Event loop is closed" tracebacks that orbax's background event loop logs after a
    failed read; the failure itself is reported by `restore_latest`."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            text += str(record.exc_info[1])
        return "Event loop is closed" not in text


def _silence_orbax_event_loop_noise() -> None:
    noise = _OrbaxAsyncNoise()
    for name in ("asyncio", "absl", "orbax", ""):
        logger = std_logging.getLogger(name)
        if not any(isinstance(f, _OrbaxAsyncNoise) for f in logger.filters):
            logger.addFilter(noise)


class Checkpointer:
    """Saves/restores `(state pytree, meta json)` every `interval` steps; keeps the last `keep`."""

    def __init__(self, directory: str, *, interval: int = 1, keep: int = 3,
                 async_save: bool = False, kinds: Mapping[str, str] | None = None) -> None:
        """`kinds`: what each top-level entry of a state is ('params': "a full fine-tune's
        parameters"), named when a checkpoint holds another kind of state than the run's."""
        if interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        _silence_orbax_event_loop_noise()
        # A URL (gs://...) is used as it is: orbax writes there through tensorstore (and gcsfs).
        self.directory = directory if "://" in directory else os.path.abspath(directory)
        self.interval = interval
        self.keep = keep
        self.kinds = dict(kinds or {})
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=interval, create=True,
            enable_async_checkpointing=async_save,
        )
        # Registering the item handlers lets `item_metadata` read shapes and dtypes without data.
        self._manager = ocp.CheckpointManager(
            self.directory, options=options,
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def check_space(self, template: Any) -> str | None:
        """Before a run writes anything: raises `CheckpointSpaceError` when the directory's file
        system cannot hold one more checkpoint of `template` (the run would train until its
        first save and fail there), and returns a warning when it cannot hold the rest the run
        will keep (`keep` saves, plus the one orbax writes before it deletes the oldest, less
        those already there), else None. Other writers may fill the disk later: this is the
        room now, not a reservation."""
        free = free_bytes(self.directory)
        if free is None:
            return None
        one = sizes.tree_bytes(template)
        gib = 1 << 30
        if free < one:
            raise CheckpointSpaceError(
                f"{self.directory}: {free / gib:.2f} GiB free, one checkpoint of this run is "
                f"{one / gib:.2f} GiB; free space there or choose another --workdir")
        more = self.keep + 1 - len(self.steps())
        if free < more * one:
            return (f"{self.directory}: {free / gib:.2f} GiB free, the run keeps up to "
                    f"{more} more checkpoints of {one / gib:.2f} GiB (train.keep_checkpoints="
                    f"{self.keep}, plus the one written before the oldest is deleted): a later "
                    f"save may fail for want of space")
        return None

    def should_save(self, step: int) -> bool:
        return self._manager.should_save(step)

    def save(self, step: int, state: Any, meta: dict[str, Any], *, force: bool = False) -> bool:
        saved = self._manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                    meta=ocp.args.JsonSave(meta)),
            force=force,
        )
        self._manager.wait_until_finished()
        malloc.trim()  # the save's freed host buffers would stay resident beside the next step
        return saved

    def _saved_tensors(self, step: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The (shape, dtype) of every tensor saved at `step`; raises when unreadable."""
        metadata = self._manager.item_metadata(step)["state"]
        if metadata is None:
            raise FileNotFoundError("no state metadata")
        tree = getattr(metadata, "tree", metadata)
        return _tensors(tree)

    def _readable_steps(self) -> Iterator[tuple[int, dict[str, tuple[tuple[int, ...], np.dtype]]]]:
        """(step, saved tensors), newest first, skipping (with a warning) unreadable metadata."""
        for step in reversed(self.steps()):
            try:
                yield step, self._saved_tensors(step)
            except Exception as e:  # noqa: BLE001 - any metadata read failure means "unreadable"
                self._warn_unreadable(step, e)

    def _warn_unreadable(self, step: int, error: Exception) -> None:
        logging.warning("checkpoint at step %d in %s is unreadable (%s: %s); falling back to the "
                        "previous one", step, self.directory, type(error).__name__,
                        str(error)[:200])

    def check_compatible(self, template: Any) -> None:
        """Raises `CheckpointMismatchError` when the newest readable checkpoint does not fit
        `template` (arrays or `jax.ShapeDtypeStruct`s); reads metadata only, writes nothing.

        Lets a run check its workdir before it writes anything (a warm-start cache, metrics).
        """
        wanted = _tensors(template)
        for step, saved in self._readable_steps():
            self._raise_on_mismatch(step, saved, wanted)
            return

    def _raise_on_mismatch(self, step: int, saved: dict, wanted: dict) -> None:
        tops = [{name.split(".", 1)[0] for name in tree} for tree in (saved, wanted)]
        kinds = [[self.kinds[t] for t in sorted(top) if t in self.kinds] for top in tops]
        if tops[0] != tops[1] and all(kinds):
            raise CheckpointMismatchError(
                f"the checkpoint at step {step} in {self.directory} holds {kinds[0][0]}, but "
                f"this run trains {kinds[1][0]}: resume it with the config it was saved with, "
                "or start in a new workdir; the checkpoints were left untouched.")
        problem = _first_mismatch(saved, wanted)
        if problem is not None:
            raise CheckpointMismatchError(
                f"the checkpoint at step {step} in {self.directory} does not match this run's "
                f"model or optimizer: {problem}. Resume with the settings it was saved with, or "
                "start in a new workdir; the checkpoints were left untouched.")

    def restore_latest(self, template: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """Restores the newest readable checkpoint into `template`'s structure and shardings.

        Returns None when there is no checkpoint. Unreadable checkpoints are skipped with a warning;
        one that does not match `template` raises `CheckpointMismatchError` (nothing restored).
        """
        wanted = _tensors(template)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        corrupt = []
        try:
            for step in reversed(self.steps()):
                try:
                    saved = self._saved_tensors(step)
                except Exception as e:  # noqa: BLE001 - unreadable metadata: corrupt
                    self._warn_unreadable(step, e)
                    corrupt.append(step)
                    continue
                self._raise_on_mismatch(step, saved, wanted)
                try:
                    restored = self._manager.restore(
                        step,
                        args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                meta=ocp.args.JsonRestore()),
                    )
                except Exception as e:  # noqa: BLE001 - it fits but cannot be read: corrupt data
                    self._warn_unreadable(step, e)
                    corrupt.append(step)
                    continue
                return step, restored["state"], dict(restored["meta"])
            return None
        finally:
            self._move_aside(corrupt)

    def restore_step(self, step: int, template: Any) -> tuple[Any, dict[str, Any]]:
        """(state, meta) of the checkpoint of `step`, restored into `template`'s structure and
        shardings (arrays or `jax.ShapeDtypeStruct`s); `CheckpointMismatchError` when it does not
        fit. Nothing falls back to another step."""
        self._raise_on_mismatch(step, self._saved_tensors(step), _tensors(template))
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                          meta=ocp.args.JsonRestore()))
        return restored["state"], dict(restored["meta"])

    def _move_aside(self, steps: list[int]) -> None:
        """Moves unreadable checkpoints to `<directory>/corrupt/<step>-<UTC time>` (process 0; the
        others wait), so the run saves those steps afresh and later restarts do not fall back."""
        if not steps:
            return
        if jax.process_index() == 0:
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            aside = epath.Path(self.directory) / CORRUPT_DIR
            aside.mkdir(parents=True, exist_ok=True)
            for step in steps:
                target = aside / f"{step}-{stamp}"
                (epath.Path(self.directory) / str(step)).rename(target)
                logging.warning("moved the unreadable checkpoint of step %d to %s", step, target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("qurl_jax checkpoint move-aside")
        self._manager.reload()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
