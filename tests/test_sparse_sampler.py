"""Sparse-RL rollouts end to end: the sampler on a physically compressed KV cache, its config, and
RL steps that train on its rollouts.

Expected values come from computations that never run the compressed sampler: the dense sampler,
and a plain full-sequence forward pass of the model (the learner's view) with the evicted positions
masked out. Which positions a row has evicted is read from the compressed sampler's cache after
each compression (the same program run for fewer steps: per-row random streams make the tokens of
a shorter run a prefix of the longer one's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import tiny_config

from qurl_jax.config.base import base_config, validate
from qurl_jax.config.settings import RunSettings, kv_policy_from_config
from qurl_jax.models import (
    KVCache,
    Transformer,
    init_params,
    param_logical_axes,
    positions_from_mask,
)
from qurl_jax.models.transformer import write_rows
from qurl_jax.parallel.sharding import make_mesh, shard_params
from qurl_jax.plan import memory_plan as memory
from qurl_jax.rl.objectives import ObjectiveConfig, sparse_rl_rejections
from qurl_jax.sampling import KVPolicyConfig, Sampler, SamplingMode, SamplingParams
from qurl_jax.sampling._host import left_pad as _left_pad
from qurl_jax.train.trainer import Trainer
from tests.conftest import tiny_model

CFG = tiny_model("qwen2")
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [12], [200, 201, 202, 9]]
LONG_PROMPTS = [list(range(30, 42)), [7, 8, 9], list(range(100, 110))]  # 12 > budget 8
BUDGET, INTERVAL, WINDOW = 8, 4, 2
POLICIES = ("streaming", "snapkv", "rkv")


@pytest.fixture(scope="module")
def params() -> dict:
    """Random weights 5x the default init: peaked distributions, so a changed attention set
    visibly changes the log-probs."""
    p = init_params(CFG, jax.random.key(0))
    return jax.tree.map(lambda x: x * 5.0 if x.ndim > 1 else x, p)


def _policy(policy: str, **kw) -> KVPolicyConfig:
    kw = dict(budget=BUDGET, interval=INTERVAL, window=WINDOW, sinks=2) | kw
    return KVPolicyConfig(policy=policy, **kw)


def _sampler(policy: KVPolicyConfig | None = None, dot_general=jax.lax.dot_general, **kw
             ) -> Sampler:
    kw = dict(max_prompt_len=16, max_new_tokens=32, min_bucket=8) | kw
    return Sampler(CFG, dot_general, kv_policy=policy, **kw)


# ------------------------------------------------------------------------------------------------
# A budget that holds the whole sequence changes nothing.


@pytest.mark.parametrize("selection", ["shared", "per_layer"])
@pytest.mark.parametrize("policy", POLICIES)
def test_budget_covering_the_sequence_equals_dense(params, policy, selection) -> None:
    kw = dict(key=jax.random.key(3), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    dense = _sampler(min_bucket=16).sample(params, PROMPTS, **kw)
    sparse_sampler = _sampler(_policy(policy, budget=32, selection=selection), min_bucket=16)
    sparse = sparse_sampler.sample(params, PROMPTS, **kw)
    np.testing.assert_array_equal(np.asarray(sparse.tokens), np.asarray(dense.tokens))
    if jax.default_backend() == "cpu":  # the same attention program for both caches: bit-exact
        np.testing.assert_array_equal(np.asarray(sparse.logp), np.asarray(dense.logp))
    else:  # a GPU reads the dense cache with JAX's Pallas kernel, the compressed one masked:
        # another summation order, 1 float32 ulp seen on an H100
        np.testing.assert_allclose(np.asarray(sparse.logp), np.asarray(dense.logp), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sparse.mask), np.asarray(dense.mask))
    assert sparse_sampler.engine.cache_slots(16, 16) == 32


# ------------------------------------------------------------------------------------------------
# Masked-dense equivalence and the schedule.


def _run_chunk(sampler: Sampler, params: dict, prompts: list[list[int]], max_new_tokens: int,
               key: jax.Array):
    """One chunk of `Sampler.sample` (all rows at once, n = 1, plain sampling), returning the
    response and the final decode state (a `CompressedCache`)."""
    p_len = sampler.engine.prompt_buckets[0]
    assert max(map(len, prompts)) <= p_len
    g_len = sampler.engine.gen_buckets[-1]
    tokens, mask = _left_pad(prompts, p_len, len(prompts), sampler.engine.pad_id)
    prefill, decode = sampler._programs_for(len(prompts), 1, p_len, g_len, SamplingMode(), 8)
    logits, state = prefill(params, jnp.asarray(tokens), jnp.asarray(mask))
    decoding = SamplingParams(max_new_tokens=max_new_tokens).decoding(key)  # no EOS
    response, state = decode(params, state, logits, jnp.arange(len(prompts), dtype=jnp.int32),
                             decoding, jnp.int32(max_new_tokens))
    return jax.device_get(response), jax.device_get(state), tokens, mask


@pytest.mark.parametrize(("policy", "prompts", "precision"), [
    pytest.param("streaming", PROMPTS, "fp", marks=pytest.mark.slow),
    pytest.param("snapkv", PROMPTS, "fp", marks=pytest.mark.slow),
    pytest.param("rkv", PROMPTS, "fp", marks=pytest.mark.slow),
    ("rkv", LONG_PROMPTS, "fp"),  # the default suite keeps the case with prompts past the budget
    # A quantized actor on a compressed cache (a combination none of the papers has): the
    # reference is the same quantized model over the masked dense cache.
    pytest.param("rkv", LONG_PROMPTS, "int8", marks=pytest.mark.slow),
    pytest.param("snapkv", LONG_PROMPTS, "fp8", marks=pytest.mark.slow)])
def test_logits_equal_a_dense_forward_with_the_evicted_positions_masked(params, policy, prompts,
                                                                         precision) -> None:
    """Every sampled token's log-prob equals the one the model gives over a dense cache when the
    positions the compressed cache had evicted before that step are masked out (prompts short
    and longer than the budget; three compressions in 16 steps). Pins positions and RoPE: the cache
    keeps keys rotated at their logical positions, and new tokens continue the logical count. A
    mask on a single full-sequence forward would not do: a kept token's deeper keys were computed
    while the evicted ones were still visible to it. Also checks the schedule: slots in use never
    exceed budget + interval, are exactly the budget after each compression of a row that had
    more, and grow by one on the step after."""
    from qurl_jax.quant import make_dot_general, requantize

    hook = make_dot_general(precision)
    if precision != "fp":
        params = requantize(params, precision)
    p_len = 16 if prompts is LONG_PROMPTS else 8
    sampler = _sampler(_policy(policy), max_prompt_len=p_len, prompt_buckets=[p_len],
                       max_new_tokens=32, gen_buckets=[32], dot_general=hook)
    slots = sampler.engine.cache_slots(p_len, 32)
    assert slots == BUDGET + INTERVAL
    key, steps = jax.random.key(11), 16
    full, final, tokens, mask = _run_chunk(sampler, params, prompts, steps, key)
    assert final.cache.k[0].shape[2] == slots

    # The cache state each decode step s in (c, c + I] attends to: the one left by step c's
    # compression (c = 0: after prefill, which compresses the prompts longer than the budget).
    kept_after = {}
    for c in range(0, steps, INTERVAL):
        out, state, _, _ = _run_chunk(sampler, params, prompts, c + 1, key)
        np.testing.assert_array_equal(out["tokens"][:, :c + 1], full["tokens"][:, :c + 1])
        cache = state.cache
        n_used, pos = np.asarray(cache.n_used), np.asarray(cache.pos)
        logical = np.asarray(cache.next_pos)
        if c > 0 or p_len > BUDGET:
            # Rows whose tokens exceed the budget were just compressed to exactly the budget.
            assert np.all(n_used[logical > BUDGET] == BUDGET), (c, n_used)
        assert np.all(n_used <= slots)
        kept_after[c] = [set(pos[r, :n_used[r]][pos[r, :n_used[r]] >= 0]) for r in
                         range(len(prompts))]
        # One step later, one more slot is in use (no compression between multiples of I).
        later = _run_chunk(sampler, params, prompts, c + 2, key)[1].cache
        np.testing.assert_array_equal(np.asarray(later.n_used), n_used + 1)
    assert any(len(k) == BUDGET for k in kept_after[INTERVAL])  # something was evicted

    # Reference: the model decoding the same tokens over a dense cache (slot i = i-th token, never
    # compacted) in which each step masks out (pos = -1) the positions evicted before it.
    seq = np.concatenate([tokens, full["tokens"]], axis=1)
    model = Transformer(CFG, hook)
    rows = len(prompts)
    cache = KVCache.zeros(CFG, rows, p_len + steps)
    _, cache = model.apply({"params": params}, jnp.asarray(tokens),
                           jnp.asarray(positions_from_mask(mask)), jnp.asarray(mask), cache=cache)
    prompt_len = np.asarray(cache.next_pos)
    for s in range(1, steps):
        c = (s - 1) // INTERVAL * INTERVAL  # the last compression before step s
        # Positions cached by then (the prompt and columns 0 .. c-1) that the row did not keep.
        evicted = np.stack([np.isin(np.asarray(cache.pos[r]), [
            q for q in range(prompt_len[r] + c) if q not in kept_after[c][r]])
            for r in range(rows)])
        cache = cache.replace(pos=jnp.where(jnp.asarray(evicted), -1, cache.pos))
        logits, cache = model.apply({"params": params}, jnp.asarray(seq[:, p_len + s - 1, None]),
                                    cache.next_pos[:, None], None, cache=cache)
        expected = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits[:, 0])),
                                      seq[:, p_len + s, None], axis=1)[:, 0]
        np.testing.assert_allclose(full["logp"][:, s], expected, atol=2e-4, rtol=0,
                                   err_msg=f"{policy}: step {s} after compression {c}")

    # Without masking the compressed sampler's log-probs would differ from the dense ones.
    seq_mask = np.concatenate([mask, np.ones_like(full["tokens"], bool)], axis=1)
    dense_logits, _ = model.apply({"params": params}, jnp.asarray(seq),
                                  jnp.asarray(positions_from_mask(seq_mask)), jnp.asarray(seq_mask))
    dense = np.take_along_axis(np.asarray(jax.nn.log_softmax(dense_logits, axis=-1))[
        :, p_len - 1:-1], seq[:, p_len:, None], axis=2)[..., 0]
    assert np.abs(dense[:, :steps] - full["logp"][:, :steps]).max() > 1e-2


def _layered_step(params: dict, tok: np.ndarray, kv: list, pos: list, write_slots: jax.Array,
                  positions: jax.Array) -> tuple[jax.Array, list, list]:
    """One decode step of the model (fp, tied head) over a dense cache whose layers each have their
    own slot positions pos[i] i32[R, S] (-1 = masked): the per-layer masks that the model's one
    shared `KVCache.pos` cannot express. Runs the model's own submodules; returns (logits f32[R, V],
    kv, pos) with this step's token written at `write_slots`."""
    from qurl_jax.models.transformer import DecoderLayer, Embed, RMSNorm

    embed = Embed(CFG, parent=None)
    x = embed.apply({"params": params["embed_tokens"]}, jnp.asarray(tok))
    new_kv, new_pos = [], []
    for i in range(CFG.num_layers):
        layer_pos = write_rows(pos[i], positions, write_slots, 0)
        x, layer_kv = DecoderLayer(CFG, jax.lax.dot_general, parent=None).apply(
            {"params": params[f"layers_{i}"]}, x, positions, None, kv[i], layer_pos, write_slots)
        new_kv.append(layer_kv)
        new_pos.append(layer_pos)
    x = RMSNorm(CFG.rms_norm_eps, CFG.compute_dtype, CFG.params_dtype, parent=None).apply(
        {"params": params["norm"]}, x)
    logits = embed.apply({"params": params["embed_tokens"]}, x, jax.lax.dot_general,
                         method="attend")
    return logits[:, 0].astype(jnp.float32), new_kv, new_pos


