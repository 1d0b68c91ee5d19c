"""The resolved config of a run, saved as `<workdir>/config.json` and checked when it resumes.

A run writes every field of its config (the config file with the command line's overrides) when
it starts. A restart in the same workdir compares its own config with the saved one before
anything runs: a changed field that changes the math of the resumed steps (the model, data,
sampling, objective, optimizer, seed) stops it with one line naming the field and both values; a
changed field that only changes logging, scheduling or layout (`RESUMABLE` below: the step count,
checkpoint and evaluation cadence, the mesh, chunk sizes) is logged and the new config saved.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from absl import logging

from qurl_jax.runtime import paths
from qurl_jax.runtime.errors import ConfigError


class ResumeConfigError(ConfigError):
    """A restart's config changes the math of the run it would resume."""

    what = "cannot resume"

FILE = "config.json"
# Fields (or whole sections, ending in '.') a resumed run may change: they leave the RL math of
# the resumed steps as it was.
RESUMABLE = (
    "train.num_steps", "train.checkpoint_every", "train.keep_checkpoints", "train.eval_every",
    "train.max_bad_steps", "train.export_hf", "train.progress", "train.report_speed",
    "train.remat", "train.scan_layers", "train.logprob_chunk", "train.preflight",
    "train.memory_limit_gib", "train.compilation_cache_dir", "eval.", "mesh.", "reward.workers",
    "reward.timeout_s", "rollout.max_concurrent_rows", "rollout.refill", "rollout.kv_pages",
    "rollout.kv_page_size", "rollout.kv_watermark_pages", "model.attention",
    "model.path", "train.loggers", "train.wandb_project", "train.stall_timeout_s",
    "train.check_collectives", "train.packing", "train.pack_length",
    "train.tokens_per_micro_batch", "train.pack_buckets", "train.cpu_dots", "train.malloc_arenas",
    "train.malloc_trim_steps",
    "rollout.tensor", "rollout.reshard_bucket_mib")


def flatten(c: ml_collections.ConfigDict | dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted field -> JSON value (tuples become lists) of every leaf."""
    out: dict[str, Any] = {}
    for key, value in c.items():
        name = f"{prefix}{key}"
        if isinstance(value, ml_collections.ConfigDict | dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.loads(json.dumps(value))
    return out


def _resumable(field: str) -> bool:
    return any(field == r or (r.endswith(".") and field.startswith(r)) for r in RESUMABLE)


# Math fields added after runs had started, with the value that reproduces those runs: a config
# saved without the field ran with it (so a run of an older version resumes with that value set).
ADDED = {"rollout.quantize_vocab": False, "rollout.kv_precision": "bf16",
         "rollout.kv_scale": "token"}


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, saved value, current value) of every field that differs (absent: `ADDED`'s
    value, else None)."""
    saved = {**{f: v for f, v in ADDED.items() if f in now}, **saved}
    return [(f, saved.get(f), now.get(f)) for f in sorted(set(saved) | set(now))
            if saved.get(f) != now.get(f)]


def check(c: ml_collections.ConfigDict, workdir: str) -> None:
    """Compares `c` with the workdir's saved config, if any: `ResumeConfigError` (one line naming
    the first field) when a field that changes the math differs; other changes are logged."""
    path = paths.join(workdir, FILE)
    if not paths.exists(path):
        return
    with paths.open_file(path, "rb") as f:
        saved = json.loads(f.read().decode("utf-8"))
    diff = changes(saved, flatten(c))
    math = [d for d in diff if not _resumable(d[0])]
    if math:
        field, before, after = math[0]
        more = f" (and {len(math) - 1} more field(s))" if len(math) > 1 else ""
        raise ResumeConfigError(
            f"config.{field} is {after!r} but the run in this workdir started with {before!r}"
            f"{more}, which changes the math of the resumed steps; resume with the saved value "
            f"(see {path}), or start in a new workdir")
    for field, before, after in diff:
        logging.info("resuming with config.%s changed from %r to %r", field, before, after)


def save(c: ml_collections.ConfigDict, workdir: str) -> None:
    """Writes every field of `c` to `<workdir>/config.json` (a local path or URL)."""
    paths.makedirs(workdir)
    with paths.open_file(paths.join(workdir, FILE), "wb") as f:
        f.write((json.dumps(flatten(c), indent=1, sort_keys=True) + "\n").encode("utf-8"))


def check_and_save(c: ml_collections.ConfigDict, workdir: str, *, resuming: bool) -> None:
    """`check` when `resuming` (a checkpoint exists), then `save`."""
    if resuming:
        check(c, workdir)
    save(c, workdir)
