"""Tests for qurl_jax.sampling.RefillSampler (continuous batching): the same tokens and log-probs as
the static Sampler for widely differing lengths, no stale cache read after a slot is refilled,
batched and bounded insert programs, int8 actors, compressed-KV policies and a mesh.

Expected values come from the static `Sampler` (itself tested against transformers and a plain
forward pass in test_sampler.py); per-row length limits cut its rows at hand-made lengths.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.cpu_kernels import decode_attention as cpu_decode
from qurl_jax.models import KVCache, param_logical_axes
from qurl_jax.parallel.sharding import make_mesh, shard_params
from qurl_jax.sampling import FinishReason, RefillSampler, Sampler, SamplingParams
from tests.test_sampler import PROMPTS, TINY, _random_params

PROMPTS6 = PROMPTS + [[7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7], [3, 1], [90, 91, 92, 93, 94]]
# n = 2: 12 rows; hand-made lengths from 1 to 16 (median 4.5, a quarter of the maximum).
LIMITS = np.array([16, 1, 3, 9, 2, 16, 5, 4, 7, 1, 12, 3])


@pytest.fixture(scope="module")
def qwen() -> tuple:
    cfg = TINY["qwen2"]
    return cfg, _random_params(cfg), Sampler(cfg, max_prompt_len=16, max_new_tokens=16)


def _assert_prefix_equal(out, ref, limits: np.ndarray, atol: float = 1e-5) -> None:
    """`out` rows equal `ref` rows cut after limits[i] tokens (pads, zero log-probs after)."""
    cut = np.arange(ref.tokens.shape[1])[None, :] < limits[:, None]
    np.testing.assert_array_equal(np.asarray(out.mask), cut)
    np.testing.assert_array_equal(np.asarray(out.lengths), limits)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.where(cut, np.asarray(ref.tokens), 0))
    for name in ("logp", "logp_untruncated"):
        got = np.asarray(getattr(out, name))
        assert np.isfinite(got).all(), name
        np.testing.assert_allclose(got, np.where(cut, np.asarray(getattr(ref, name)), 0.0),
                                   atol=atol, err_msg=name)
    for name in ("prompt_tokens", "prompt_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)),
                                      np.asarray(getattr(ref, name)), err_msg=name)


@pytest.mark.parametrize("kw", [dict(greedy=True), dict(temperature=0.8, top_k=40)],
                         ids=["greedy", "sampled"])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_same_tokens_as_static_for_long_tailed_lengths(qwen, kw) -> None:
    cfg, params, static = qwen
    kw = dict(key=jax.random.key(3), n=2, settings=SamplingParams(max_new_tokens=16, **kw))
    ref = static.sample(params, PROMPTS6, **kw)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=4,
                           refill_min=1)
    out = refill.sample(params, PROMPTS6, length_limits=LIMITS, **kw)
    _assert_prefix_equal(out, ref, LIMITS)
    assert int(out.num_steps) == 16
    assert (np.asarray(out.finish_reason) == FinishReason.LENGTH).all()
    run = refill.last_run
    # 12 rows through 4 slots: slots were refilled, the two samples of a prompt can sit apart.
    assert sorted(r for rows in run.slot_rows for r in rows) == list(range(12))
    assert max(len(rows) for rows in run.slot_rows) >= 3
    # Continuous batching: far fewer slot-steps than 3 chunks x 15 steps x 4 rows would take.
    assert run.decode_steps < 3 * 15 and run.occupancy > 0.6
    # Once nothing waited, the last rows were moved into fewer slots (see the shrink test).
    assert run.shrinks >= 1 and run.slot_steps < run.decode_steps * 4
    # Without limits every row runs to max_new_tokens: the static result exactly.
    full = refill.sample(params, PROMPTS6, **kw)
    _assert_prefix_equal(full, ref, np.full(12, 16))


def test_eos_lengths_and_finish_reasons_match_static(qwen) -> None:
    cfg, params, static = qwen
    kw = dict(key=jax.random.key(5), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    free = np.asarray(static.sample(params, PROMPTS6, **kw).tokens)
    # EOS ids taken from tokens rows draw at different steps, so lengths differ widely.
    eos = (int(free[0, 1]), int(free[5, 9]), int(free[7, 4]))
    kw["settings"] = kw["settings"].replace(eos_ids=eos)
    ref = static.sample(params, PROMPTS6, **kw)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=2)
    out = refill.sample(params, PROMPTS6, **kw)
    lengths = np.asarray(ref.lengths)
    assert lengths.min() <= 2 and lengths.max() >= 10
    _assert_prefix_equal(out, ref, lengths)
    np.testing.assert_array_equal(np.asarray(out.finish_reason), np.asarray(ref.finish_reason))
    assert (np.asarray(out.finish_reason) == FinishReason.EOS).any()
    assert int(out.num_steps) == int(ref.num_steps)


# JAX's GPU decode kernel, and XLA's dense path where the CPU kernel cannot run (a CPU without
# AVX512), load every slot and give the masked ones weight 0, and 0 x NaN is NaN: there the poison
# is a large finite value, which changes the log-probs wherever a slot outside the live window
# gets any weight. The CPU kernel reads only live slots, so NaN tests it where the sampler takes
# it (the engine's own rule: `cpu_kernels.decode_attention.usable`).
def _poison(cfg) -> float:
    kernel = jax.default_backend() == "cpu" and cpu_decode.usable(cfg.compute_dtype, cfg.head_dim)
    return jnp.nan if kernel else 1e3


def test_refilled_slot_never_reads_its_previous_contents(qwen, monkeypatch) -> None:
    # One slot holds every row in turn (lengths 16, 1, 3, ...: long rows followed by short ones
    # with shorter prompts). The slot starts poisoned: `_poison` keys and values, every cache
    # slot marked visible at positions 0..S-1, bogus counters. A read of anything an insert did
    # not overwrite (the initial poison or the previous row's keys, which sit at positions the
    # next row's queries would see) changes the log-probs or makes them NaN.
    cfg, params, static = qwen
    value = _poison(cfg)
    kw = dict(key=jax.random.key(9), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    ref = static.sample(params, PROMPTS6, **kw)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=1)
    clean_init = refill._init_state

    def poisoned_init(**shapes):
        state = clean_init(**shapes)
        c = state.slots.cache
        poison = lambda x: jnp.full_like(x, value)  # noqa: E731
        cache = KVCache(k=tuple(map(poison, c.k)), v=tuple(map(poison, c.v)),
                        pos=jnp.broadcast_to(jnp.arange(c.length, dtype=jnp.int32), c.pos.shape),
                        n_used=jnp.full_like(c.n_used, 3), next_pos=jnp.full_like(c.next_pos, 40))
        return state.replace(slots=state.slots.replace(cache=cache))

    monkeypatch.setattr(refill, "_init_state", poisoned_init)
    out = refill.sample(params, PROMPTS6, length_limits=LIMITS, **kw)
    assert refill.last_run.slot_rows == [list(range(12))]
    _assert_prefix_equal(out, ref, LIMITS)


def test_shrink_moves_the_last_rows_into_fewer_slots(qwen) -> None:
    # The two longest rows (16 and 12 tokens) are admitted last, after a few short ones finish;
    # once nothing waits, calls return as the live rows fit half the slots, and the state is
    # gathered down until the last row decodes alone in one slot.
    cfg, params, static = qwen
    limits = np.array([3, 2, 5, 1, 4, 2, 3, 6, 2, 1, 16, 12])
    kw = dict(key=jax.random.key(2), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    ref = static.sample(params, PROMPTS6, **kw)
    runs = {}
    for shrink in (True, False):
        refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=8,
                               refill_min=1, shrink=shrink)
        out = refill.sample(params, PROMPTS6, length_limits=limits, **kw)
        _assert_prefix_equal(out, ref, limits)
        runs[shrink] = refill.last_run
        decodes = sorted(k[1] for k in refill._refill_programs if k[0] == "decode")
        if shrink:  # halvings of 8 only, down to the last row's 1
            assert decodes[0] == 1 and set(decodes) <= {1, 2, 4, 8}, decodes
            assert refill.last_run.shrinks == len(decodes) - 1
        else:
            assert decodes == [8] and refill.last_run.shrinks == 0
    on, off = runs[True], runs[False]
    assert on.decode_steps == off.decode_steps
    # The same tokens in fewer slot-steps: the last 4 steps of the 16-token row alone.
    assert on.slot_steps <= off.slot_steps - 4 * 7 and on.occupancy > off.occupancy
    assert 2 * on.slot_steps < off.slot_steps  # measured: 50 vs 128


def test_insert_prefill_is_batched_and_bounded(qwen) -> None:
    cfg, params, _ = qwen
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=8,
                           refill_min=3)
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(1, 256, rng.integers(1, 12))) for _ in range(16)]
    kw = dict(key=jax.random.key(1), n=4, settings=SamplingParams(max_new_tokens=16, greedy=True))
    for seed in range(3):
        limits = np.random.default_rng(seed).integers(1, 17, 64)
        out = refill.sample(params, prompts, length_limits=limits, **kw)
        np.testing.assert_array_equal(np.asarray(out.lengths), limits)
        run = refill.last_run
        # 64 rows, admitted in batches: at least refill_min rows per insert but the last ones;
        # each of the 16 prompts prefilled once, though its 4 rows enter at different times.
        assert run.inserts <= 64 // 3 + 2
        assert run.prefilled == 16
    inserts = [k for k in refill._refill_programs if k[0] == "insert"]
    # K rows a power of two <= 8, P new prompts 0 or a power of two <= K: at most 2 + 3 + 4 + 5.
    assert refill.num_insert_programs == len(inserts) <= 14
    # The first insert fills all 8 slots with two groups of 4: two prompts prefilled, not 8.
    assert any(k[-3:] == (8, 2, 16) for k in inserts)
    before = refill.num_programs
    refill.sample(params, prompts, length_limits=limits, **kw)
    assert refill.num_programs == before


def test_int8_actor_matches_static(qwen) -> None:
    from qurl_jax.quant import make_dot_general, requantize

    cfg, params, _ = qwen
    qparams, hook = requantize(params, "int8"), make_dot_general("int8")
    kw = dict(key=jax.random.key(4), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=0.7))
    ref = Sampler(cfg, hook, max_prompt_len=16, max_new_tokens=16).sample(qparams, PROMPTS6, **kw)
    refill = RefillSampler(cfg, hook, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=4)
    out = refill.sample(qparams, PROMPTS6, length_limits=LIMITS, **kw)
    _assert_prefix_equal(out, ref, LIMITS, atol=1e-4)


@pytest.mark.parametrize("policy, selection", [
    ("rkv", "shared"),
    pytest.param("streaming", "shared", marks=pytest.mark.slow),
    pytest.param("snapkv", "per_layer", marks=pytest.mark.slow)])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_compressed_kv_matches_static(qwen, policy, selection) -> None:
    # Budget 6 + interval 3 slots per row: the 11-token prompt is compressed after prefill and
    # every row longer than a few tokens is compressed on its own schedule (its own step count),
    # which must be the static sampler's for the same row whatever slot and time it runs at.
    from qurl_jax.sampling import KVPolicyConfig

    cfg, params, _ = qwen
    kv = KVPolicyConfig(policy=policy, budget=6, interval=3, window=2, pool_kernel=3, sinks=1,
                        selection=selection)
    kw = dict(key=jax.random.key(6), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=0.9))
    static = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, kv_policy=kv)
    ref = static.sample(params, PROMPTS6, **kw)
    dense = Sampler(cfg, max_prompt_len=16, max_new_tokens=16).sample(params, PROMPTS6, **kw)
    assert not np.array_equal(np.asarray(ref.tokens), np.asarray(dense.tokens))  # it evicts
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=4,
                           refill_min=1, kv_policy=kv)
    out = refill.sample(params, PROMPTS6, length_limits=LIMITS, **kw)
    _assert_prefix_equal(out, ref, LIMITS)
    assert max(len(rows) for rows in refill.last_run.slot_rows) >= 3
    assert refill.engine.kv_bytes_per_row(16, 16) == static.engine.kv_bytes_per_row(16, 16)
    assert refill.engine.kv_bytes_per_row(16, 16) < Sampler(cfg).engine.kv_bytes_per_row(16, 16)


# R-KV here is a slow test (the default suite keeps its budget; test_compressed_kv_matches_static
# runs R-KV through the refill sampler by default).
@pytest.mark.parametrize("policy", ["dense", pytest.param("rkv", marks=pytest.mark.slow)])
def test_mesh_each_shard_refills_its_own_slots(qwen, policy) -> None:
    from qurl_jax.sampling import KVPolicyConfig

    cfg, params, _ = qwen
    kv = KVPolicyConfig(policy=policy, budget=6, interval=3, window=2, pool_kernel=3)
    kw = dict(key=jax.random.key(0), n=2, settings=SamplingParams(max_new_tokens=16, greedy=True))
    prompts = PROMPTS6 + [[4, 4]]  # 7 prompts: padded to 8 for 4 batch shards
    limits = np.concatenate([LIMITS, [2, 14]])
    ref = Sampler(cfg, max_prompt_len=16, max_new_tokens=16, kv_policy=kv).sample(
        params, prompts, **kw)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(cfg), mesh)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, mesh=mesh,
                           max_concurrent_rows=8, kv_policy=kv)
    out = refill.sample(sharded, prompts, length_limits=limits, **kw)
    _assert_prefix_equal(out, ref, limits)
    # 8 padded prompts over 4 shards: shard d owns slots 2d, 2d + 1 and the rows of prompts 2d,
    # 2d + 1; at the end each shard moved its last live row into its one remaining slot.
    for slot, rows in enumerate(refill.last_run.slot_rows):
        assert rows and all(r // 4 == slot // 2 for r in rows), (slot, rows)
    assert refill.last_run.shrinks == 1
    assert out.tokens.shape == (14, 16)


# R-KV here is a slow test (the default suite keeps its budget; test_compressed_kv_matches_static
# runs R-KV through the refill sampler by default).
@pytest.mark.parametrize("policy", ["dense", pytest.param("rkv", marks=pytest.mark.slow)])
def test_lower_programs_are_the_programs_sample_runs(qwen, policy) -> None:
    """What the memory report and the trainer's preflight compile for a refill rollout
    (`lower_programs`: the full insert and the decode on R slots, with the [rows, G] outputs) is
    what `sample` runs: the compiled programs, put in place of the sampler's own, take the real
    state (a compiled program rejects any other shape or sharding) and give the same tokens."""
    from qurl_jax.sampling import KVPolicyConfig, SamplingMode

    cfg, params, _ = qwen
    kv = KVPolicyConfig(policy=policy, budget=6, interval=3, window=2, pool_kernel=3)
    kw = dict(key=jax.random.key(0), n=2, settings=SamplingParams(max_new_tokens=16, greedy=True))
    prompts = PROMPTS6 + [[4, 4]]
    limits = np.concatenate([LIMITS, [2, 14]])
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(cfg), mesh)

    def sampler() -> RefillSampler:
        return RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, mesh=mesh,
                             max_concurrent_rows=8, kv_policy=kv)

    ref = sampler().sample(sharded, prompts, length_limits=limits, **kw)
    refill = sampler()
    rows = refill.rows_per_chunk(len(prompts), 2)
    assert rows == 16  # 7 prompts padded to 8 for 4 batch shards, all in one call
    before = set(refill._refill_programs)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                            sharded)
    lowered = refill.lower_programs(abstract, rows, 16, 16, n=2, mode=SamplingMode(greedy=True))
    calls = {"insert": 0, "decode": 0}
    for key in set(refill._refill_programs) - before:
        if key[0] in calls:
            name = "prefill" if key[0] == "insert" else "decode"
            compiled = lowered[name].compile()

            def counted(*args, _compiled=compiled, _kind=key[0]):
                calls[_kind] += 1
                return _compiled(*args)

            refill._refill_programs[key] = counted
    out = refill.sample(sharded, prompts, length_limits=limits, **kw)
    assert calls["insert"] == 1 and calls["decode"] >= 1, calls  # the first insert fills all 8
    _assert_prefix_equal(out, ref, limits, atol=0)
    memory = lowered["decode"].compile().memory_analysis()
    outputs = rows * 16 * (4 + 4 + 4 + 1) // 4  # tokens, logp, logp_untruncated, mask: 4 shards
    assert memory.argument_size_in_bytes > outputs


def test_each_program_compiles_once_on_a_mesh(qwen, monkeypatch) -> None:
    """Programs hand the state on with the shardings they take it with: with equal lengths every
    slot frees at once, so the insert of the first shape runs again on the decode's output state,
    and compiles no second time (it did when the compiler chose the held prefills' and the live
    flags' shardings). Counted as traces of each program's function (a retrace is a recompile),
    which, unlike the jit objects' dispatch caches, no earlier test in the process can change."""
    cfg, params, _ = qwen
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(cfg), mesh)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, mesh=mesh,
                           max_concurrent_rows=8, shrink=False)
    traced = {"init": 0, "insert": 0, "decode": 0, "finish": 0}
    for kind, owner, name in (("init", refill, "_init_state"), ("insert", refill, "_insert_rows"),
                              ("decode", refill, "_decode_steps"),
                              ("finish", refill.engine, "finish")):
        original = getattr(owner, name)

        def counting(*args, _fn=original, _kind=kind, **kwargs):
            traced[_kind] += 1
            return _fn(*args, **kwargs)
        monkeypatch.setattr(owner, name, counting)
    refill.sample(sharded, PROMPTS6 + [[4, 4]], SamplingParams(max_new_tokens=6, greedy=True),
                  key=jax.random.key(0), n=2)
    assert refill.last_run.inserts == 2 and refill.num_insert_programs == 1
    assert traced == {"init": 1, "insert": 1, "decode": 1, "finish": 1}, traced