@pytest.mark.parametrize(("policy", "prompts"), [
    ("rkv", LONG_PROMPTS),
    pytest.param("snapkv", PROMPTS, marks=pytest.mark.slow)])
def test_per_layer_selection_equals_a_dense_forward_with_each_layers_evictions_masked(
        params, policy, prompts) -> None:
    """PER_LAYER selection: each layer keeps its own positions in slots [0, budget) (the cache's
    pos records layer 0's). Every sampled log-prob equals that of a dense decode in which each
    layer masks the positions *it* evicted before the step. Which positions layer i kept is read
    off its cached keys: each equals exactly one of the reference's layer-i keys (keys are stored
    once, post-RoPE), which holds only if every layer below attended to what the sampler's did.
    The layers do keep different sets, and masking layer 0's set in every layer instead gives
    other log-probs, so the per-layer masks are what is checked."""
    p_len = 16 if prompts is LONG_PROMPTS else 8
    sampler = _sampler(_policy(policy, selection="per_layer"), max_prompt_len=p_len,
                       prompt_buckets=[p_len], max_new_tokens=32, gen_buckets=[32])
    key, steps, rows, layers = jax.random.key(13), 16, len(prompts), CFG.num_layers
    full, _, tokens, mask = _run_chunk(sampler, params, prompts, steps, key)
    seq = np.concatenate([tokens, full["tokens"]], axis=1)

    # The dense reference after prefill (every layer sees the whole prompt, as the sampler's
    # prefill does before it compresses a prompt longer than the budget).
    cache = KVCache.zeros(CFG, rows, p_len + steps)
    _, cache = Transformer(CFG).apply({"params": params}, jnp.asarray(tokens),
                                      jnp.asarray(positions_from_mask(mask)), jnp.asarray(mask),
                                      cache=cache)
    prompt_len = np.asarray(cache.next_pos)

    def kept_positions(c: int, ref_keys: list, ref_pos: np.ndarray) -> list[list[set]]:
        """kept[i][r]: the positions layer i of row r holds after compression c (c = 0: after
        prefill), identified by matching the sampler's cached keys to the reference's."""
        cache_c = _run_chunk(sampler, params, prompts, c + 1, key)[1].cache
        n_used, pos0 = np.asarray(cache_c.n_used), np.asarray(cache_c.pos)
        kept = []
        for i in range(layers):
            ks, kr = np.asarray(cache_c.k[i]), np.asarray(ref_keys[i])
            per_row = []
            for r in range(rows):
                found = set()
                for slot in np.flatnonzero(pos0[r, :n_used[r]] >= 0):
                    cand = np.flatnonzero((ref_pos[r] >= 0) & (ref_pos[r] < prompt_len[r] + c))
                    dist = np.linalg.norm(kr[r][:, cand] - ks[r][:, slot, None], axis=(0, 2))
                    assert dist.min() <= 1e-4 * (1 + np.linalg.norm(ks[r][:, slot])), (
                        f"layer {i} row {r} slot {slot} holds no key of the reference "
                        f"(nearest {dist.min():.3g}) after compression {c}")
                    found.add(int(ref_pos[r, cand[np.argmin(dist)]]))
                if i == 0:
                    assert found == set(pos0[r, :n_used[r]][pos0[r, :n_used[r]] >= 0].tolist())
                per_row.append(found)
            kept.append(per_row)
        return kept

    def decode(kept_for: dict | None) -> tuple[np.ndarray, dict]:
        """Log-probs of the sampled tokens at steps 1..steps-1 under per-layer masks: the sets
        identified on the way (kept_for None), or the given ones."""
        kv = [(cache.k[i], cache.v[i], None, None) for i in range(layers)]  # float cache
        pos = [cache.pos] * layers
        all_pos = np.asarray(cache.pos)  # every position written so far, never masked
        write, kept_after, logp = cache.n_used, {}, np.zeros((rows, steps))
        for s in range(1, steps):
            c = (s - 1) // INTERVAL * INTERVAL
            if c not in kept_after:
                kept_after[c] = (kept_positions(c, [k for k, *_ in kv], all_pos)
                                 if kept_for is None else kept_for[c])
            masked = []
            for i in range(layers):
                evicted = np.stack([np.isin(all_pos[r], [
                    q for q in range(prompt_len[r] + c) if q not in kept_after[c][i][r]])
                    for r in range(rows)])
                masked.append(jnp.where(jnp.asarray(evicted), -1, pos[i]))
            positions = jnp.asarray(prompt_len + s - 1)[:, None]
            logits, kv, pos = _layered_step(params, seq[:, p_len + s - 1, None], kv, masked,
                                            write, positions)
            all_pos = np.asarray(write_rows(jnp.asarray(all_pos), positions, write, 0))
            write = write + 1
            logp[:, s] = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)),
                                            seq[:, p_len + s, None], axis=1)[:, 0]
        return logp, kept_after

    logp, kept_after = decode(None)
    np.testing.assert_allclose(full["logp"][:, 1:steps], logp[:, 1:], atol=2e-4, rtol=0)
    assert any(kept_after[c][1][r] != kept_after[c][0][r] for c in kept_after
               for r in range(rows)), "the layers kept the same positions: nothing was tested"
    shared = {c: [kept[0]] * layers for c, kept in kept_after.items()}
    assert np.abs(decode(shared)[0][:, 1:] - full["logp"][:, 1:steps]).max() > 1e-2


