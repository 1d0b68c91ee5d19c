"""Tests for qurl_jax.parallel.rollout_layout: the rollout's replicas over the learner's devices and
the once-per-step reshard of the quantized actor into them.

Expected values come from one-device samplers on the one-device requantized actor (themselves
tested against transformers in test_sampler.py): the actor requantized on the learner's FSDP
mesh, resharded, and sampled on the rollout mesh must give the same tokens and (float32)
log-probs, for the static, refilling and paged samplers at rollout.tensor 1 and 2.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from qurl_jax import quant
from qurl_jax.models import param_logical_axes
from qurl_jax.parallel import rollout_layout as rl
from qurl_jax.parallel.sharding import make_mesh, shard_params
from qurl_jax.quant import QuantizedTensor
from qurl_jax.runtime import sizes
from qurl_jax.runtime.errors import MeshError
from qurl_jax.sampling import RefillSampler, Sampler, SamplingParams
from tests.test_refill import LIMITS, PROMPTS6, _assert_prefix_equal
from tests.test_sampler import TINY, _random_params

KW = dict(max_prompt_len=16, max_new_tokens=16)


@pytest.fixture(scope="module")
def qwen() -> tuple:
    cfg = TINY["qwen2"]
    return cfg, _random_params(cfg)


def _learner_mesh(tensor: int):
    # The learner's layout: FSDP over the devices the rollout tensor group does not take.
    return make_mesh(data=1, fsdp=8 // tensor, tensor=tensor)


def _resharded(cfg, params, recipe: str, tensor: int):
    """(rollout mesh, the actor requantized on the learner's mesh and resharded, Reshard)."""
    learner = _learner_mesh(1)
    master = shard_params(params, param_logical_axes(cfg), learner)
    actor = quant.requantize(master, recipe)
    mesh = rl.rollout_mesh(learner, tensor)
    reshard = rl.Reshard(param_logical_axes(cfg), mesh)
    return mesh, reshard(actor), reshard


def _sampler(kind: str, cfg, hook, **kw):
    if kind == "static":
        return Sampler(cfg, hook, **KW, **kw)
    if kind == "refill":
        return RefillSampler(cfg, hook, **KW, refill_min=1, **kw)
    return RefillSampler(cfg, hook, **KW, refill_min=1, kv_pages=8 * 4, kv_page_size=8, **kw)


SLOW = pytest.mark.slow  # a sampler's programs compiled twice (one device, 8 devices) each


@pytest.mark.parametrize("kind, tensor", [
    pytest.param(kind, tensor, marks=SLOW) for kind in ("static", "refill", "paged")
    for tensor in (1, 2)])
def test_same_tokens_as_one_device_int8(qwen, kind, tensor) -> None:
    cfg, params = qwen
    recipe = "int8"
    hook = quant.make_dot_general(recipe)
    mesh, actor, _ = _resharded(cfg, params, recipe, tensor)
    # Greedy: an int8 activation code is a rounding of a float that the layout's reduction
    # order moves by an ulp, so sampled int8 rows can part where a draw sits on a boundary (on
    # main's learner mesh with data=2 too); the float actor's test below draws with
    # the key.
    kw = dict(key=jax.random.key(5), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                  greedy=True))
    ref = Sampler(cfg, hook, **KW).sample(quant.requantize(params, recipe), PROMPTS6, **kw)
    replicas = 8 // tensor
    extra = {} if kind == "static" else dict(max_concurrent_rows=2 * replicas)
    out = _sampler(kind, cfg, hook, mesh=mesh, **extra).sample(
        actor, PROMPTS6, **kw, **({} if kind == "static" else dict(length_limits=LIMITS)))
    if kind == "static":
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
        np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), atol=1e-4)
    else:
        _assert_prefix_equal(out, ref, LIMITS, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("recipe, tensor", [("fp8", 2), ("fp8_block", 1), ("fp8_block", 2)])
def test_same_tokens_as_one_device_fp8(qwen, recipe, tensor) -> None:
    cfg, params = qwen
    hook = quant.make_dot_general(recipe)
    mesh, actor, _ = _resharded(cfg, params, recipe, tensor)
    kw = dict(key=jax.random.key(6), n=2, settings=SamplingParams(max_new_tokens=12,
                                                                  greedy=True))
    ref = Sampler(cfg, hook, **KW).sample(quant.requantize(params, recipe), PROMPTS6, **kw)
    out = Sampler(cfg, hook, **KW, mesh=mesh).sample(actor, PROMPTS6, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logp), np.asarray(ref.logp), atol=1e-4)