def test_bad_arguments_raise(qwen) -> None:
    cfg, params, _ = qwen
    with pytest.raises(ValueError, match="multiple of the batch shards"):
        RefillSampler(cfg, mesh=make_mesh(data=2, fsdp=2), max_concurrent_rows=6)
    refill = RefillSampler(cfg, max_prompt_len=16, max_new_tokens=16, max_concurrent_rows=2)
    with pytest.raises(ValueError, match="length_limits must be B \\* n = 6"):
        refill.sample(params, PROMPTS, SamplingParams(max_new_tokens=4), key=jax.random.key(0), n=2,
                      length_limits=[1, 2, 3, 4, 5, 6, 7])
    with pytest.raises(ValueError, match="length_limits"):
        refill.sample(params, PROMPTS, SamplingParams(max_new_tokens=4), key=jax.random.key(0),
                      length_limits=[1, 5, 2])


def test_trainer_switch() -> None:
    from qurl_jax.config.base import base_config, validate
    from qurl_jax.config.settings import refill_enabled

    c = base_config()
    c.data.prompts_per_step, c.rollout.n = 8, 8
    assert c.rollout.refill == "auto" and not refill_enabled(c)  # max_concurrent_rows 0: all
    c.rollout.refill = "on"
    assert refill_enabled(c)
    c.rollout.refill = "auto"
    for rows, enabled in ((16, True), (0, False), (64, False)):
        c.rollout.max_concurrent_rows = rows
        assert refill_enabled(c) == enabled, rows
    c.model.source, c.data.task, c.eval.files = "tiny", "arithmetic", []
    c.data.max_prompt_len = c.rollout.max_new_tokens = c.eval.max_new_tokens = 16  # 256 positions
    validate(c)
    c.rollout.refill = "sometimes"
    with pytest.raises(ValueError, match="rollout.refill"):
        validate(c)