@pytest.mark.parametrize(("interval", "window", "policy", "selection"), [
    (5, 2, "rkv", "shared"),  # blocks of 3 steps that push no query, then 2 that do
    (3, 3, "snapkv", "per_layer"),  # every step of a block pushes
    (2, 4, "snapkv", "shared")])  # the window spans two blocks
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_blocked_decode_equals_compressing_inside_every_step(params, interval, window, policy,
                                                             selection) -> None:
    """The static sampler decodes in blocks ending at multiples of the interval and pushes only
    the queries that reach the window by the block's end (see `Sampler._decode`); the refilling
    sampler, with a slot for every row, pushes every step's queries and asks on every step
    which rows are due. The two give the same tokens and log-probs, prompts past the budget
    included."""
    from qurl_jax.sampling import RefillSampler

    kv = _policy(policy, interval=interval, window=window, selection=selection)
    kw = dict(key=jax.random.key(5), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    sizes = dict(max_prompt_len=16, max_new_tokens=16, min_bucket=8)
    blocked = _sampler(kv, **sizes).sample(params, LONG_PROMPTS, **kw)
    per_step = RefillSampler(CFG, kv_policy=kv, max_concurrent_rows=6, **sizes).sample(
        params, LONG_PROMPTS, **kw)
    np.testing.assert_array_equal(np.asarray(blocked.tokens), np.asarray(per_step.tokens))
    np.testing.assert_allclose(np.asarray(blocked.logp), np.asarray(per_step.logp), atol=1e-5)
    dense = _sampler(**sizes).sample(params, LONG_PROMPTS, **kw)
    assert not np.array_equal(np.asarray(blocked.tokens), np.asarray(dense.tokens))  # it evicts


@pytest.mark.parametrize("policy", [pytest.param("streaming", marks=pytest.mark.slow), "rkv"])
@pytest.mark.slow  # long; in the 15-minute budget its cousins cover the path
def test_bfloat16_cache(params, policy) -> None:
    """The accelerator's compute dtype: keys, values and window queries in bfloat16. A budget that
    holds the sequence gives exactly the dense bf16 sampler's tokens and log-probs. With a small
    budget (prompts past it), the refilling sampler's per-step compression schedule gives exactly
    the static sampler's blocked one. A slot per row: in bf16, other batch shapes (fewer slots,
    other chunks) change roundings in the last bit, dense or compressed alike, and sampled
    tokens drift apart after a few steps; in float32 they do not (test_refill)."""
    from qurl_jax.sampling import RefillSampler

    bf16 = CFG.replace(dtype="bfloat16")
    kw = dict(key=jax.random.key(7), n=2,
              settings=SamplingParams(max_new_tokens=16, temperature=1.0))
    sizes = dict(max_prompt_len=16, max_new_tokens=16, min_bucket=8)
    dense = Sampler(bf16, **sizes).sample(params, LONG_PROMPTS, **kw)
    wide = Sampler(bf16, kv_policy=_policy(policy, budget=32), **sizes).sample(
        params, LONG_PROMPTS, **kw)
    np.testing.assert_array_equal(np.asarray(wide.tokens), np.asarray(dense.tokens))
    np.testing.assert_array_equal(np.asarray(wide.logp), np.asarray(dense.logp))

    static = Sampler(bf16, kv_policy=_policy(policy), **sizes).sample(params, LONG_PROMPTS, **kw)
    refill = RefillSampler(bf16, kv_policy=_policy(policy), max_concurrent_rows=6, **sizes
                           ).sample(params, LONG_PROMPTS, **kw)
    np.testing.assert_array_equal(np.asarray(refill.tokens), np.asarray(static.tokens))
    np.testing.assert_array_equal(np.asarray(refill.logp), np.asarray(static.logp))
    assert not np.array_equal(np.asarray(static.tokens), np.asarray(dense.tokens))  # it evicts
    one = Sampler(bf16, kv_policy=_policy(policy), max_prompt_len=16, prompt_buckets=[16],
                  max_new_tokens=16, gen_buckets=[16])
    state = _run_chunk(one, params, LONG_PROMPTS, 16, jax.random.key(7))[1]
    assert state.cache.k[0].dtype == jnp.bfloat16 and state.win_q[0].dtype == jnp.bfloat16


# ------------------------------------------------------------------------------------------------
# On a mesh, with the CPU kernels' fallback.


def test_sharded_compressed_sampler_matches_single_device(params) -> None:
    kw = dict(key=jax.random.key(5), n=2,
              settings=SamplingParams(max_new_tokens=20, temperature=1.0))
    policy = _policy("rkv")
    expected = _sampler(policy).sample(params, PROMPTS * 2, **kw)
    mesh = make_mesh(data=2, fsdp=2, tensor=2)
    sharded = shard_params(params, param_logical_axes(CFG), mesh)
    out = _sampler(policy, mesh=mesh, max_concurrent_rows=8).sample(sharded, PROMPTS * 2, **kw)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(expected.tokens))
    np.testing.assert_allclose(np.asarray(out.logp), np.asarray(expected.logp), atol=1e-5)


