"""Per-device memory of a run's programs, compiled for a target: XLA's buffer sizes and an estimate.

`report(settings, shapes_dir, target)` compiles every program of `PROGRAMS` for a run's typed
settings (`qurl_jax.config.settings.RunSettings.from_config` of its config) and returns their
figures; `preflight(setup, limit_bytes)` is the trainer's check before its first step;
`python -m qurl_jax.bench.memory --config=... --target=...` is the command line over `report`.

Nothing is loaded or allocated: the model shape comes from `configs/shapes/<model dir name>.json`
(the `config.json` of the model `model.path` names; a real checkpoint's own `config.json` wins when
`model.path` exists), parameters and optimizer state are `jax.eval_shape` structures carrying
their mesh shardings, and the config's mesh is built on the target's devices
(`qurl_jax.parallel.targets`: this host's CPU devices, or compile-only TPU / H100 devices). Each
program is lowered and compiled by the target's compiler at the config's largest shapes (prompt
`data.max_prompt_len` + response `rollout.max_new_tokens`), and `compiled.memory_analysis()` gives
its per-device argument, output, temp and peak bytes:

- `learner_update`: one optimizer step on one minibatch (rollout batch / `rl.num_minibatches`
  rows), gradients accumulated over `rl.num_micro_batches` micro-batches in a scan;
- `learner_logprobs`: the log-prob recomputation of the whole rollout batch, in slices of one
  micro-batch;
  with `train.packing` (the default) both run on packed rows at the worst case the packer can
  give them (`qurl_jax.learner.packed_plan`: one sequence per row of `train.pack_length`; with
  `train.tokens_per_micro_batch`, the most token-budget micro-batches);
- `requantize`: the rollout actor made from the learner's sharded parameters (`rollout.precision`);
- `rollout_prefill` / `rollout_decode`: the sampler's programs for one rollout chunk
  (`rollout.max_concurrent_rows` rows, sharded over data x fsdp), built for the platform of the
  mesh's devices (CPU-only work only on a CPU target), on the actor's parameters with their
  shardings. When the rollout refills slots (`rollout.refill`, on by default when rows wait for a
  slot) they are the `RefillSampler`'s: the insert that fills every slot at once and the decode
  loop over the slots, whose state also holds every row's outputs and one held prompt prefill per
  batch shard. With `rollout.kv_pages` the slots' caches are one page pool (its share per
  device) behind a page table, so the KV bytes are the pool's, not rows x slots;
- `eval_prefill` / `eval_decode`: the evaluation sampler's (dense; refilling its slots when
  `rollout.max_concurrent_rows` is set) programs for a call of `eval.max_examples` problems, on
  the full-precision actor in the compute dtype on the rollout's replicas (a bf16 replica is
  twice an int8 one), responses of `eval.max_new_tokens`.

On a mesh of more than one device, `report` also reads the collectives one iteration of the
`rollout_decode` program's decode loop (one generated token) runs per device from its optimized
HLO (`bench.collectives`; JSON `decode_collectives`: count, bytes, link bytes, per kind, the
biggest operands).

`decode_kv(setup)` gives the KV cache inside the `rollout_decode` program per device (its bytes,
bytes per token, rows, prompt and response lengths), without compiling; `report` includes it, and
`bench.memory --kv_capacity` turns it into the rows a fixed-slot and a paged cache keep in flight.

Adding a program is adding one entry to `PROGRAMS`: a function of the `Setup` that returns the
lowered program and its analytic `Estimate`.

What the figures are: the compiler's memory plan (buffer assignment) of the partitioned program,
not a measurement. On TPU and GPU targets it is that chip's compiler's plan (its fusion, its
latency-hiding scheduler, collective buffers); compile-only GPU devices are not autotuned, so
cuDNN attention's workspace is planned at 0 bytes. XLA:CPU (`cpu` target) fuses and schedules
differently and may carry some bf16 intermediates in f32. Allocator fragmentation comes on top
everywhere, and JAX on GPU preallocates 75% of device memory by default
(`XLA_PYTHON_CLIENT_MEM_FRACTION`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from qurl_jax import lora, quant
from qurl_jax.config.settings import MeshSizes, ModelSettings, RunSettings
from qurl_jax.learner import packed_plan
from qurl_jax.learner.learner import Learner, batch_spec
from qurl_jax.models import ModelConfig, PagedKVCache, hf, init_params, param_logical_axes
from qurl_jax.parallel import distributed as dist
from qurl_jax.parallel import rollout_layout, targets
from qurl_jax.parallel import sharding as shd
from qurl_jax.plan import collectives, native_pick
from qurl_jax.runtime.errors import UserError
from qurl_jax.runtime.sizes import tree_bytes_per_device
from qurl_jax.sampling.factory import build_eval_sampler, build_rollout_sampler

GIB = 1 << 30
# A program fits a chip when its planned peak is at most this share of the chip's memory (the
# rest: allocator fragmentation, the runtime's own buffers, what the plan does not see).
FIT_FRACTION = 0.85
# Per-device budget on the `cpu` target, which has no chip: 60 GiB, the 75% of an 80 GB H100 that
# JAX on GPU preallocates by default.
CPU_BUDGET_GIB = 60.0


class PlanError(UserError):
    """A config or target the plan cannot be made for; the message is one line naming the field."""

    what = "bad memory plan"


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything a program needs: the run's settings (their `mesh` the built mesh's total axis
    sizes), the model, mesh, learner and abstract state.

    params / opt_state are `jax.ShapeDtypeStruct` trees with the learner's shardings (with LoRA:
    the adapter's, the frozen base is `frozen`); rollout_rows is the rollout batch
    (prompts_per_step * n), prompt_len P and response_len G its widths.
    """

    settings: RunSettings
    model_config: ModelConfig
    mesh: Mesh
    learner: Learner
    params: Any
    opt_state: Any
    rollout_rows: int
    minibatch_rows: int
    micro_batch_rows: int
    prompt_len: int
    response_len: int

    @property
    def lora(self) -> lora.LoraConfig | None:
        """The run's LoRA settings, None for a full fine-tune."""
        cfg = self.settings.model.lora
        return cfg if cfg.enabled else None

    @functools.cached_property
    def frozen(self) -> Any:
        """A LoRA run's frozen base as `jax.ShapeDtypeStruct`s on the rollout's replicas (placed
        there once; the learner's programs read it where it lies), None otherwise."""
        if self.lora is None:
            return None
        shapes = jax.eval_shape(lambda: init_params(self.model_config, jax.random.key(0)))
        return self.reshard.abstract(lora.base_shapes(
            shapes, self.lora, self.settings.rollout.recipe, self.model_config.compute_dtype))

    @functools.cached_property
    def rollout_adapter(self) -> Any:
        """A LoRA run's adapter replicated on the rollout's replicas (what a step reshards)."""
        repl = jax.sharding.NamedSharding(self.rollout_mesh, jax.sharding.PartitionSpec())
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=repl),
                            self.params)

    @functools.cached_property
    def requantize_fn(self) -> Callable:
        """The jitted requantize of the rollout precision as the trainer runs it (unquantized
        leaves in the compute dtype, codes on each kernel's sharding): one function per Setup,
        so the `learner_actor` shardings and the `requantize` program share one compile."""
        return quant.requantize_program(self.params, self.settings.rollout.recipe,
                                        self.model_config.compute_dtype)

    @functools.cached_property
    def learner_actor(self) -> Any:
        """The rollout actor's parameters as `jax.ShapeDtypeStruct`s with the shardings
        requantize gives them on the learner's mesh (the reshard's input)."""
        fn = self.requantize_fn
        shardings = fn.lower(self.params).compile().output_shardings
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            jax.eval_shape(fn, self.params), shardings)

    @functools.cached_property
    def rollout_mesh(self) -> Mesh:
        """The rollout's replicas over the mesh's devices (`qurl_jax.parallel.rollout_layout`);
        'auto' is 1 here (the plan compiles it; the trainer checks the device's memory)."""
        tensor = rollout_layout.parse_tensor(self.settings.rollout.tensor) or 1
        return rollout_layout.rollout_mesh(self.mesh, tensor)

    @functools.cached_property
    def reshard(self) -> rollout_layout.Reshard:
        return rollout_layout.Reshard(param_logical_axes(self.model_config), self.rollout_mesh,
                                      self.settings.rollout.reshard_bucket_mib << 20)

    @functools.cached_property
    def actor(self) -> Any:
        """The rollout actor's parameters as `jax.ShapeDtypeStruct`s on the rollout's replicas
        (what the samplers' programs take); with LoRA the frozen base with the adapter."""
        if self.lora is not None:
            return lora.attach(self.frozen, self.rollout_adapter, self.lora.scale)
        return self.reshard.abstract(self.learner_actor)

    @functools.cached_property
    def eval_actor(self) -> Any:
        """The evaluation's full-precision actor (the compute dtype, `quant.requantize(..., 'fp')`)
        as `jax.ShapeDtypeStruct`s on the rollout's replicas, as `Trainer.evaluate` samples it;
        with LoRA the frozen base read as the learner reads it (`lora.learner_base`) with the
        adapter."""
        if self.lora is not None:
            return lora.learner_policy(self.frozen, self.rollout_adapter, self.lora)
        dtype = self.model_config.compute_dtype
        return self.reshard.abstract(jax.eval_shape(
            lambda p: quant.requantize(p, "fp", compute_dtype=dtype), self.params))

    @property
    def dot_general(self) -> Any:
        """The samplers' product hook: LoRA's around the quantized products, else the recipe's
        (the evaluation's non-LoRA sampler takes `lax.dot_general`)."""
        if self.lora is not None:
            return lora.dot_general(quant.rollout_dot_general)
        return quant.make_dot_general(self.settings.rollout.recipe)

    @property
    def replicas(self) -> int:
        """The rollout's batch shards: its replicas."""
        return int(self.rollout_mesh.shape["data"] * self.rollout_mesh.shape["fsdp"])


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Analytic bytes per device: (part, formula, bytes) rows, and the symbols' values."""

    parts: tuple[tuple[str, str, int], ...]
    symbols: dict[str, int]

    @property
    def total(self) -> int:
        return sum(row[2] for row in self.parts)


