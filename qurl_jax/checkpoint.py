"""Orbax checkpoints of the RL training state, with fallback past a corrupt latest checkpoint.

A checkpoint holds the learner's parameters and optimizer state (one pytree, restored with the
shardings of a template so a resumed run lands on the same mesh) and a JSON record of the step, the
data iterator position, the PRNG seed/state and any flags the trainer needs (for example whether
invariant scaling was already applied). Orbax writes each step into a temporary directory and
renames it when complete, so a run killed mid-save leaves the previous checkpoint intact; a
checkpoint that is nonetheless unreadable (truncated files, deleted arrays) is skipped with a
warning and the next older one is restored, so a crash never loses more than one interval.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging


class Checkpointer:
    """Saves/restores `(state pytree, meta json)` every `interval` steps; keeps the last `keep`."""

    def __init__(self, directory: str, *, interval: int = 1, keep: int = 3,
                 async_save: bool = False) -> None:
        if interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        self.directory = os.path.abspath(directory)
        self.interval = interval
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=interval, create=True,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

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
        return saved

    def restore_latest(self, template: Any) -> tuple[int, Any, dict[str, Any]] | None:
        """Restores the newest readable checkpoint into `template`'s structure and shardings.

        Returns None when there is no checkpoint. Unreadable checkpoints are skipped with a warning.
        """
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, template)
        for step in reversed(self.steps()):
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                            meta=ocp.args.JsonRestore()),
                )
                return step, restored["state"], dict(restored["meta"])
            except Exception as e:  # noqa: BLE001 - any read failure means "corrupt": try older.
                logging.warning("checkpoint at step %d in %s is unreadable (%s: %s); "
                                "falling back to the previous one", step, self.directory,
                                type(e).__name__, str(e)[:200])
        return None

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()