def test_kv_bytes_per_row() -> None:
    per_slot = 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4
    assert _sampler().engine.kv_bytes_per_row(7, 20) == (8 + 32) * per_slot
    assert _sampler(_policy("rkv")).engine.kv_bytes_per_row(7, 20) == (BUDGET + INTERVAL) * per_slot


def test_decode_program_holds_budget_plus_interval_slots() -> None:
    """The memory report's decode program (what the trainer's preflight checks) with the
    configured policy: 16 rows over 2 devices, 64 + 1984 = 2048 dense slots vs 64 + 32 = 96. The
    peak drops by the KV saved, less the compression's scratch, which does not grow with the
    response: the gathered and selected copies of the small cache and R-KV's cosine matrix."""
    c = base_config()
    c.data.prompts_per_step, c.rollout.n = 8, 2
    c.data.max_prompt_len, c.rollout.max_new_tokens = 64, 1984
    c.mesh.fsdp = 2
    c.rollout.kv_budget, c.rollout.kv_interval = 64, 32

    def decode_bytes(policy: str) -> int:
        c.rollout.kv_policy = policy
        setup = memory.build_setup(RunSettings.from_config(c), CFG)
        compiled = memory.rollout_decode(setup).lowered.compile()
        return memory.compiled_memory(compiled)["peak_bytes"]

    rows, per_slot = 8, 2 * CFG.num_layers * CFG.num_kv_heads * CFG.head_dim * 4  # per device
    saved = rows * (2048 - 96) * per_slot
    scratch = 4 * rows * 96 * per_slot + rows * CFG.num_kv_heads * 96 * 96 * 4
    dense, rkv = decode_bytes("dense"), decode_bytes("rkv")
    assert dense - rkv >= saved - scratch, (dense, rkv, saved, scratch)