@dataclasses.dataclass(frozen=True)
class Program:
    lowered: jax.stages.Lowered
    estimate: Estimate


def _abstract_batch(setup: Setup, rows: int, keys: tuple[str, ...]) -> dict[str, Any]:
    out = {}
    for k in keys:
        shape, dtype = batch_spec(k, rows, setup.prompt_len, setup.response_len)
        out[k] = jax.ShapeDtypeStruct(shape, dtype,
                                      sharding=shd.batch_sharding(setup.mesh, len(shape)))
    return out


def _packed_shapes(setup: Setup, program: str) -> packed_plan.PackedShapes | None:
    """The worst-case packed shapes (`qurl_jax.learner.packed_plan`) of the learner's `program`
    ('update': one minibatch; 'logprobs': the whole rollout), None without `train.packing`."""
    learner = setup.learner
    if not learner.packing:
        return None
    devices = setup.settings.mesh.data * setup.settings.mesh.fsdp
    try:
        length = packed_plan.pack_length(learner.pack_length,
                                         setup.prompt_len + setup.response_len)
        if program == "update":
            sequences, slices = setup.minibatch_rows, learner.num_micro_batches
        else:
            sequences, lbs = setup.rollout_rows, learner.logprob_batch_size
            slices = sequences // lbs if lbs and lbs < sequences else 1
        return packed_plan.worst_case(sequences, slices, length, devices,
                                      learner.tokens_per_micro_batch,
                                      processes=dist.row_block(setup.mesh)[1],
                                      buckets=learner.pack_buckets,
                                      shared_prompts=learner.share_prompts > 1,
                                      logprob_pass=program == "logprobs")
    except ValueError as e:
        raise PlanError(str(e)) from None


