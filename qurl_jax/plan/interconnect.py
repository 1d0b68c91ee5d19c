"""The rollout's decode step on a target's whole slice: HBM, FLOPs and the interconnect, predicted.

    python -m qurl_jax.bench.interconnect --config=configs/deepscaler_r1_1p5b_int8.py \
        --target=tpu:v5p-16 [--layouts=learner,rollout,replicated] [--json=PATH]
    python -m qurl_jax.bench.interconnect --table a.json b.json        # markdown table

`bench.roofline` compiles a decode program for ONE device, so it never sees a collective. Here the
run's decode program (the config's sampler, rows, slots and cache and its `rollout.precision`
actor, in one of the layouts below) is compiled by the target's compiler on the target's whole
slice, the collectives one iteration of its decode loop (one generated token) runs per device
are read from the optimized HLO (`plan.collectives`), and one decode step is predicted as

    compute     = max(HBM bytes / HBM bandwidth, FLOPs / matrix rate of the actor's format)
    links       = sum over collectives of link bytes / link bandwidth     (ring algorithms)
    latency     = sum over collectives of hops x per-hop latency          (TPU: ring hops)
                  or a fixed per-collective latency                       (H100: one NVSwitch hop)
    step        = compute + links + latency      (no overlap of collectives with compute assumed)
                  (`step_ms_all_ports` / `tokens_per_s_all_ports`: the links at every port)
    tokens/s    = rows decoding at once on the slice / step

per device, where

- HBM bytes = the actor's bytes on one device (its shards of the compiled program's parameter
  argument) + the KV cache the step reads: the device's rows x every cache slot x the bytes of one
  token's keys and values on it (`memory_plan.decode_kv`; XLA's blockwise attention skips only
  key blocks no row of the batch needs, so with rows of mixed lengths it reads about every slot);
  (`*_live` fields: an attention that reads only the live slots of the refilling sampler's
  steady state, `roofline.live_slots` of the config's prompt and response lengths; `kv_reads`
  says which of the two the compiled program does: 'live' where its decode loop calls a Pallas
  kernel, the ragged decode attention, `collectives.loop_body_kernels`; else 'every slot');
  with an 8-bit cache, plus twice the bytes of every float array as large as one layer's cache
  that the compiled loop writes per token (`collectives.loop_body_float_arrays`: a dequantised
  copy of the cache for an attention that takes float values, such as the dense GPU decode path,
  or the scales broadcast to the pages' shape by JAX's TPU paged kernel wrapper), written once
  and read once (`kv_float_copies`, `kv_float_copy_bytes_per_device` in the record);
- FLOPs = `plan.roofline.step_flops` of the slice's rows over every slot, over the devices;
- link bytes: `Collective.link_bytes` (what one device sends by a ring algorithm over its group);
- hops: an all-gather, reduce-scatter or all-to-all on a bidirectional ring of n chips takes
  ceil(n / 2) hops, an all-reduce twice that (a reduce-scatter then an all-gather), a permute one.

Layouts (`--layouts`, default learner,rollout):

- 'learner': the config's sampler on the learner's mesh with the actor as `quant.requantize`
  leaves it there (each kernel keeps its fsdp sharding): how the rollout decodes until it has a
  layout of its own;
- 'rollout': the plan's own `rollout_decode` program (`memory_plan.PROGRAMS`) where the plan
  builds it on the rollout's replicas (`Setup.rollout_mesh`); where it does not (before the
  rollout layout), 'replicated' stands in for it and the record says so;
- 'replicated': `mesh.data` set to every device and `mesh.fsdp = mesh.tensor = 1`, so the actor
  is whole on every device and the rows are split over all of them: the rollout layout at
  `rollout.tensor=1`, built from the learner's side (a layout the learner cannot afford).

Each record says what its compiled program had: the actor's share per device (`actor_fraction`,
1.0 for a replica, 1/t for a t-way tensor-parallel replica, 1/fsdp for the learner's layout).

Link figures per chip (public; `LINKS`):

- TPU v5e, v6e, v5p: Google's per-chip bidirectional ICI bandwidth over its ports
  (cloud.google.com/tpu/docs/v5e: 400 GB/s, 4 ports; /v6e: 800 GB/s, 4 ports; /v5p: 1,200 GB/s,
  6 ports of a 3D torus), divided by the ports: a bidirectional ring along one torus axis sends
  over two ports, one way each, i.e. one port's bidirectional figure (v5e 100 GB/s, v6e and v5p
  200 GB/s). The JAX scaling book (jax-ml/scaling-book, tpus.md) gives 9e10 / 1.8e11 / 1.8e11
  bytes/s for the same quantity. Latency: about 1 us per ICI hop (scaling book, sharding.md,
  "A note on ICI latency").
- H100 SXM: 900 GB/s of NVLink per GPU, bidirectional (NVIDIA H100 datasheet), 450 GB/s each
  way; all eight GPUs of a node meet at the NVSwitches, so a ring sends at 450 GB/s. Latency:
  about 6 us for a small all-reduce on an 8 x H100 HGX node with NVLink SHARP, at 2 GPUs and more
  beyond (NVIDIA/nccl issue 1259); 6 us per collective is taken, a floor.

A group spanning several torus axes can use more ports (up to the chip's whole figure, recorded as
`links_ms_all_ports`); an axis of fewer than 4 chips has no wraparound link. Everything here is a
prediction from the compiler's program and public peak figures, not a measurement.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np

from qurl_jax import quant
from qurl_jax.config.settings import RunSettings
from qurl_jax.models import PagedKVCache
from qurl_jax.parallel import targets
from qurl_jax.plan import collectives, memory_plan, roofline
from qurl_jax.sampling.factory import build_rollout_sampler

LAYOUTS = ("learner", "rollout", "replicated")
PREDICTION = "prediction from the compiled program and public peak figures, not a measurement"


@dataclasses.dataclass(frozen=True)
class Link:
    """One chip's interconnect as the model uses it (module docstring, sources there).

    ring_bytes_per_s: what one device sends per second in a ring collective along one axis;
    all_ports_bytes_per_s: its every port one way (the most any collective can get);
    hop_s: latency per ring hop (TPU), 0 where `collective_s` is used instead;
    collective_s: fixed latency per collective (H100 over NVSwitch)."""

    ring_bytes_per_s: float
    all_ports_bytes_per_s: float
    hop_s: float = 0.0
    collective_s: float = 0.0


LINKS: dict[str, Link] = {
    "v5e": Link(ring_bytes_per_s=100e9, all_ports_bytes_per_s=200e9, hop_s=1e-6),
    "v6e": Link(ring_bytes_per_s=200e9, all_ports_bytes_per_s=400e9, hop_s=1e-6),
    "v5p": Link(ring_bytes_per_s=200e9, all_ports_bytes_per_s=600e9, hop_s=1e-6),
    "h100": Link(ring_bytes_per_s=450e9, all_ports_bytes_per_s=450e9, collective_s=6e-6),
}


def hops(c: collectives.Collective) -> int:
    """Ring hops of one collective on a bidirectional ring of its group (module docstring)."""
    n = max(c.group, 1)
    if c.kind in ("collective-permute", "collective-broadcast") or c.group == 0:
        return 1
    if n == 1:
        return 0
    return math.ceil(n / 2) * (2 if c.kind == "all-reduce" else 1)


def link_seconds(found: list[collectives.Collective], link: Link) -> dict[str, float]:
    """Seconds per iteration the collectives cost: bandwidth (ring, and at every port), latency."""
    sent = sum(c.link_bytes for c in found)
    latency = sum(link.collective_s + link.hop_s * hops(c) for c in found
                  if c.group != 1)
    return {"links_s": sent / link.ring_bytes_per_s,
            "links_all_ports_s": sent / link.all_ports_bytes_per_s, "latency_s": latency}


def step(chip: str, actor: str, hbm_bytes: float, flops: float,
         found: list[collectives.Collective]) -> dict[str, Any]:
    """The predicted decode step of one device (module docstring): its parts in ms and bound."""
    peak = roofline.CHIPS[chip]
    rate = peak.get(actor, peak["bf16"])
    t_mem, t_flops = hbm_bytes / peak["bandwidth"], flops / rate
    compute = max(t_mem, t_flops)
    links = link_seconds(found, LINKS[chip])
    total = compute + links["links_s"] + links["latency_s"]
    parts = {"hbm": t_mem, "flops": t_flops, "links": links["links_s"],
             "latency": links["latency_s"]}
    optimistic = compute + links["links_all_ports_s"] + links["latency_s"]
    return {"hbm_ms": t_mem * 1e3, "flops_ms": t_flops * 1e3, "links_ms": links["links_s"] * 1e3,
            "links_ms_all_ports": links["links_all_ports_s"] * 1e3,
            "latency_ms": links["latency_s"] * 1e3, "step_ms": total * 1e3,
            "step_ms_all_ports": optimistic * 1e3, "bound": max(parts, key=parts.get)}


def actor_precision(settings: RunSettings) -> str:
    """The roofline's matrix-rate key of `rollout.precision`: int8, fp8 (fp8 and fp8_block) or
    bf16 (the float and weight-only actors multiply in the compute dtype)."""
    p = settings.rollout.precision
    return "int8" if p == "int8" else "fp8" if p.startswith("fp8") else "bf16"


def replicated(settings: RunSettings, devices: int) -> RunSettings:
    """`settings` with the actor whole on every device: mesh data = devices, fsdp = tensor = 1."""
    mesh = dataclasses.replace(settings.mesh, data=devices, fsdp=1, tensor=1)
    return dataclasses.replace(settings, mesh=mesh)


def _learner_decode(setup: memory_plan.Setup) -> tuple[Any, dict[str, int]]:
    """The run's decode program on the learner's layout: its sampler on the learner's mesh with
    the actor as `quant.requantize` leaves it there (the learner's fsdp shardings), and the KV
    cache it holds per device (rows, batch shards, cache slots, bytes per token)."""
    rollout = setup.settings.rollout
    sampler = build_rollout_sampler(
        setup.model_config, quant.make_dot_general(rollout.recipe),
        rollout.sampler, prompt_buckets=(setup.prompt_len,), gen_buckets=(setup.response_len,),
        mesh=setup.mesh, platform=targets.platform_of(setup.mesh))
    rows = sampler.rows_per_chunk(setup.settings.data.prompts_per_step, rollout.n)
    slots = min(rollout.sampler.max_concurrent_rows or rows, rows) if rollout.sampler.refills \
        else rows
    actor = getattr(setup, "learner_actor", None) or setup.actor  # the plan's name for it
    lowered = sampler.lower_programs(actor, rows, setup.prompt_len, setup.response_len,
                                     n=rollout.n)["decode"]
    engine = sampler.engine
    if engine.kv_policy.compresses:
        raise memory_plan.PlanError("config.rollout.kv_policy compresses the KV cache; the "
                                    "interconnect roofline reads a dense cache")
    cache_len = engine.cache_slots(setup.prompt_len, setup.response_len)
    cache = engine.layout.abstract(slots, cache_len)
    k = cache.k[0]
    # One layer's keys on a device, an 8-bit cache's scales included (rollout.kv_precision).
    per_device = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
                     for x in (k, *cache.k_scale[:1]))
    mesh = setup.mesh.shape
    kv = {"cache_len": int(cache_len), "prompt_len": setup.prompt_len,
          "max_new_tokens": setup.response_len, "batch_shards": mesh["data"] * mesh["fsdp"]}
    if isinstance(cache, PagedKVCache):  # pools f[Hkv, P, page_size, D]: pages over the shards
        pages = k.sharding.shard_shape(k.shape)[1]
        kv_rows = cache.page_table.sharding.shard_shape(cache.page_table.shape)[0]
        token = 2 * len(cache.k) * per_device // (pages * cache.page_size)
    else:
        kv_rows = k.sharding.shard_shape(k.shape)[0]
        token = 2 * len(cache.k) * per_device // (kv_rows * cache_len)
    return lowered, {**kv, "rows": int(kv_rows), "token_bytes": int(token)}


def _actor_bytes(lowered: Any, compiled: Any) -> tuple[int, int]:
    """(bytes of the program's first argument, the actor's parameters, on one device; in all)."""
    infos = jax.tree.leaves(lowered.args_info[0][0])
    shardings = jax.tree.leaves(compiled.input_shardings[0][0])
    per_device = total = 0
    for info, sharding in zip(infos, shardings, strict=True):
        itemsize = np.dtype(info.dtype).itemsize
        total += int(np.prod(info.shape)) * itemsize
        per_device += int(np.prod(sharding.shard_shape(info.shape))) * itemsize
    return per_device, total


def predict(settings: RunSettings, shapes_dir: str, target: targets.Target, layout: str = "rollout",
            log: Any = print) -> dict[str, Any]:
    """Compiles the run's `rollout_decode` program for `target`'s whole slice in `layout` and
    predicts its decode step (module docstring); returns the JSON-able record."""
    if target.chip is None or target.chip.name not in LINKS:
        raise targets.TargetError(f"{target.name}: link figures known for {', '.join(LINKS)} "
                                  "only")
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: expected one of {LAYOUTS}")
    devices = target.devices()
    model = memory_plan.model_shape(settings.model, shapes_dir)
    setup = memory_plan.build_setup(settings, model, devices)
    has_rollout_layout = hasattr(setup, "rollout_mesh")
    if layout == "replicated" or (layout == "rollout" and not has_rollout_layout):
        setup = memory_plan.build_setup(replicated(settings, len(devices)), model, devices)
        layout = "replicated" + (" (stands in for the rollout layout)" if layout == "rollout"
                                 else "")
    start = time.perf_counter()
    if layout == "learner":
        lowered, kv = _learner_decode(setup)
    else:
        lowered, kv = memory_plan.rollout_decode(setup).lowered, memory_plan.decode_kv(setup)
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start
    module = collectives.parse(compiled.as_text())
    found = collectives.loop_body_collectives(module)
    kernels = collectives.loop_body_kernels(module)
    if kv is None:
        raise memory_plan.PlanError("config.rollout.kv_policy compresses the KV cache; the "
                                    "interconnect roofline reads a dense cache")
    actor_device, actor_total = _actor_bytes(lowered, compiled)
    mesh = setup.settings.mesh
    slice_rows = kv["rows"] * kv["batch_shards"]
    kv_read = kv["rows"] * kv["cache_len"] * kv["token_bytes"]
    copies = (collectives.loop_body_float_arrays(module, kv["layer_elements"])
              if jax.numpy.dtype(kv["kv_dtype"]).itemsize == 1 else [])
    copy_bytes = sum(b for _, _, b in copies)
    extra = 2 * copy_bytes  # written by one kernel, read by the next
    flops = roofline.step_flops(model, slice_rows, kv["cache_len"]) / setup.mesh.size
    actor = actor_precision(setup.settings)
    predicted = step(target.chip.name, actor, actor_device + kv_read + extra, flops, found)
    rollout_mesh = getattr(setup, "rollout_mesh", None)
    record = {
        "rollout_mesh": dict(rollout_mesh.shape) if rollout_mesh is not None else None,
        "target": target.name, "chip": target.chip.name, "devices": setup.mesh.size,
        "config_model": os.path.basename(os.path.normpath(settings.model.path)),
        "precision": settings.rollout.precision, "actor": actor, "layout": layout,
        "mesh": {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor},
        "actor_bytes_per_device": actor_device, "actor_bytes": actor_total,
        "actor_fraction": round(actor_device / actor_total, 4),
        "rows_per_device": kv["rows"], "slice_rows": slice_rows, "cache_len": kv["cache_len"],
        "prompt_len": kv["prompt_len"], "max_new_tokens": kv["max_new_tokens"],
        "kv_read_bytes_per_device": kv_read,
        "kv_float_copies": len(copies), "kv_float_copy_bytes_per_device": copy_bytes,
        "kv_float_copy_types": sorted({t for _, t, _ in copies}),
        "hbm_bytes_per_device": actor_device + kv_read + extra,
        "flops_per_device": flops, "collectives": collectives.to_json(found),
        "compile_s": round(compile_s, 1), **predicted,
        "tokens_per_s": slice_rows / predicted["step_ms"] * 1e3,
        "tokens_per_s_all_ports": slice_rows / predicted["step_ms_all_ports"] * 1e3,
        "note": PREDICTION}
    # The same step with a ragged attention that reads only the rows' live slots (the refilling
    # sampler's steady state under `bench.sampler.tail_limits`' lengths: `roofline.live_slots`).
    live = roofline.live_slots(kv["prompt_len"], kv["max_new_tokens"])
    ragged = step(target.chip.name, actor,
                  actor_device + kv_read * live / kv["cache_len"] + extra, flops, found)
    record.update(live_slots=live, step_ms_live=ragged["step_ms"],
                  tokens_per_s_live=slice_rows / ragged["step_ms"] * 1e3,
                  # Which of the two the compiled program does: a Pallas kernel in the loop is
                  # the ragged decode attention (GPU: dense or paged; TPU: paged), else XLA's
                  # masked attention reads every slot.
                  attention_kernels_per_token=kernels,
                  kv_reads="live" if kernels else "every slot")
    log(f"{target.name} {record['config_model']} {settings.rollout.precision} layout={layout} "
        f"(mesh data={mesh.data} fsdp={mesh.fsdp} tensor={mesh.tensor}, actor share "
        f"{record['actor_fraction']:.3g} per device; compiled in {compile_s:.0f} s):")
    log("  decode loop, per token per device: " + "\n  ".join(collectives.describe(found)))
    p = predicted
    log(f"  predicted step {p['step_ms']:.2f} ms = HBM/FLOP {max(p['hbm_ms'], p['flops_ms']):.2f}"
        f" + links {p['links_ms']:.2f} + latency {p['latency_ms']:.2f} "
        f"(bound: {p['bound']}); {record['tokens_per_s']:,.0f} tokens/s on the slice "
        f"({slice_rows} rows) - a prediction")
    if copies:
        log(f"  8-bit KV cache: the loop writes {len(copies)} float arrays of one layer's cache "
            f"size per token ({', '.join(record['kv_float_copy_types'])}; "
            f"{copy_bytes / 2**30:.2f} GiB per device, counted written and read)")
    log(f"  decode attention: {kernels} Pallas kernel calls per token ("
        + (f"reads live slots: {record['tokens_per_s_live']:,.0f} tokens/s with the refilling "
           f"sampler's live KV, {live:,.0f} of {kv['cache_len']} slots a row"
           if kernels else "XLA's attention reads every slot") + ") - a prediction")
    return record


def _all_ports(r: dict[str, Any]) -> float:
    """A record's tokens/s with its links at every port (from its parts, old records too)."""
    step_ms = max(r["hbm_ms"], r["flops_ms"]) + r["links_ms_all_ports"] + r["latency_ms"]
    return r["slice_rows"] / step_ms * 1e3


# A GPU's share of its node's scale-out network: one 400 Gb/s ConnectX-7 per H100 (NVIDIA DGX
# H100 datasheet: 8 x 400 Gb/s compute ports for 8 GPUs), 50 GB/s each way.
NODE_NIC_BYTES_PER_S = 50e9
GPUS_PER_NODE = 8


def reshard(settings: RunSettings, shapes_dir: str, target: targets.Target) -> dict[str, Any]:
    """The once-per-step reshard (`rollout_layout.Reshard`) predicted on `target`'s slice: what
    each device receives (`Reshard.bytes`: from shapes and shardings, nothing runs) over the
    chip's ring bandwidth, plus a latency per moved array (each an all-gather over the learner's
    fsdp group: hops on a TPU ring, one fixed latency over NVSwitch). A GPU slice of several
    nodes also gets `reshard_ms_cross_node`: a flat ring crosses the nodes' network, so it runs
    at one NIC's bandwidth per GPU instead of NVLink's."""
    if target.chip is None or target.chip.name not in LINKS:
        raise targets.TargetError(f"{target.name}: link figures known for {', '.join(LINKS)} "
                                  "only")
    devices = target.devices()
    model = memory_plan.model_shape(settings.model, shapes_dir)
    setup = memory_plan.build_setup(settings, model, devices)
    src = setup.learner_actor
    moved = setup.reshard.bytes(src)
    after = setup.actor
    share = lambda x: int(np.prod(x.sharding.shard_shape(x.shape)))  # noqa: E731
    grown = sum(share(b) > share(a)
                for a, b in zip(jax.tree.leaves(src), jax.tree.leaves(after), strict=True))
    link = LINKS[target.chip.name]
    group = int(setup.mesh.shape["fsdp"])
    latency = grown * (link.collective_s + link.hop_s * math.ceil(group / 2))
    record = {
        "target": target.name, "chip": target.chip.name, "devices": len(devices),
        "config_model": os.path.basename(os.path.normpath(settings.model.path)),
        "precision": settings.rollout.precision,
        "rollout_mesh": dict(setup.rollout_mesh.shape),
        "reshard_bytes_per_device": moved.received,
        "reshard_codes_bytes_per_device": moved.codes,
        "quantized_parameters": moved.quantized_parameters,
        "bytes_per_quantized_param": round(moved.per_quantized_parameter, 3),
        "codes_bytes_per_quantized_param": round(
            moved.codes / max(moved.quantized_parameters, 1), 3),
        "arrays_moved": grown, "latency_ms": latency * 1e3,
        "reshard_ms": (moved.received / link.ring_bytes_per_s + latency) * 1e3,
        "note": PREDICTION}
    if target.chip.platform == "gpu" and len(devices) > GPUS_PER_NODE:
        record["reshard_ms_cross_node"] = (moved.received / NODE_NIC_BYTES_PER_S + latency) * 1e3
    return record


def describe_reshard(r: dict[str, Any]) -> str:
    """One line of a `reshard` record."""
    cross = (f", {r['reshard_ms_cross_node']:.1f} ms if the ring crosses the nodes' network"
             if "reshard_ms_cross_node" in r else "")
    return (f"{r['target']} {r['config_model']} {r['precision']}: reshard to "
            f"{r['rollout_mesh']} receives {r['reshard_bytes_per_device'] / 2**20:,.1f} MiB per "
            f"device ({r['bytes_per_quantized_param']:.3f} bytes per quantized parameter; codes "
            f"and scales {r['codes_bytes_per_quantized_param']:.3f}) in {r['arrays_moved']} "
            f"arrays: predicted {r['reshard_ms']:.1f} ms per RL step{cross} - a prediction")