# ------------------------------------------------------------------------------------------------
# Config.


def test_config_builds_the_policy_and_rejects_bad_fields() -> None:
    c = base_config()
    assert kv_policy_from_config(c.rollout) == KVPolicyConfig()  # Sparse-RL's defaults, dense
    c.rollout.kv_policy, c.rollout.kv_budget = "rkv", 64
    assert kv_policy_from_config(c.rollout) == KVPolicyConfig(policy="rkv", budget=64)
    bad = [({"rollout.kv_policy": "h2o"}, r"config\.rollout\.kv_policy: unknown value 'h2o'"),
           ({"rollout.kv_policy": "streaming", "rollout.kv_budget": 11},
            r"config\.rollout\.kv_budget: must be >= sinks \+ window = 12"),
           ({"rollout.kv_policy": "rkv", "rollout.kv_budget": 8},
            r"config\.rollout\.kv_budget: must be > window"),
           ({"rollout.kv_pool_kernel": 4}, r"config\.rollout\.kv_pool_kernel: must be odd"),
           ({"rollout.kv_selection": "each"}, r"config\.rollout\.kv_selection: unknown value"),
           ({"rollout.rkv_alpha": 1.5}, r"config\.rollout\.rkv_alpha: must be in \[0, 1\]")]
    for overrides, message in bad:
        with pytest.raises(ValueError, match=message):
            validate(tiny_config(**overrides))