def _abstract_packed(setup: Setup, shapes: packed_plan.PackedShapes) -> dict[str, Any]:
    """The packed keys of a learner batch (the rows', `seq_index` with a token budget, and the
    response index `shapes.index`) at `shapes`."""
    r, n, g = shapes.rows, shapes.length, setup.response_len
    spec = {"tokens": ((r, n), jnp.int32), "positions": ((r, n), jnp.int32),
            "segment_ids": ((r, n), jnp.int32), "attn_mask": ((r, n), jnp.bool_),
            shapes.index: ((shapes.sequences, 3 if shapes.index == "resp_span" else g),
                           jnp.int32)}
    if shapes.seq_index:
        spec["seq_index"] = ((shapes.sequences,), jnp.int32)
    return {k: jax.ShapeDtypeStruct(shape, dtype,
                                    sharding=shd.batch_sharding(setup.mesh, len(shape)))
            for k, (shape, dtype) in spec.items()}


def _packed_symbols(setup: Setup, shapes: packed_plan.PackedShapes) -> dict[str, int]:
    """`_symbols` of one packed micro-batch or slice: b its rows per device, T the pack length,
    C the LM head's chunk (it runs on every packed position)."""
    s = _symbols(setup, shapes.rows_per_slice)
    return {**s, "T": shapes.length, "C": min(setup.settings.train.logprob_chunk, shapes.length),
            "packed rows": shapes.rows, "slices": shapes.slices}


