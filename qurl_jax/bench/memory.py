"""Per-device memory of a config's programs, compiled by a target's compiler
(qurl_jax.plan.memory_plan).

    python -m qurl_jax.bench.memory --config=configs/deepscaler_r1_1p5b_int8.py \
        [--target=cpu|tpu:v5p-16|gpu:h100-8] [--programs=learner_update,...] [--json=PATH]
        [--kv_capacity [--page_size=16]]

`--target` (`qurl_jax.parallel.targets`) picks the compiler: `cpu` (default) builds the config's
mesh on this host's CPU devices (their count set to the mesh size), `tpu:...` / `gpu:...` on
compile-only devices of that slice (needs `pip install -e .[tpu-compile]` / `.[gpu-compile]`; no
accelerator). Prints each program's compiled argument / output / temp / peak bytes per device (the
compiler's memory plan) against the budget (85% of the chip's memory; 60 GiB on `cpu`) and an
analytic estimate; `--json` also writes them, with the target's name, platform and device kind. A
bad flag or target ends with one line naming it and a non-zero exit. A program the compiler refuses
for want of device memory (XLA:TPU's RESOURCE_EXHAUSTED) does not fit, with the compiler's line. The
last line is the verdict: FITS (the largest program and its margin) or DOES NOT FIT (each program
over the budget, by how much, and the config fields that shrink it, as the trainer's preflight
names them), with exit code 3 then. A config mesh smaller than the target (`mesh.fsdp=4` on
`tpu:v5e-8`) uses part of it, as a run there would (it warns and leaves the rest idle): the report
says so and plans the devices it uses, as the slice of that size (`tpu:v5e-4`).

With `rollout_decode` among the programs on a mesh of more than one device, it also prints the
collectives the decode loop runs per generated token per device (count, bytes, kinds, the biggest
operands; `bench.collectives`, JSON `decode_collectives`): what the layout costs in links.

`--kv_capacity` adds, from the `rollout_decode` program's figures, the rollout rows a device's KV
memory keeps decoding at once (`bench.paged.kv_capacity`): the budget less what the decode program
plans besides its KV cache, as today's fixed slots (prompt + max_new_tokens each) and as a paged
pool of `--page_size`-token pages, the paged rows measured by simulating the scheduler on the
configs' long-tailed response lengths (a simulation, not a device measurement); in the JSON as
`kv_capacity`. The non-KV buffers that grow with the rows decoded at once (logits, sampling) are
charged per row (fixed slots and the paged decode batch alike), as measured by a second compile of
`rollout_decode` at half the rows per device. A last line gives the paged pool as config flags to
copy (`rollout.kv_pages` = pages per device x batch shards, `rollout.kv_page_size`,
`rollout.max_concurrent_rows` = the paged rows, at most the rollout's), checked by compiling the
insert and decode programs with them, the pool shrunk by what their larger peak exceeds the budget
by until it fits (at most 3 rounds; JSON `kv_capacity.suggested_config`, and `suggestion_check`
with each round's peaks and the final flags).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from typing import Any

import jax
from absl import app, flags
from ml_collections import config_flags

from qurl_jax.bench import paged
from qurl_jax.bench.paged import host_devices_for
from qurl_jax.config.settings import RunSettings
from qurl_jax.parallel import targets
from qurl_jax.plan import memory_plan

# The exit code when a program does not fit (the verdict line says which); bad flags exit 1 with
# their one line too, and a report where everything fits exits 0.
EXIT_DOES_NOT_FIT = 3

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Path to a config file with get_config() (see configs/).", lock_config=True)
_TARGET = flags.DEFINE_string(
    "target", "cpu", "What to compile for: cpu, tpu:v5e-N, tpu:v6e-N, tpu:v5p-N, gpu:h100-N.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this JSON file.")
_SHAPES = flags.DEFINE_string(
    "shapes_dir", None, "Directory of model config.json files; default: shapes/ beside --config.")
_DEVICES = flags.DEFINE_integer(
    "devices", 0, "Host CPU devices for --target=cpu; 0: the config's mesh size, an axis of -1 "
    "counting as one 8-device host per unit of the other axes.")
_PROGRAMS = flags.DEFINE_list("programs", None,
                              f"Only these programs: {list(memory_plan.PROGRAMS)}.")
_KV_CAPACITY = flags.DEFINE_bool(
    "kv_capacity", False, "Also the rollout rows a device's KV memory keeps in flight: fixed "
    "slots vs a paged pool (bench.paged.kv_capacity, from the rollout_decode program's figures).")
_PAGE_SIZE = flags.DEFINE_integer("page_size", 16, "Tokens per page of --kv_capacity's pool.")
flags.mark_flags_as_required(["config"])


def decode_row_overhead(settings: RunSettings, shapes_dir: str, target: targets.Target,
                        figures: dict[str, Any]) -> dict[str, Any] | None:
    """How the `rollout_decode` program's non-KV bytes per device grow per row it decodes at
    once (logits, sampling), from a second compile at half the rows per device (same sampler
    kind): bytes_per_row = (non-KV at R rows - non-KV at R/2) / (R - R/2), at least 0. None when
    the program decodes one row per device or the half-size program cannot be built."""
    kv = figures["decode_kv"]
    half = kv["rows"] // 2
    if half < 1:
        return None
    rollout = settings.rollout
    sampler = dataclasses.replace(rollout.sampler, max_concurrent_rows=half * kv["batch_shards"],
                                  refill="on" if rollout.sampler.refills else "off")
    smaller = dataclasses.replace(settings, rollout=dataclasses.replace(rollout, sampler=sampler))
    try:
        other = memory_plan.report(smaller, shapes_dir, target, log=lambda _: None,
                                   programs=("rollout_decode",))
    except (ValueError, memory_plan.PlanError):
        return None
    if "decode_kv" not in other:  # the compiler refused the half-size program
        return None
    rows = [kv["rows"], other["decode_kv"]["rows"]]
    non_kv = [f["programs"]["rollout_decode"]["peak_bytes"] - f["decode_kv"]["cache_bytes"]
              for f in (figures, other)]
    return {"rows": rows, "non_kv_bytes": non_kv,
            "bytes_per_row": max((non_kv[0] - non_kv[1]) // (rows[0] - rows[1]), 0)}


def capacity(figures: dict[str, Any], page_size: int,
             overhead: dict[str, Any] | None = None) -> dict[str, Any]:
    """`bench.paged.kv_capacity` of a `memory_plan.report` that compiled `rollout_decode`: its
    budget, the decode program's peak and KV cache per device, the rollout's rows per device as
    the batch case, and `overhead` (`decode_row_overhead`) when given."""
    kv = figures.get("decode_kv")
    if kv is None:
        sys.exit("qurl_jax: bad flag --kv_capacity: config.rollout.kv_policy compresses the KV "
                 "cache; the capacity is for a dense cache")
    try:
        out = paged.kv_capacity(
            budget_bytes=figures["budget_bytes_per_device"],
            peak_bytes=figures["programs"]["rollout_decode"]["peak_bytes"],
            cache_bytes=kv["cache_bytes"], token_bytes=kv["token_bytes"],
            prompt_len=kv["prompt_len"], max_new_tokens=kv["max_new_tokens"],
            page_size=page_size, batch_rows=kv["rollout_rows"],
            row_overhead_bytes=overhead["bytes_per_row"] if overhead else 0,
            planned_rows=kv["rows"])
    except ValueError as e:
        sys.exit(f"qurl_jax: --kv_capacity: {e}")
    return {**out, "row_overhead_from": overhead,
            "suggested_config": suggested_config(out, kv["batch_shards"], kv["rollout_rows"])}


def suggested_config(capacity: dict[str, Any], batch_shards: int, rollout_rows: int = 0
                     ) -> dict[str, int] | None:
    """The config fields of `capacity`'s paged pool for the whole mesh: `rollout.kv_pages` =
    pages per device x batch shards (the devices of one tensor-parallel group share a shard's
    pages, each holding its heads), the page size, and `rollout.max_concurrent_rows`: the
    page-table rows the pool was sized around (their per-row buffers were charged before the
    pool), at most the rollout's `rollout_rows` per device when given (more would hold no row).
    None when no row fits."""
    if not capacity["fits_one_row"]:
        return None
    rows = capacity["paged_slots"]
    if rollout_rows > 0:
        rows = min(rows, rollout_rows)
    return {"rollout.kv_pages": capacity["num_pages"] * batch_shards,
            "rollout.kv_page_size": capacity["page_size"],
            "rollout.max_concurrent_rows": rows * batch_shards}


def _refused_over_bytes(message: str, budget: int) -> int | None:
    """How far over `budget` a program is that the compiler refused to plan for running out of
    device memory (XLA:TPU's "RESOURCE_EXHAUSTED: ... HLO temporaries (110.42G) exceeds
    available HBM (95.74G)": its temporaries alone, so at least this much over), else None."""
    m = re.search(r"RESOURCE_EXHAUSTED.*?\(([\d.]+)G\) exceeds available", message, re.S)
    return None if m is None else max(int(float(m.group(1)) * memory_plan.GIB) - budget, 1)


def check_suggestion(settings: RunSettings, shapes_dir: str, target: targets.Target,
                     suggested: dict[str, int], token_bytes: int, rounds: int = 3,
                     decode_kv: dict[str, Any] | None = None) -> dict[str, Any]:
    """Compiles the rollout's insert and decode programs (`rollout_prefill`, `rollout_decode`)
    with the `suggested` pool and rows; while the larger planned peak exceeds the budget (the
    insert's prompt activations come on top of the pool the decode program was sized with),
    takes the excess off the pool (whole pages of `page_size * token_bytes` per device, times
    the batch shards) and compiles again, at most `rounds` times in all (a smaller pool can
    change the compiler's temporaries too). Returns {'checks': per round the kv_pages, peaks
    and over_bytes; 'fits': whether the last compiled pool fits; 'suggested_config': the pool
    that fits (or the last correction, when `rounds` ran out), None when the pool no longer
    holds one row}. A program the compiler refuses outright for want of device memory counts as
    over the budget by its temporaries (the round's 'refused' holds the compiler's line), given
    `decode_kv` (the report's, for the batch shards and cache length); without it, or for any
    other compile error, the error propagates."""
    rollout = settings.rollout
    checks: list[dict[str, Any]] = []
    for _ in range(rounds):
        sampler = dataclasses.replace(
            rollout.sampler, refill="on", kv_pages=suggested["rollout.kv_pages"],
            kv_page_size=suggested["rollout.kv_page_size"],
            max_concurrent_rows=suggested["rollout.max_concurrent_rows"])
        paged = dataclasses.replace(settings,
                                    rollout=dataclasses.replace(rollout, sampler=sampler))
        figures = memory_plan.report(paged, shapes_dir, target, log=lambda _: None,
                                     programs=("rollout_prefill", "rollout_decode"))
        refused = next(iter(figures.get("refused", {}).values()), None)
        if refused is not None:  # the compiler refused a program for want of device memory
            parsed = targets.parse(target) if isinstance(target, str) else target
            over = _refused_over_bytes(refused, memory_plan.budget_bytes(parsed))
            if over is None or decode_kv is None:
                raise memory_plan.PlanError(f"the suggested pool: {refused}")
            checks.append({"kv_pages": suggested["rollout.kv_pages"],
                           "refused": refused[:300], "over_bytes": over})
            kv = decode_kv
        else:
            peaks = {name: f["peak_bytes"] for name, f in figures["programs"].items()}
            over = max(max(peaks.values()) - figures["budget_bytes_per_device"], 0)
            checks.append({"kv_pages": suggested["rollout.kv_pages"], "peaks": peaks,
                           "over_bytes": int(over)})
            kv = figures["decode_kv"]
        if not over:
            return {"checks": checks, "fits": True, "suggested_config": suggested}
        shards, page_size = kv["batch_shards"], suggested["rollout.kv_page_size"]
        pages = suggested["rollout.kv_pages"] // shards - -(-over // (page_size * token_bytes))
        if pages < -(-kv["cache_len"] // page_size):  # no whole row
            return {"checks": checks, "fits": False, "suggested_config": None}
        suggested = {**suggested, "rollout.kv_pages": pages * shards}
    return {"checks": checks, "fits": False, "suggested_config": suggested}


def describe_suggestion(suggested: dict[str, int] | None, checked: bool | None = None) -> str:
    """One line of `suggested_config` flags to copy into a run's command line or config;
    `checked`: whether `check_suggestion` compiled them within the budget (None: not run)."""
    if suggested is None:
        return "suggested config: none (no room for one row of KV)"
    note = {None: "", True: " (insert and decode compiled within the budget)",
            False: " (last correction not compiled: check with --programs)"}[checked]
    return ("suggested config: " + " ".join(f"--config.{k}={v}" for k, v in suggested.items())
            + note)


def _use_host_devices(count: int) -> None:
    """Runs JAX on `count` host CPU devices; must happen before JAX starts a backend."""
    flag = f"--xla_force_host_platform_device_count={count}"
    os.environ["XLA_FLAGS"] = " ".join(
        [f for f in os.environ.get("XLA_FLAGS", "").split()
         if not f.startswith("--xla_force_host_platform_device_count")] + [flag])
    jax.config.update("jax_platforms", "cpu")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    try:
        target = targets.parse(_TARGET.value)
    except targets.TargetError as e:
        sys.exit(f"qurl_jax: bad flag --target: {e}")
    if target.compile_only:
        targets.use_cpu_unless_accelerator_attached()
    else:
        _use_host_devices(_DEVICES.value or host_devices_for(config.mesh))
    shapes_dir = _SHAPES.value or os.path.join(
        os.path.dirname(os.path.abspath(config_flags.get_config_filename(flags.FLAGS["config"]))),
        "shapes")
    if _KV_CAPACITY.value and _PROGRAMS.value and "rollout_decode" not in _PROGRAMS.value:
        sys.exit("qurl_jax: bad flag --kv_capacity: needs the rollout_decode program; add it to "
                 "--programs")
    if _PAGE_SIZE.value < 1:
        sys.exit(f"qurl_jax: bad flag --page_size={_PAGE_SIZE.value}: must be >= 1")
    try:
        figures = memory_plan.report(RunSettings.from_config(config), shapes_dir, target,
                                     programs=tuple(_PROGRAMS.value or ()))
    except (targets.TargetError, memory_plan.PlanError) as e:
        sys.exit(f"qurl_jax: {e}")
    if _KV_CAPACITY.value:
        settings = RunSettings.from_config(config)
        overhead = (decode_row_overhead(settings, shapes_dir, target, figures)
                    if figures.get("decode_kv") else None)
        figures["kv_capacity"] = capacity(figures, _PAGE_SIZE.value, overhead)
        print("\n" + "\n".join(paged.describe_capacity(figures["kv_capacity"])))
        suggested, checked = figures["kv_capacity"]["suggested_config"], None
        if suggested is not None:
            try:
                check = check_suggestion(settings, shapes_dir, target, suggested,
                                         figures["decode_kv"]["token_bytes"],
                                         decode_kv=figures["decode_kv"])
            except memory_plan.PlanError as e:
                sys.exit(f"qurl_jax: --kv_capacity: {e}")
            figures["kv_capacity"]["suggestion_check"] = check
            suggested, checked = check["suggested_config"], check["fits"]
        print(describe_suggestion(suggested, checked))
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(figures, f, indent=2)
    if not all(figures["fits"].values()):
        sys.exit(EXIT_DOES_NOT_FIT)


if __name__ == "__main__":
    app.run(main)