def test_rejection_counts() -> None:
    cfg = ObjectiveConfig(mode="sparse_rl", veto_tau=1e-4, sparse_mask_band=(0.5, 1.5))
    behav = np.zeros((3, 4), np.float32)
    # Row 0: one token with w = e^-10 < 1e-4 (vetoed); row 1: w = 2 and w = 0.25 outside the
    # band; row 2: all inside; the last column is padding (w = e^-10 there never counts).
    prox = np.array([[0, -10, 0, -10], [np.log(2), np.log(0.25), 0, -10], [0.1, 0, 0, -10]],
                    np.float32)
    mask = np.array([[1, 1, 1, 0]] * 3, bool)
    counts = jax.tree.map(float, sparse_rl_rejections(prox, behav, mask, cfg))
    assert counts == {"vetoed_sequences": 1.0, "vetoed_tokens": 3.0, "band_masked_tokens": 2.0,
                      "band_masked_sequences": 1.0}


# ------------------------------------------------------------------------------------------------
# RL steps on sparse rollouts.


def _sparse_trainer(tmp_path, **overrides) -> Trainer:
    kw = {"rollout.precision": "fp", "rollout.max_new_tokens": 12, "rollout.kv_policy": "rkv",
          "rollout.kv_budget": 6, "rollout.kv_interval": 4, "rollout.kv_window": 2,
          "rollout.kv_sinks": 2, "rl.loss_mode": "sparse_rl", "rl.sparse_mask_band": (0.5, 1.5),
          "train.num_steps": 1} | overrides
    return Trainer(tiny_config(**kw), str(tmp_path))