@pytest.mark.slow
def test_same_draws_as_one_device_float_actor(qwen) -> None:
    # The rows' random streams on the replicas: sampled, top-k, the float ('fp') actor (no
    # activation rounding to part the rows).
    cfg, params = qwen
    mesh, actor, _ = _resharded(cfg, params, "fp", 2)
    kw = dict(key=jax.random.key(7), n=2, settings=SamplingParams(max_new_tokens=16,
                                                                  temperature=0.8, top_k=40))
    ref = Sampler(cfg, **KW).sample(params, PROMPTS6, **kw)
    out = RefillSampler(cfg, **KW, mesh=mesh, max_concurrent_rows=8, refill_min=1).sample(
        actor, PROMPTS6, length_limits=LIMITS, **kw)
    _assert_prefix_equal(out, ref, LIMITS)


def test_rollout_mesh_is_the_learners_devices_in_replicas(qwen) -> None:
    learner = make_mesh(data=2, fsdp=4)
    mesh = rl.rollout_mesh(learner, 2)
    assert dict(mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
    assert list(mesh.devices.flat) == list(learner.devices.flat)
    with pytest.raises(MeshError, match=r"rollout.tensor=3 does not divide"):
        rl.rollout_mesh(learner, 3)


@pytest.mark.parametrize("recipe", ["int8", "fp8_block"])
def test_actor_layout_is_replicas_heads_over_tensor(qwen, recipe) -> None:
    cfg, params = qwen
    mesh, actor, _ = _resharded(cfg, params, recipe, 2)
    layer = actor["layers_0"]
    P = jax.sharding.PartitionSpec
    assert actor["embed_tokens"]["embedding"].sharding.spec == P(None, None)
    q = layer["self_attn"]["q_proj"]["kernel"]
    assert isinstance(q, QuantizedTensor) and q.qvalue.sharding.mesh is mesh
    assert q.qvalue.sharding.spec == P(None, "tensor")  # [embed, heads]: no fsdp
    down = layer["mlp"]["down_proj"]["kernel"]
    assert down.qvalue.sharding.spec == P("tensor", None)  # [mlp, embed]
    # Every device holds its replica's whole embedding and half the heads.
    assert q.qvalue.addressable_shards[0].data.shape == (cfg.hidden_size,
                                                         cfg.num_heads * cfg.head_dim // 2)


def _collective_dtypes(hlo: str) -> list[tuple[str, str]]:
    """(kind, result type) of every collective in an optimized HLO module's text."""

    kinds = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    out = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%\S+ = (\(?[a-z0-9]+\[[^=]*?) ([a-z-]+)\(", line)
        if m and m.group(2).removesuffix("-start") in kinds:
            out.append((m.group(2), m.group(1)))
    return out


def test_reshard_moves_codes_scales_and_no_float_kernel(qwen) -> None:
    cfg, params = qwen
    learner = _learner_mesh(1)
    master = shard_params(params, param_logical_axes(cfg), learner)
    from qurl_jax.learner.learner import Learner, OptimConfig
    from qurl_jax.rl.objectives import ObjectiveConfig

    lrn = Learner(cfg, ObjectiveConfig(), OptimConfig(), learner)
    opt_state = lrn.init_opt_state(master)
    before = jax.tree.map(np.asarray, (master, opt_state))
    shardings = jax.tree.map(lambda x: x.sharding, (master, opt_state))
    # The trainer's recipe: int8 with the vocabulary tables as int8 codes (rollout.quantize_vocab).
    recipe = quant.get_recipe("int8", quantize_vocab=True)
    actor = quant.requantize(master, recipe, compute_dtype=jnp.bfloat16)
    reshard = rl.Reshard(param_logical_axes(cfg), rl.rollout_mesh(learner, 1))
    hlo = reshard.fn(actor).lower(actor).compile().as_text()
    moved = _collective_dtypes(hlo)
    assert moved, "the reshard moved nothing"
    # Codes (s8) and vectors: scales (f32, one per output channel [1, out] or vocabulary entry
    # [V, 1]), norms and biases (bf16; XLA:CPU carries a bf16 all-gather in f32). No float
    # matrix: no kernel, no embedding or LM head in a float dtype.
    for kind, result in moved:
        dtype = result.split("[")[0].lstrip("(")
        assert dtype in ("s8", "f32", "bf16"), (kind, result)
        dims = tuple(int(d) for d in result.split("[")[1].split("]")[0].split(",") if d)
        if dtype != "s8":
            assert sum(d > 1 for d in dims) <= 1, (kind, result)
    assert any(r.startswith("s8[") and str(cfg.vocab_size) in r for _, r in moved)
    # Its arguments: codes, scales and compute-dtype leaves; no float32 kernel of the master.
    entry = hlo.split("entry_computation_layout={(", 1)[1].split(")->", 1)[0]
    assert not [a for a in re.findall(r"f32\[([0-9,]*)\]", entry)
                if sum(int(d) > 1 for d in a.split(",") if d) > 1], entry
    out = reshard(actor)
    # Learner state untouched: same values, same shardings, buffers alive.
    after = jax.tree.map(np.asarray, (master, opt_state))
    jax.tree.map(np.testing.assert_array_equal, before, after)
    assert jax.tree.map(lambda x: x.sharding, (master, opt_state)) == shardings
    q = out["layers_0"]["mlp"]["up_proj"]["kernel"]
    np.testing.assert_array_equal(
        np.asarray(q.qvalue), np.asarray(quant.requantize(params, "int8")["layers_0"]["mlp"]
                                         ["up_proj"]["kernel"].qvalue))
    moved_bytes = reshard.bytes(actor)
    assert moved_bytes.quantized_parameters == sum(
        int(np.prod(x.qvalue.shape)) for x in jax.tree.leaves(
            actor, is_leaf=lambda x: isinstance(x, QuantizedTensor))
        if isinstance(x, QuantizedTensor))
    # Per device: 7/8 of the codes (1 byte each) and of the per-channel scales; the whole actor
    # (norms and biases too) within the 1.1 bytes per quantized parameter.
    assert 0.8 < moved_bytes.codes / moved_bytes.quantized_parameters < 1.1
    assert moved_bytes.per_quantized_parameter < 1.1


def test_resolve_tensor_auto_and_errors() -> None:
    gib = 1 << 30
    kw = dict(kv_bytes=lambda t: gib // t, resident_bytes=2 * gib, local_devices=8,
              num_kv_heads=8)
    assert rl.resolve_tensor(None, replica_bytes=2 * gib, device_bytes=None, **kw) == 1
    assert rl.resolve_tensor(None, replica_bytes=2 * gib, device_bytes=16 * gib, **kw) == 1
    # 16 GiB replica + 1 GiB KV + 2 GiB learner: 19 > 12; / 2: 8 + 0.5 + 2 fits.
    assert rl.resolve_tensor(None, replica_bytes=16 * gib, device_bytes=12 * gib, **kw) == 2
    assert rl.resolve_tensor(4, replica_bytes=16 * gib, device_bytes=12 * gib, **kw) == 4
    with pytest.raises(MeshError, match=r"rollout.tensor=1: .* the device's 12.00 GiB"):
        rl.resolve_tensor(1, replica_bytes=16 * gib, device_bytes=12 * gib, **kw)
    with pytest.raises(MeshError, match=r"rollout.tensor=auto: even at 8"):
        rl.resolve_tensor(None, replica_bytes=200 * gib, device_bytes=12 * gib, **kw)
    assert rl.parse_tensor("auto") is None and rl.parse_tensor("2") == 2
    with pytest.raises(ValueError, match="config.rollout.tensor='x'"):
        rl.parse_tensor("x")


def test_plan_tensor_sizes_the_larger_of_the_rollout_and_evaluation_replicas(monkeypatch) -> None:
    # The evaluation samples the full-precision policy (compute dtype) on the same replicas, so
    # 'auto' must leave room for that replica too, not only for the int8 actor's.
    import os

    from qurl_jax.config.base import load_config_file
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.models import init_params
    from qurl_jax.train.tasks import model_config_for

    seen = {}
    monkeypatch.setattr(rl, "resolve_tensor", lambda setting, **kw: seen.update(kw) or 1)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    settings = RunSettings.from_config(load_config_file(os.path.join(repo,
                                                                     "configs/arith_tiny.py")))
    cfg = model_config_for(settings.model)
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    rl.plan_tensor(settings, cfg, make_mesh(fsdp=8), params, {}, None)
    size = jnp.dtype(cfg.compute_dtype).itemsize
    full = sum(int(np.prod(x.shape)) * size for x in jax.tree.leaves(params))
    int8 = jax.eval_shape(lambda p: quant.requantize(p, settings.rollout.precision,
                                                     compute_dtype=cfg.compute_dtype), params)
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(int8)) < full
    assert seen["replica_bytes"] == full


def test_tpu_decode_loop_moves_no_vocabulary_or_hidden_sized_operand(tmp_path) -> None:
    # Compiled by libtpu for a v5e-4 slice (no device): the learner's 2 x 2 (data x FSDP) mesh,
    # the rollout on 4 one-chip replicas. One iteration of the decode loop (a generated token)
    # may exchange per-slot flags, nothing the size of the vocabulary, the hidden state, the
    # MLP or the heads.
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.plan import collectives, memory_plan
    from tests.compile_only import compiler_or_skip
    from tests.test_targets import SHAPE, _step_config

    target = compiler_or_skip("tpu:v5e-4")
    settings = RunSettings.from_config(_step_config(tmp_path, rollout_precision="int8",
                                                    train_precision="fp", kv_policy="dense",
                                                    refill=False))
    model = memory_plan.model_shape(settings.model, str(tmp_path))
    setup = memory_plan.build_setup(settings, model, target.devices())
    assert dict(setup.rollout_mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 1}
    hlo = memory_plan.rollout_decode(setup).lowered.compile().as_text()
    found = collectives.loop_body_collectives(hlo)
    big = {SHAPE.vocab_size, SHAPE.hidden_size, SHAPE.intermediate_size,
           SHAPE.num_heads * SHAPE.head_dim}
    assert not [c for c in found if big & set(c.shape)], collectives.describe(found)
    assert sum(c.bytes for c in found) <= 1024, collectives.describe(found)


@pytest.mark.slow
def test_bench_layout_case_times_both_layouts_and_the_reshard(qwen, capsys) -> None:
    import argparse

    from qurl_jax.bench import sampler as bench

    cfg, params = qwen
    args = argparse.Namespace(tail_prompts=4, tail_n=2, new_tokens=8, prompt_len=4,
                              tail_slots=8, refill_min=0, rounds=1, rollout_tensor=1)
    figures = bench.layouts(cfg, params, args)
    assert figures["learner layout tok/s"] > 0 and figures["rollout layout tok/s"] > 0
    assert figures["reshard s"] > 0
    assert "rollout layout / learner layout tokens/s" in capsys.readouterr().out


@pytest.mark.slow  # ~3 min: three CLI runs, two of them in parallel processes
def test_two_processes_of_4_devices_match_one_process_of_8(tmp_path) -> None:
    # The rollout layout across processes: the learner's FSDP 4 x tensor 2 mesh over two
    # processes of 4 devices, the rollout on 4 replicas of rollout.tensor=2 (each within one
    # process), the static sampler; the same metrics (log-probs, rewards, updates) as
    # one process of 8 devices.
    from tests.test_multiprocess import (
        MESH,
        _assert_close_metrics,
        _Children,
        _comparable,
        _wait_ok,
    )

    children = _Children()
    two, one = str(tmp_path / "two"), str(tmp_path / "one")
    args = (*MESH, "--config.train.num_steps=2", "--config.rollout.refill=off",
            "--config.rollout.tensor=2")
    try:
        procs = children.start_group(two, *args, num=2, logs=two + ".log")
        single = children.start(one, *args, devices=8, log=one + ".log")
        _wait_ok([*procs, single], [two + ".log.0", two + ".log.1", one + ".log"])
    finally:
        children.kill_all()
    a, b = _comparable(two), _comparable(one)
    _assert_close_metrics(a, b)
    assert "rollout layout: 4 replicas x rollout.tensor=2" in open(two + ".log.0").read()
    assert a[(1, "train", "reshard/bytes_per_quantized_param")] > 0


def _tiny_run(**fields):
    import os

    from qurl_jax.config.base import load_config_file

    c = load_config_file(os.path.join(os.path.dirname(os.path.dirname(__file__)), "configs",
                                      "arith_tiny.py"))
    c.update_from_flattened_dict({"mesh.fsdp": 8, "train.preflight": "off", **fields})
    return c


@pytest.mark.parametrize("fields, match", [
    # rollout.n=8 on 8 one-device replicas: a static chunk needs 64 rows; at tensor 2 (4
    # replicas) 32 would do.
    ({"rollout.refill": "off", "rollout.max_concurrent_rows": 32},
     r"^config\.rollout\.max_concurrent_rows=32 holds no whole group on the rollout's 8 "
     r"replicas \(rollout\.tensor=auto -> 1\): the static sampler decodes whole groups "
     r"\(rollout\.n=8\) on every replica, at least 8 x 8 = 64 rows at once; raise "
     r"rollout\.max_concurrent_rows to 64, or set rollout\.tensor=2 \(4 replicas\), or "
     r"rollout\.refill=on$"),
    ({"rollout.max_concurrent_rows": 34, "rollout.tensor": "2"},
     r"max_concurrent_rows=34 must be a multiple of the 4 rollout replicas \(rollout\.tensor=2\)"),
])
def test_concurrent_rows_the_replicas_cannot_run_stop_the_trainer_up_front(tmp_path, fields,
                                                                            match) -> None:
    # Before the check, the static sampler stopped the first rollout (or evaluation) with a
    # traceback from inside `Sampler._prompts_per_chunk`.
    from qurl_jax.runtime.errors import ConfigError
    from qurl_jax.train.trainer import Trainer

    with pytest.raises(ConfigError, match=match):
        Trainer(_tiny_run(**fields), str(tmp_path / "run"))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_concurrent_rows_that_hold_a_group_pass() -> None:
    from qurl_jax.config.base import validate
    from qurl_jax.config.settings import RunSettings

    mesh = rl.rollout_mesh(make_mesh(data=1, fsdp=8, tensor=1), 2)  # 4 replicas
    for fields in ({"rollout.refill": "off", "rollout.max_concurrent_rows": 32},  # 8 x 4
                   # Refilling, 2 slots a replica: eval.k=4 is drawn in rounds of 2 samples.
                   {"rollout.max_concurrent_rows": 8},
                   {"rollout.max_concurrent_rows": 0}):
        settings = RunSettings.from_config(validate(_tiny_run(**fields)))
        rl.check_concurrent_rows(settings, mesh, num_kv_heads=2)


def test_reshard_in_buckets_gives_the_whole_reshard_with_smaller_programs(qwen) -> None:
    from qurl_jax.plan.memory_plan import compiled_memory

    cfg, params = qwen
    learner = _learner_mesh(1)
    actor = quant.requantize(shard_params(params, param_logical_axes(cfg), learner), "int8",
                             compute_dtype=jnp.bfloat16)
    mesh = rl.rollout_mesh(learner, 1)
    whole = rl.Reshard(param_logical_axes(cfg), mesh, bucket_bytes=0)
    (one,) = whole.buckets(actor)
    whole_mem = compiled_memory(whole.fn(one).lower(one).compile())
    # 16 KiB of the replica per program: the 32 KiB bf16 embedding alone, the layers' codes,
    # scales, norms and biases in several buckets.
    bucketed = rl.Reshard(param_logical_axes(cfg), mesh, bucket_bytes=16 << 10)
    buckets = bucketed.buckets(actor)
    assert len(buckets) >= 4
    flat = [p for b in buckets for p in traverse_util.flatten_dict(b)]
    # Each leaf once: the embedding (larger than a bucket) first, alone, then the rest in order.
    assert flat[0] == ("embed_tokens", "embedding")
    assert list(traverse_util.flatten_dict(buckets[0])) == [flat[0]]
    assert flat[1:] == [p for p in traverse_util.flatten_dict(actor) if p != flat[0]]
    mems = []
    for b in buckets:
        mem = compiled_memory(bucketed.fn(b).lower(b).compile())
        mems.append(mem)
        out_share = sizes.tree_bytes_per_device(jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), b,
            bucketed.shardings(b)))
        assert out_share <= 16 << 10 or len(jax.tree.leaves(b)) == 1, out_share
        hlo = bucketed.fn(b).lower(b).compile().as_text()
        for _, result in _collective_dtypes(hlo):  # codes, scales and compute-dtype leaves only
            assert result.split("[")[0].lstrip("(") in ("s8", "f32", "bf16"), result
    # Each program's outputs and temporaries are a bucket's, not the replica's.
    assert max(m["output_bytes"] for m in mems) <= whole_mem["output_bytes"] / 3
    assert max(m["temp_bytes"] for m in mems) < whole_mem["temp_bytes"]
    assert max(m["peak_bytes"] for m in mems) < whole_mem["peak_bytes"] / 2
    out, ref = bucketed(actor), whole(actor)
    jax.tree.map(np.testing.assert_array_equal, out, ref)
    assert jax.tree.map(lambda x: x.sharding, out) == jax.tree.map(lambda x: x.sharding, ref)
    with pytest.raises(ValueError, match="bucket_bytes=-1"):
        rl.Reshard(param_logical_axes(cfg), mesh, bucket_bytes=-1)


def test_reshard_bucket_mib_reaches_the_settings_and_is_checked() -> None:
    from qurl_jax.config.base import validate
    from qurl_jax.config.settings import RunSettings
    from qurl_jax.runtime.errors import ConfigError

    assert RunSettings.from_config(validate(_tiny_run())).rollout.reshard_bucket_mib == 1024
    s = RunSettings.from_config(validate(_tiny_run(**{"rollout.reshard_bucket_mib": 0})))
    assert s.rollout.reshard_bucket_mib == 0
    with pytest.raises(ConfigError, match="config.rollout.reshard_bucket_mib"):
        validate(_tiny_run(**{"rollout.reshard_bucket_mib": -1}))


def test_evaluation_draws_k_samples_in_rounds_a_chunk_can_hold(qwen) -> None:
    from qurl_jax.sampling.factory import samples_per_call

    cfg, _ = qwen
    mesh = rl.rollout_mesh(make_mesh(data=1, fsdp=8, tensor=1), 1)  # 8 replicas
    static = Sampler(cfg, jax.lax.dot_general, **KW, mesh=mesh, max_concurrent_rows=16)
    # Largest divisor of k with k' x 8 <= 16 rows: the 7B config's eval.k=32 on 16 replicas and
    # 128 rows is the same case (rounds of 8).
    assert [samples_per_call(static, k) for k in (1, 2, 3, 4, 32)] == [1, 2, 1, 2, 2]
    assert samples_per_call(Sampler(cfg, jax.lax.dot_general, **KW, mesh=mesh), 32) == 32
    refill = RefillSampler(cfg, jax.lax.dot_general, **KW, mesh=mesh, max_concurrent_rows=8)
    assert samples_per_call(refill, 32) == 32


@pytest.mark.slow  # a tiny trainer (with its warm start) and its evaluation: 4.3 min here
def test_trainer_evaluates_k_samples_a_chunk_cannot_hold(tmp_path) -> None:
    # 8 one-device replicas, 8 rows at once, eval.k=4: 32 rows a chunk would need; the static
    # evaluation sampler used to stop with a traceback here, now it draws 2 rounds of 2 samples.
    from qurl_jax.train.trainer import Trainer

    c = _tiny_run(**{"rollout.max_concurrent_rows": 8, "eval.max_examples": 8,
                     "eval.max_new_tokens": 4})
    t = Trainer(c, str(tmp_path / "run"))
    assert t.eval_sampler.max_concurrent_rows == 8
    metrics = t.evaluate()
    assert 0.0 <= metrics["arith/avg@4"] <= metrics["arith/pass@4"] <= 1.0, metrics