# Slow (34 s, the default suite's third longest): the samplers' equality is the default suite's
# (test_int8_actor_matches_static, test_eos_lengths_and_finish_reasons_match_static, ...), and every
# trainer test whose rows exceed rollout.max_concurrent_rows runs the refill sampler by default.
@pytest.mark.slow
def test_trainer_rollout_refills_by_default_with_the_static_result(tmp_path) -> None:
    # 2 prompts x 4 samples through 4 slots: 'auto' (the default) refills; the step's metrics,
    # which come from the rollout's tokens and log-probs, are those of the static sampler.
    from qurl_jax.train.trainer import Trainer
    from tests.test_trainer import tiny_config

    metrics = {}
    for refill in ("auto", "off"):
        c = tiny_config(**{"rollout.max_concurrent_rows": 4, "rollout.max_new_tokens": 6,
                           "rollout.refill": refill, "train.num_steps": 1})
        t = Trainer(c, str(tmp_path / refill))
        assert isinstance(t.sampler, RefillSampler) == (refill == "auto")
        m = t.step()
        metrics[refill] = {k: v for k, v in m.items()
                           if not k.startswith(("time/", "compile/")) and "per_s" not in k}
    assert metrics["auto"].keys() == metrics["off"].keys()
    for k, v in metrics["off"].items():
        assert metrics["auto"][k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("sampler_cls", [Sampler, RefillSampler])
def test_prompt_pass_keeps_each_device_to_its_own_prompts(sampler_cls) -> None:
    """On an FSDP mesh the prompt pass (the static prefill, the refill insert) runs like the
    learner: the residual stream pinned to the batch shards, weights gathered. Left free, the
    partitioner split the int8 projections over their contracting dimension with every prompt
    token on every device (the 1.5B paper config's insert held s32[65536, 8960] partial sums per
    MLP product, 8x its share). Checked on the compiled program's dot shapes: 64 prompts of 32
    tokens over 8 devices, so no product may see all 2048 tokens, and the projections see 256."""
    import re

    from qurl_jax import quant
    from qurl_jax.models import init_params
    from qurl_jax.parallel.sharding import logical_shardings

    cfg = TINY["llama"]
    mesh = make_mesh(fsdp=8)
    recipe = quant.get_recipe("int8")
    shapes = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    master = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes,
                          logical_shardings(param_logical_axes(cfg), shapes, mesh))
    requantize = jax.jit(lambda p: quant.requantize(p, recipe))
    actor = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                         jax.eval_shape(requantize, master),
                         requantize.lower(master).compile().output_shardings)
    sampler = sampler_cls(cfg, quant.make_dot_general(recipe), max_prompt_len=32,
                          max_new_tokens=16, mesh=mesh, platform="gpu")
    text = sampler.lower_programs(actor, 64, 32, 16)["prefill"].compile().as_text()
    dots = [tuple(int(d) for d in shape.split(","))
            for shape in re.findall(r"= [a-z0-9]+\[([0-9,]+)\]\S* dot\(", text)]
    assert dots and not any(2048 in dims or 64 * 32 * 2 in dims for dims in dots), dots
    # q / k / v / o and the MLP products: [tokens of one device's 8 prompts, features].
    assert {(256, 64), (256, 32), (256, 128)} <= set(dots), dots
    # Nor is any cache buffer of all 64 rows x 48 slots built on one device (the refill insert
    # wrote its admitted rows' caches at full length, which the partitioner gathered whole).
    assert not re.search(r"\[64,2,48,16\]", text)