@pytest.mark.parametrize("overrides", [
    pytest.param({}, id="rkv-sparse_rl"),
    pytest.param({"rollout.kv_policy": "streaming", "rl.loss_mode": "acr"}, id="streaming-acr",
                 marks=pytest.mark.slow),
    pytest.param({"rollout.precision": "int8", "rl.sparse_base": "acr"},
                 id="int8-rkv-sparse_rl_acr", marks=pytest.mark.slow),
    pytest.param({"rollout.precision": "fp8", "rl.sparse_base": "acr"},
                 id="fp8-rkv-sparse_rl_acr", marks=pytest.mark.slow),
])
def test_rl_step_on_sparse_rollouts(tmp_path, overrides) -> None:
    t = _sparse_trainer(tmp_path, **overrides)
    assert t.eval_sampler.engine.kv_policy.compresses is False  # evaluation stays dense
    m = t.step()
    bad = {k: v for k, v in m.items() if not np.isfinite(v)}
    assert not bad, bad
    # budget + interval slots of one layer's K and V (1 KV head of 16 float32 values).
    assert m["rollout/kv_bytes_per_row"] == (6 + 4) * 2 * 16 * 4
    assert m["rollout/kv_bytes_per_row"] < t.eval_sampler.engine.kv_bytes_per_row(8, 12)
    assert m["update/skipped"] == 0.0
    if t.objective.mode == "sparse_rl":
        for k in ("vetoed_tokens", "band_masked_tokens"):
            assert 0.0 <= m[f"sparse/{k}"] <= m["rollout/tokens"], k
        for k in ("vetoed_sequences", "band_masked_sequences"):
            assert 0.0 <= m[f"sparse/{k}"] <= 8, k
        assert "is_weight_mean" in m and "kl_behav_prox_k1" in m
    else:
        assert not any(k.startswith("sparse/") for k in m)