def _symbols(setup: Setup, rows: int) -> dict[str, int]:
    """b rows per device, T = P + G, G, L, E, M, Q = H*D, K = Hkv*D, V, t = tensor-parallel ways,
    cb = compute dtype bytes, C = log-prob chunk, Pd = parameter bytes per device (f32),
    Pl = the decoder layers' share of Pd, N1 = parameters of one layer (unsharded)."""
    m, s = setup.model_config, setup.settings
    layers = {k: v for k, v in setup.params.items() if k.startswith("layers_")}
    return dict(b=max(rows // (s.mesh.data * s.mesh.fsdp), 1),
                T=setup.prompt_len + setup.response_len, G=setup.response_len, L=m.num_layers,
                E=m.hidden_size, M=m.intermediate_size, Q=m.num_heads * m.head_dim,
                K=m.num_kv_heads * m.head_dim, V=m.vocab_size, t=s.mesh.tensor,
                cb=m.compute_dtype.itemsize, C=min(s.train.logprob_chunk, setup.response_len),
                Pd=tree_bytes_per_device(setup.params), Pl=tree_bytes_per_device(layers),
                N1=sum(x.size for x in jax.tree.leaves(layers.get("layers_0", {}))))


# Values per token per layer the backward keeps, by remat policy (compute dtype).
_SAVED = {"full": ("E", lambda s: s["E"]),
          "dots": ("(Q+2K)/t + 2E + 2M/t",
                   lambda s: (s["Q"] + 2 * s["K"] + 2 * s["M"]) // s["t"] + 2 * s["E"]),
          "none": ("2(Q+2K)/t + 4E + 5M/t",
                   lambda s: (2 * (s["Q"] + 2 * s["K"]) + 5 * s["M"]) // s["t"] + 4 * s["E"])}
_SAVED["projections"] = _SAVED["dots"]  # the same values, found by name (`Remat.PROJECTIONS`)


def _weights_at_work(s: dict[str, int]) -> tuple[str, str, int]:
    # FSDP: one layer's weights and the LM head are all-gathered (in the compute dtype) while used.
    return ("gathered weights: one layer + LM head", "(N1 + E*V)/t * cb",
            (s["N1"] + s["E"] * s["V"]) // s["t"] * s["cb"])


def _frozen_part(setup: Setup) -> tuple[tuple[str, str, int], ...]:
    """A LoRA run's frozen base (an argument of every program), or nothing."""
    if setup.frozen is None:
        return ()
    return (("frozen base (codes + scales, the rollout's layout)", "base",
             tree_bytes_per_device(setup.frozen)),)


def _lora_weights_at_work(setup: Setup, s: dict[str, int]) -> tuple[tuple[str, str, int], ...]:
    """A LoRA learner's base weights in use: one layer's kernels widened to the compute dtype
    for their weight-only products (no base gradient, nothing gathered on one replica)."""
    layer = setup.frozen.get("layers_0", {})
    n1 = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(layer) if x.dtype.itemsize == 1)
    return (("one layer's base kernels in the compute dtype", "N1 * cb", n1 * s["cb"]),)


def learner_update(setup: Setup) -> Program:
    """One optimizer step on one minibatch, micro-batches scanned inside."""
    prox = setup.settings.prox  # the batch the trainer passes: with logp_prox when it recomputes
    keys = ("tokens", "positions", "attn_mask", "resp_mask", "logp_behav", "advantages") + (
        ("logp_prox",) if prox.recompute else ()) + (
        ("prox_from_forward",) if prox.skip_first else ()) + (
        ("logp_ref",) if setup.settings.train.objective.kl_coef else ())
    shapes = _packed_shapes(setup, "update")
    if shapes is None:
        batch = _abstract_batch(setup, setup.minibatch_rows, keys)
        s = _symbols(setup, setup.micro_batch_rows)
    else:  # the per-sequence arrays beside the worst case's packed rows
        batch = {**_abstract_batch(setup, setup.minibatch_rows, keys[3:]),
                 **_abstract_packed(setup, shapes)}
        s = _packed_symbols(setup, shapes)
    fn = setup.learner.update_fn(setup.params, setup.opt_state, batch, setup.frozen)
    lowered = fn.lower(setup.params, setup.opt_state, batch, setup.frozen)
    b, T, E, M, Q, K, V, t, cb = (s[k] for k in ("b", "T", "E", "M", "Q", "K", "V", "t", "cb"))
    accumulate = setup.learner.num_micro_batches > 1
    remat = str(setup.learner.model.remat)
    saved_formula, saved_values = _SAVED[remat]
    parts = _frozen_part(setup) + (
        ("params" if setup.lora is None else "LoRA adapter", "Pd", s["Pd"]),
        ("optimizer state (Adam mu, nu)", "2Pd", 2 * s["Pd"]),
        ("gradients (accumulator + micro-batch)" if accumulate else "gradients",
         "2Pd" if accumulate else "Pd", (2 if accumulate else 1) * s["Pd"]),
    ) + (_lora_weights_at_work(setup, s) if setup.lora is not None else (
        ("stacked layer weights + their gradients", "2Pl * cb/4", 2 * s["Pl"] * cb // 4),
        _weights_at_work(s),
        ("LM head + embedding gradients before reduce-scatter", "2E*V/t * 4", 2 * E * V // t * 4),
    )) + (
        (f"saved activations (remat={remat})", f"L*b*T*[{saved_formula}] * cb",
         s["L"] * b * T * saved_values(s) * cb),
        ("one layer's backward at work", "b*T*(8M/t + 4E + 3(Q+2K)/t) * cb",
         b * T * ((8 * M + 3 * (Q + 2 * K)) // t + 4 * E) * cb),
        ("logits chunk (logits, probabilities, gradient)", "3*b*C*V/t * 4",
         3 * b * s["C"] * V // t * 4),
    )
    return Program(lowered, Estimate(parts, s))


def learner_logprobs(setup: Setup) -> Program:
    """Log-probs of the whole rollout batch under the learner's parameters (no gradient)."""
    keys = ("tokens", "positions", "attn_mask", "resp_mask", "logp_behav")
    shapes = _packed_shapes(setup, "logprobs")
    if shapes is None:
        batch = _abstract_batch(setup, setup.rollout_rows, keys)
        s = _symbols(setup, setup.learner.logprob_batch_size or setup.rollout_rows)
    else:  # `Learner.logprobs` passes only these keys of a packed batch
        batch = _abstract_packed(setup, shapes)
        if shapes.seq_index:
            batch.update(_abstract_batch(setup, setup.rollout_rows, ("resp_mask",)))
        s = _packed_symbols(setup, shapes)
    lowered = setup.learner.logprobs_fn(setup.params, batch, setup.frozen).lower(
        setup.params, batch, setup.frozen)
    b, T, E, M, Q, K, V, t, cb = (s[k] for k in ("b", "T", "E", "M", "Q", "K", "V", "t", "cb"))
    rows_per_device = setup.rollout_rows // (setup.settings.mesh.data * setup.settings.mesh.fsdp)
    parts = _frozen_part(setup) + (
        ("params" if setup.lora is None else "LoRA adapter", "Pd", s["Pd"]),
        ("stacked layer weights", "Pl * cb/4", s["Pl"] * cb // 4),
        _weights_at_work(s),
        ("hidden states (residual stream in and out)", "2*b*T*E * cb", 2 * b * T * E * cb),
        ("one layer's forward at work", "b*T*(3M/t + 2E + 2(Q+2K)/t) * cb",
         b * T * ((3 * M + 2 * (Q + 2 * K)) // t + 2 * E) * cb),
        ("logits chunk (f32 and compute-dtype logits)", "b*C*V/t * (4 + cb)",
         b * s["C"] * V // t * (4 + cb)),
        ("log-probs of the whole rollout (output)", "rows/device * G * 4",
         rows_per_device * s["G"] * 4),
    )
    if shapes is not None and shapes.by_token:
        devices = setup.settings.mesh.data * setup.settings.mesh.fsdp
        parts += (("every packed position's log-prob (resp_flat reads them)",
                   "packed rows/device * T * 4", -(-shapes.rows // devices) * T * 4),)
    return Program(lowered, Estimate(parts, s))


def requantize(setup: Setup) -> Program:
    """The rollout actor made from the learner's parameters, every step."""
    lowered = setup.requantize_fn.lower(setup.params)
    s = _symbols(setup, setup.rollout_rows)
    actor = tree_bytes_per_device(setup.learner_actor)
    return Program(lowered, Estimate((("params (input)", "Pd", s["Pd"]),
                                      ("actor (output)", "codes + scales", actor)), s))


def reshard(setup: Setup) -> Program:
    """The actor's codes and scales moved from the learner's layout to the rollout's replicas,
    every step (`qurl_jax.parallel.rollout_layout.Reshard`): its largest bucket's program (the whole
    actor with `rollout.reshard_bucket_mib=0`). While it runs, the buckets before it are
    already on the replicas: the replica's share is in `rollout_decode`'s arguments."""
    r = setup.reshard
    src = max(r.buckets(setup.learner_actor), key=lambda b: tree_bytes_per_device(r.abstract(b)))
    lowered = r.fn(src).lower(src)
    out = r.abstract(src)
    s = _symbols(setup, setup.rollout_rows)
    return Program(lowered, Estimate((
        ("a bucket of the actor on the learner's layout (input)", "codes + scales / devices",
         tree_bytes_per_device(src)),
        ("its replica share (output)", "codes + scales / rollout.tensor",
         tree_bytes_per_device(out))), s))


def _rollout_sampler(setup: Setup) -> tuple[Any, int, int]:
    """The run's rollout sampler at the config's largest shapes, the rows of one call (a chunk
    of the static sampler, or every row of a refilling one) and the rows it decodes at once (the
    chunk, or the refilling sampler's slots)."""
    run, rollout = setup.settings, setup.settings.rollout
    sampler = build_rollout_sampler(
        setup.model_config, setup.dot_general, rollout.sampler,
        prompt_buckets=(setup.prompt_len,), gen_buckets=(setup.response_len,),
        mesh=setup.rollout_mesh, platform=targets.platform_of(setup.mesh))
    rows = sampler.rows_per_chunk(run.data.prompts_per_step, rollout.n)
    refill = rollout.sampler.refills
    slots = min(rollout.sampler.max_concurrent_rows or rows, rows) if refill else rows
    return sampler, rows, slots


def _rollout(setup: Setup, name: str) -> Program:
    rollout = setup.settings.rollout
    sampler, rows, slots = _rollout_sampler(setup)
    return _sampler_program(setup, name, sampler, setup.actor, rows, slots, rollout.n,
                            setup.response_len, refill=rollout.sampler.refills,
                            kv_pages=rollout.sampler.kv_pages,
                            kv_page_size=rollout.sampler.kv_page_size)


def _sampler_program(setup: Setup, name: str, sampler: Any, actor: Any, rows: int, slots: int,
                     n: int, response_len: int, *, refill: bool, kv_pages: int = 0,
                     kv_page_size: int = 0) -> Program:
    """A sampler's `name` program ('prefill' or 'decode') on the rollout's replicas: `rows` a
    call (a static chunk, or every row of a refilling sampler), `slots` decoded at once, `n`
    samples a prompt, prompts of `setup.prompt_len`, responses of `response_len`."""
    lowered = sampler.lower_programs(actor, rows, setup.prompt_len, response_len, n=n)[name]
    shards = setup.replicas
    t = int(setup.rollout_mesh.shape["tensor"])
    s = {**_symbols(setup, slots), "b": max(slots // shards, 1), "t": t,
         "G": response_len, "T": setup.prompt_len + response_len}
    m = setup.model_config
    b, V = s["b"], s["V"]
    kv_heads = max(m.num_kv_heads // t, 1)
    # Keys and values of one token, every layer, at rollout.kv_precision: 2*Hkv*D * cb, or
    # 8-bit codes and a float32 scale per kv head, 2*Hkv*(D + 4).
    precision = sampler.engine.kv_precision
    token = s["L"] * precision.bytes_per_token(kv_heads, m.head_dim, m.compute_dtype)
    kb = "(D+4)" if precision.quantizes else "D * cb"  # a kv head's bytes per token, K or V
    if kv_pages:  # the pool replaces the rows' slots
        pages = kv_pages // shards
        kv = (f"KV page pool (keys and values, every layer; rollout.kv_pages, "
              f"{precision.value})",
              f"2*L*(kv_pages/replicas)*page_size*max(Hkv/t,1)*{kb}",
              pages * kv_page_size * token)
        s = {**s, "pages": pages, "page_size": kv_page_size}
    else:
        kv = (f"KV cache (keys and values, every layer, {precision.value})",
              f"2*L*b*S*max(Hkv/t,1)*{kb} (S slots: T, or budget + interval with "
              "rollout.kv_policy)",
              b * sampler.engine.cache_slots(setup.prompt_len, response_len) * token)
    parts = (
        ("actor parameters", "codes + scales per device", tree_bytes_per_device(actor)),
        kv,
        ("last-position logits and sampling", "2*b*V/t * 4", 2 * b * V // t * 4),
    ) + ((("prompt activations at work", "b*P*(3M/t + 2E + 2(Q+2K)/t) * cb",
           b * setup.prompt_len * ((3 * s["M"] + 2 * (s["Q"] + 2 * s["K"])) // t + 2 * s["E"])
           * s["cb"]),) if name == "prefill" else ()) + ((
        ("row-indexed outputs of every row (refill)",
         "rows/device * G * 13 (tokens, two log-probs, mask)",
         max(rows // shards, 1) * s["G"] * 13),
        ("held prompt prefills (refill; one per batch shard, whole on every device)",
         f"replicas * 2*L*P*max(Hkv/t,1)*{kb}",
         shards * sampler.engine.prefill_slots(setup.prompt_len) * token)) if refill else ())
    counts = {"rows per call": rows, "slots": slots} if refill else {"rows per chunk": rows}
    return Program(lowered, Estimate(parts, {**s, **counts}))


def _eval(setup: Setup, name: str) -> Program:
    """The evaluation sampler's program (`build_eval_sampler`: its KV cache dense or, with
    `eval.kv_cache='rollout'`, the rollout's compressed one, the full-precision actor in the
    compute dtype on the rollout's replicas, as `Trainer.evaluate` samples it) for a call of
    `eval.max_examples` (or else `data.prompts_per_step`) problems with as many of `eval.k`
    samples a problem as a call draws (`sampling.factory.samples_per_call`), responses of
    `eval.max_new_tokens`: with `rollout.max_concurrent_rows`, the refilling sampler's programs
    over that many slots (the call's rows wait for them), else the static sampler's one chunk of
    every row."""
    from qurl_jax.sampling.factory import samples_per_call

    run = setup.settings
    g = run.eval.max_new_tokens
    hook = {"dot_general": setup.dot_general} if setup.lora is not None else {}
    sampler = build_eval_sampler(
        setup.model_config, run.rollout.sampler, run.eval.kv_cache == "rollout",
        prompt_buckets=(setup.prompt_len,), gen_buckets=(g,), mesh=setup.rollout_mesh,
        platform=targets.platform_of(setup.mesh), **hook)
    k = samples_per_call(sampler, max(run.eval.k, 1))
    rows = sampler.rows_per_chunk(run.eval.max_examples or run.data.prompts_per_step, k)
    slots = min(sampler.max_concurrent_rows or rows, rows)
    return _sampler_program(setup, name, sampler, setup.eval_actor, rows, slots, k, g,
                            refill=bool(run.rollout.sampler.max_concurrent_rows))


def eval_prefill(setup: Setup) -> Program:
    """The evaluation's prompt pass of one chunk, with the full-precision actor."""
    return _eval(setup, "prefill")


def eval_decode(setup: Setup) -> Program:
    """The evaluation's decode loop of one chunk, with the full-precision actor."""
    return _eval(setup, "decode")


def rollout_prefill(setup: Setup) -> Program:
    """The prompt pass of one rollout chunk (n samples of a prompt share it); with
    `rollout.refill`, the insert that prefills prompts into every slot at once."""
    return _rollout(setup, "prefill")


def rollout_decode(setup: Setup) -> Program:
    """The decode loop of one rollout chunk, every new token of it; with `rollout.refill`, the
    decode loop over the slots, which also holds every row's outputs."""
    return _rollout(setup, "decode")


def decode_kv(setup: Setup) -> dict[str, int] | None:
    """The KV cache the `rollout_decode` program holds, per device, from the cache's shapes and
    shardings (nothing compiled); None when `rollout.kv_policy` compresses the cache (its slots
    are not a row's tokens).

    rows: rows decoded at once on a device (the slots, or a paged pool's page-table rows, over
    the batch shards); cache_len: cache slots per row (prompt + max_new_tokens; a paged row's
    logical slots); cache_bytes: bytes of keys and values of every layer (positions and page
    table not counted): the rows' slots, or with `rollout.kv_pages` the page pool's share of
    this device; token_bytes: those bytes per token (the kv heads this device holds, compute
    dtype); prompt_len, max_new_tokens: the config's; rollout_rows: the rollout's rows per
    device (prompts_per_step x n over the batch shards); batch_shards: data x fsdp;
    layer_elements: elements of one layer's keys on this device; kv_dtype: their dtype (the
    compute dtype's, or the 8-bit codes'). With a pool also pages (this device's) and
    page_size."""
    sampler, _, slots = _rollout_sampler(setup)
    engine = sampler.engine
    if engine.kv_policy.compresses:
        return None
    cache_len = engine.cache_slots(setup.prompt_len, setup.response_len)
    cache = engine.layout.abstract(slots, cache_len)
    cache_bytes = tree_bytes_per_device((cache.k, cache.v, cache.k_scale, cache.v_scale))
    shards = setup.replicas
    layer = cache.k[0].sharding.shard_shape(cache.k[0].shape)
    out = {"cache_len": int(cache_len), "cache_bytes": cache_bytes,
           "layer_elements": int(np.prod(layer)), "kv_dtype": str(cache.k[0].dtype),
           "prompt_len": setup.prompt_len, "max_new_tokens": setup.response_len,
           "rollout_rows": max(setup.rollout_rows // shards, 1), "batch_shards": shards}
    if isinstance(cache, PagedKVCache):  # pools f[Hkv, P, page_size, D], pages over the shards
        rows = cache.page_table.sharding.shard_shape(cache.page_table.shape)[0]
        pages = cache.k[0].sharding.shard_shape(cache.k[0].shape)[1]
        return {"rows": int(rows), **out, "token_bytes": cache_bytes // (pages * cache.page_size),
                "pages": int(pages), "page_size": int(cache.page_size)}
    rows = cache.k[0].sharding.shard_shape(cache.k[0].shape)[0]
    return {"rows": int(rows), **out, "token_bytes": cache_bytes // (rows * cache_len)}


PROGRAMS: dict[str, Callable[[Setup], Program]] = {
    "learner_update": learner_update,
    "learner_logprobs": learner_logprobs,
    "requantize": requantize,
    "reshard": reshard,
    "rollout_prefill": rollout_prefill,
    "rollout_decode": rollout_decode,
    "eval_prefill": eval_prefill,
    "eval_decode": eval_decode,
}


def model_shape(model: ModelSettings, shapes_dir: str) -> ModelConfig:
    """The `ModelConfig` of `model` from its config.json, or a GGUF file's metadata (no tensor
    read), without weights."""
    path = model.path
    if model.source == "gguf":
        from qurl_jax.models.gguf import config_from_gguf

        try:
            shape = config_from_gguf(path)
        except ValueError as e:  # names the file
            raise PlanError(f"config.model.path: {e}") from None
        return shape.replace(dtype=model.dtype, attention=model.attention)
    if model.source != "hf":
        raise PlanError(f"config.model.source={model.source!r}: the memory report needs "
                         "a model shape (source 'hf' or 'gguf')")
    candidates = [os.path.join(path, "config.json"),
                  os.path.join(shapes_dir, os.path.basename(os.path.normpath(path)) + ".json")]
    for candidate in candidates:
        if os.path.isfile(candidate):
            with open(candidate) as f:
                shape = hf.config_from_hf(json.load(f))
            return shape.replace(dtype=model.dtype, attention=model.attention)
    raise PlanError(f"config.model.path={path!r}: no model shape in {candidates}")


def build_setup(settings: RunSettings, model_config: ModelConfig,
                devices: list[jax.Device] | None = None) -> Setup:
    """Mesh (`settings.mesh` on `devices`, default this process's), learner and abstract state."""
    mesh = shd.make_mesh(settings.mesh.data, settings.mesh.fsdp, settings.mesh.tensor,
                         devices=devices)
    learner = settings.train.learner(model_config, mesh, temperature=settings.rollout.temperature,
                                     rollout_rows=settings.rollout_rows,
                                     update_capture=settings.update_capture,
                                     lora=settings.model.lora)
    return setup_for(settings, model_config, mesh, learner)


def setup_for(settings: RunSettings, model_config: ModelConfig, mesh: Mesh,
              learner: Learner) -> Setup:
    """The `Setup` of a run's own mesh and learner (what the trainer's preflight compiles); its
    settings' `mesh` is the mesh's total axis sizes (-1 resolved, `mesh.dcn` folded in), so the
    planner's per-device arithmetic reads real sizes."""
    settings = dataclasses.replace(settings, mesh=MeshSizes.of(mesh))
    shapes = jax.eval_shape(lambda: init_params(model_config, jax.random.key(0)))
    if settings.model.lora.enabled:  # the trained state: the adapter (the base is `frozen`)
        shapes = lora.adapter_shapes(shapes, settings.model.lora)
    params, opt_state = learner.abstract_state(shapes)
    rows = settings.rollout_rows
    return Setup(settings=settings, model_config=model_config, mesh=mesh, learner=learner,
                 params=params, opt_state=opt_state, rollout_rows=rows,
                 minibatch_rows=rows // settings.train.num_minibatches,
                 micro_batch_rows=settings.train.micro_batch_rows(rows),
                 prompt_len=settings.data.max_prompt_len,
                 response_len=settings.rollout.max_new_tokens)


def compiled_memory(compiled: jax.stages.Compiled) -> dict[str, int]:
    """argument / output / temp / peak bytes per device of a compiled program.

    peak = arguments + outputs - aliased (donated arguments reused as outputs) + temps: every
    buffer live at once, an upper bound of the true peak. (XLA:CPU's own `peak_memory_in_bytes`
    counts only the arguments.)"""
    m = compiled.memory_analysis()
    peak = (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)
    return {"argument_bytes": int(m.argument_size_in_bytes),
            "output_bytes": int(m.output_size_in_bytes),
            "temp_bytes": int(m.temp_size_in_bytes), "peak_bytes": int(peak)}


def _whole_slice_of(target: targets.Target, settings: RunSettings, used: int, total: int
                    ) -> targets.Target:
    """The slice of `target`'s chip with the `used` devices a mesh smaller than the target takes:
    a compile-only topology compiles for a whole slice, and libtpu refuses a program over a subset
    of one (a RET_CHECK on the device ids). `PlanError` naming `mesh` when there is no such slice
    (fewer chips than the smallest)."""
    chip = target.chip
    assert chip is not None
    count = used * chip.cores_per_name_unit if chip.platform == "tpu" else used
    try:
        return targets.parse(f"{chip.platform}:{chip.name}-{count}")
    except targets.TargetError:
        m = settings.mesh
        raise PlanError(
            f"target {target.name!r}: mesh data={m.data} fsdp={m.fsdp} tensor={m.tensor} uses "
            f"{used} of its {total} devices, and no {chip.name} slice has {used}; set one mesh "
            f"axis to -1 (--config.mesh.fsdp=-1) to plan all {total}") from None


def budget_bytes(target: targets.Target) -> int:
    """What a program may plan per device on `target`: `FIT_FRACTION` of the chip's memory, or
    `CPU_BUDGET_GIB` on the `cpu` target."""
    if target.memory_bytes is None:
        return int(CPU_BUDGET_GIB * GIB)
    return int(FIT_FRACTION * target.memory_bytes)


def report(settings: RunSettings, shapes_dir: str,
           target: targets.Target | str = "cpu", log: Callable[[str], None] = print,
           programs: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Compiles every program of `PROGRAMS` (or those named) for a run's `settings` with
    `target`'s compiler, their mesh on its first devices; returns the JSON-able figures: the target
    (name, platform, device kind, memory per device), the budget, and per program its argument /
    output / temp / peak bytes per device (`programs`), seconds to lower and compile
    (`compile_s`) and whether its peak is within the budget (`fits`); with `rollout_decode`
    among them, its KV cache per device (`decode_kv`)."""
    target = targets.parse(target) if isinstance(target, str) else target
    unknown = set(programs or ()) - set(PROGRAMS)
    if unknown:
        raise PlanError(f"--programs: unknown {sorted(unknown)}; known: {list(PROGRAMS)}")
    model_config = model_shape(settings.model, shapes_dir).replace(
        numerics=settings.train.on_policy_numerics)
    devices = target.devices()
    try:
        setup = build_setup(settings, model_config, devices)
    except shd.MeshError as e:
        raise PlanError(f"target {target.name!r}: {e}; set one mesh axis to -1 "
                        "(--config.mesh.fsdp=-1) to use the target's devices") from None
    requested = target
    if target.compile_only and setup.mesh.size < len(devices):
        target = _whole_slice_of(target, settings, setup.mesh.size, len(devices))
        devices = target.devices()
        setup = build_setup(settings, model_config, devices)
        m = settings.mesh
        log(f"mesh data={m.data} fsdp={m.fsdp} tensor={m.tensor} uses {setup.mesh.size} of the "
            f"{len(requested.devices())} devices of {requested.name}: a run there leaves the "
            "others idle (with a warning; set one mesh axis to -1 to use them all), so this "
            f"plans the devices it uses, as {target.name}")
    c = setup.settings
    budget = budget_bytes(target)
    described = target.describe()
    log(f"target {target.name}: {described['device_kind']} ({described['platform']}), "
        f"{len(devices)} devices, budget {budget / GIB:.2f} GiB per device")
    note = native_pick.rollout_note(c.rollout.precision,
                                    native_pick.chip_of(str(described["device_kind"])))
    if note:
        log(note)
    log(f"model {os.path.basename(c.model.path)}: {model_config.num_params / 1e9:.2f}B params, "
        f"dtype {model_config.dtype}, attention {model_config.attention}, remat {c.train.remat}")
    log(f"mesh data={c.mesh.data} fsdp={c.mesh.fsdp} tensor={c.mesh.tensor} "
        f"({setup.mesh.size} devices); sequence {setup.prompt_len} + {setup.response_len}; "
        f"rollout {setup.rollout_rows} rows, minibatch {setup.minibatch_rows}, micro-batch "
        f"{setup.micro_batch_rows}")
    if requested is not target:
        described["requested_target"] = requested.name
    out: dict[str, Any] = {**described, "devices": setup.mesh.size,
                           "budget_bytes_per_device": budget, "programs": {}, "compile_s": {},
                           "fits": {}}
    log("per program: the compiler's plan (what decides the fit), then the analytic estimate "
        "(the arrays the program must hold, by formula: no fusion temporaries or collective "
        "buffers, so a compiled peak well above it is the compiler's working memory)")
    out["refused"] = {}
    if setup.lora is not None:
        log(f"LoRA rank {setup.lora.rank} on a frozen {setup.lora.base_precision} base: "
            f"{tree_bytes_per_device(setup.frozen) / GIB:.2f} GiB of base per device, read by "
            "every program below; no requantize, the reshard moves the adapter "
            f"({tree_bytes_per_device(setup.params) / GIB:.3f} GiB)")
    wanted = programs or tuple(n for n in PROGRAMS if n not in _LORA_SKIPS or setup.lora is None)
    for name, build in ((n, b) for n, b in PROGRAMS.items() if n in wanted):
        start = time.perf_counter()
        program = build(setup)
        try:
            compiled = program.lowered.compile()
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            line = next(x for x in str(e).splitlines() if "RESOURCE_EXHAUSTED" in x).strip()
            out["refused"][name] = line[:400]
            out["fits"][name] = False
            out["compile_s"][name] = round(time.perf_counter() - start, 1)
            log(f"\n{name}: DOES NOT FIT: the compiler refused it for want of device memory "
                f"({line[:400]})")
            continue
        figures = compiled_memory(compiled)
        seconds = time.perf_counter() - start
        fits = figures["peak_bytes"] <= budget
        out["programs"][name] = figures
        out["compile_s"][name] = round(seconds, 1)
        out["fits"][name] = fits
        log(f"\n{name} (lowered + compiled in {seconds:.0f} s), per device, GiB:")
        log("  compiled: " + "  ".join(f"{k.removesuffix('_bytes')} {v / GIB:.2f}"
                                       for k, v in figures.items())
            + f"  -> {'fits' if fits else 'DOES NOT FIT'} in {budget / GIB:.2f} GiB")
        ratio = figures["peak_bytes"] / max(program.estimate.total, 1)
        log(f"  estimate: {program.estimate.total / GIB:.2f}"
            + (f" (the compiled peak is {ratio:.1f}x: compiler temporaries the formula does "
               "not count)" if ratio > 1.5 else ""))
        for part, formula, value in program.estimate.parts:
            log(f"    {value / GIB:7.2f}  {part:50s} {formula}")
        log("    with " + ", ".join(f"{k}={v}" for k, v in program.estimate.symbols.items()))
        if name == "rollout_decode" and setup.mesh.size > 1:  # what the decode loop moves
            try:
                found = collectives.loop_body_collectives(compiled.as_text())
            except collectives.HloError as e:  # a program without a loop: say so, go on
                log(f"  decode loop: not read ({e})")
            else:
                out["decode_collectives"] = collectives.to_json(found)
                log("  decode loop, per token per device: "
                    + "\n  ".join(collectives.describe(found)))
    if "rollout_decode" in out["programs"]:
        out["decode_kv"] = decode_kv(setup)
    out["verdict"] = verdict(out, target.name, lambda name: knobs(name, setup))
    log("\n" + out["verdict"])
    return out


def verdict(figures: dict[str, Any], target_name: str, knobs_of: Callable[[str], str]) -> str:
    """The report's last line: whether every program fits `target_name`'s budget, the largest
    and its margin; else each program that does not, by how much, and the config fields that
    shrink it."""
    budget = figures["budget_bytes_per_device"]
    planned = figures["programs"]
    over = [n for n, ok in figures["fits"].items() if not ok]
    if not over:
        name = max(planned, key=lambda n: planned[n]["peak_bytes"])
        peak = planned[name]["peak_bytes"]
        return (f"verdict: FITS on {target_name}: all {len(planned)} programs within "
                f"{budget / GIB:.2f} GiB per device; the largest, {name}, peaks at "
                f"{peak / GIB:.2f} GiB ({(budget - peak) / GIB:.2f} GiB to spare)")
    parts = []
    for name in over:
        if name in planned:
            peak = planned[name]["peak_bytes"]
            what = f"{name} needs {peak / GIB:.2f} GiB ({(peak - budget) / GIB:.2f} over)"
        else:
            what = f"{name} was refused by the compiler"
        parts.append(f"{what}: change {knobs_of(name)}")
    return (f"verdict: DOES NOT FIT on {target_name} ({budget / GIB:.2f} GiB per device): "
            + "; ".join(parts))


# The config fields that shrink each program, named by the preflight's error.
KNOBS = {
    "learner_update": "rl.num_micro_batches (more, smaller micro-batches), train.remat ('full'), "
                      "train.logprob_chunk (smaller), mesh.fsdp / mesh.tensor (more devices)",
    "learner_logprobs": "rl.num_micro_batches (log-prob slices are one micro-batch), "
                        "train.logprob_chunk (smaller), mesh.fsdp / mesh.tensor",
    "requantize": "mesh.fsdp / mesh.tensor (parameters spread over more devices)",
    "reshard": "rollout.tensor (each replica over more devices)",
    "rollout_prefill": "rollout.max_concurrent_rows (smaller chunks), rollout.tensor (each "
                       "replica over more devices)",
    "rollout_decode": "rollout.max_concurrent_rows (smaller chunks; the KV cache is per row), "
                      "rollout.kv_pages (a smaller pool, when paged), rollout.tensor (each "
                      "replica over more devices)",
    "eval_prefill": "rollout.max_concurrent_rows (the evaluation's slots too), "
                    "rollout.tensor (each replica over more devices)",
    "eval_decode": "rollout.max_concurrent_rows (the evaluation's slots too), "
                   "eval.max_examples (fewer rows a call), eval.max_new_tokens (a shorter "
                   "cache), rollout.tensor",
}


# With train.packing the learner programs run on packed rows: these come first.
PACKED_KNOBS = {
    "learner_update": "train.tokens_per_micro_batch (fewer packed tokens per micro-batch), "
                      "train.pack_length (shorter packed rows, at least the longest sequence)",
    "learner_logprobs": "train.tokens_per_micro_batch (fewer packed tokens per slice), "
                        "train.pack_length (shorter packed rows, at least the longest sequence)",
}


def knobs(name: str, setup: Setup) -> str:
    """The config fields that shrink program `name` of this run (`KNOBS`, with `PACKED_KNOBS`
    first when the learner packs)."""
    if setup.learner.packing and name in PACKED_KNOBS:
        return f"{PACKED_KNOBS[name]}, {KNOBS[name]}"
    return KNOBS[name]


class MemoryPlanError(UserError):
    """A program of the run needs more memory per device than the device has."""

    what = "does not fit"


# A LoRA run never requantizes, and its reshard is the adapter's copy: neither is a program of it.
_LORA_SKIPS = ("requantize", "reshard")


def run_programs(settings: RunSettings) -> tuple[str, ...]:
    """The `PROGRAMS` a run of `settings` executes: all but `learner_logprobs` when pi_prox comes
    from the update's own forward and there is no reference policy
    (`RunSettings.learner_logprobs`), and with LoRA none of `_LORA_SKIPS`."""
    lora_run = settings.model.lora.enabled
    return tuple(n for n in PROGRAMS if (n != "learner_logprobs" or settings.learner_logprobs)
                 and not (lora_run and n in _LORA_SKIPS))


def preflight(setup: Setup, limit_bytes: int,
              log: Callable[[str], None] = print) -> dict[str, dict[str, int]]:
    """Compiles every program the run executes (`run_programs`) before its first step and raises
    `MemoryPlanError` naming each program whose per-device peak exceeds `limit_bytes`, its figure
    and the knobs that shrink it; returns the figures otherwise."""
    figures, over = {}, []
    kind = setup.mesh.devices.flat[0].device_kind
    note = native_pick.rollout_note(setup.settings.rollout.precision, native_pick.chip_of(kind))
    if note:
        log(f"preflight: {note}")
    for name in run_programs(setup.settings):
        figures[name] = compiled_memory(PROGRAMS[name](setup).lowered.compile())
        peak = figures[name]["peak_bytes"]
        log(f"preflight {name} ({kind}): peak {peak / GIB:.2f} GiB per device of "
            f"{limit_bytes / GIB:.2f}")
        if peak > limit_bytes:
            over.append(f"{name} needs {peak / GIB:.2f} GiB per device, more than the "
                        f"{limit_bytes / GIB:.2f} GiB limit; change {knobs(name, setup)}")
    if over:
        raise MemoryPlanError("memory preflight: " + "; ".join(over))
    return figures
