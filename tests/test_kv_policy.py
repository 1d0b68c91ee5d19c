"""Sparse-RL's KV compression rules (qurl_jax/sampling/_kv_policy.py), pinned on hand-made caches.

Most cases use one-hot keys (key j = e_j, D = S): then q . k_j / sqrt(D) is exactly the chosen
logit when q = logits * sqrt(D), and the keys are mutually orthogonal, so R-KV's redundancy is
uniform and its ranking is the attention ranking. Scores are kept well apart because `lax.top_k`
breaks ties toward the lower index. Budget B = 8, window W = 2, interval I = 4 unless a test says
otherwise.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.sampling._kv_policy import (
    KVPolicy,
    KVPolicyConfig,
    Selection,
    compact,
    compress_cache,
    keep_slots,
    needs_compression,
    push_window,
    selection_scores,
    window_from_prompt,
)

BUDGET, WINDOW, INTERVAL = 8, 2, 4
SCORED = [KVPolicy.SNAPKV, KVPolicy.RKV]


def _cfg(policy: KVPolicy, **overrides) -> KVPolicyConfig:
    return KVPolicyConfig(**{"policy": policy, "budget": BUDGET, "interval": INTERVAL,
                             "window": WINDOW, **overrides})


def _jit(fn, cfg: KVPolicyConfig):
    return jax.jit(functools.partial(fn, cfg))


def _keep(cfg: KVPolicyConfig, keys, pos, n_used, win_q, win_valid) -> np.ndarray:
    return np.asarray(_jit(keep_slots, cfg)(keys, pos, n_used, win_q, win_valid))


def _scores_and_keep(cfg: KVPolicyConfig, *args) -> tuple[np.ndarray, np.ndarray]:
    """(selection_scores, keep_slots) from one compiled program."""
    both = lambda *a: (selection_scores(cfg, *a), keep_slots(cfg, *a))
    return jax.tree.map(np.asarray, jax.jit(both)(*args))


def _one_hot_case(logits: np.ndarray, hkv: int = 1):
    """logits f[R, H, W, S] -> (keys f32[R, Hkv, S, S] one-hot, win_q f32[R, H, W, S])."""
    r, _, _, s = logits.shape
    keys = np.broadcast_to(np.eye(s, dtype=np.float32), (r, hkv, s, s))
    return jnp.asarray(keys), jnp.asarray(logits * math.sqrt(s), jnp.float32)


def _full_rows(r: int, s: int):
    """pos i32[R, S] = 0..S-1, n_used = S, and every window query valid."""
    return (jnp.tile(jnp.arange(s, dtype=jnp.int32), (r, 1)), jnp.full((r,), s, jnp.int32),
            jnp.ones((r, WINDOW), bool))


# ---------------------------------------------------------------- 1. StreamingLLM


def test_streaming_keeps_sinks_and_recent_positions():
    s = 16
    # Row 0: 12 tokens, 4 empty slots. Row 1: 3 left pads, 11 tokens, 2 empty. Row 2: 16 tokens.
    pads, lengths = [0, 3, 0], [12, 11, 16]
    pos = np.full((3, s), -1, np.int32)
    for r, (p, n) in enumerate(zip(pads, lengths)):
        pos[r, p:p + n] = np.arange(n)
    n_used = jnp.asarray([p + n for p, n in zip(pads, lengths)], jnp.int32)
    keys = jnp.zeros((3, 1, s, 4))
    win_q = jnp.zeros((3, 1, WINDOW, 4))
    keep = _keep(_cfg(KVPolicy.STREAMING), keys, jnp.asarray(pos), n_used, win_q,
                 jnp.ones((3, WINDOW), bool))
    for r, n in enumerate(lengths):
        expected = [0, 1, 2, 3] + list(range(n - (BUDGET - 4), n))
        assert pos[r, keep[r]].tolist() == expected
    assert keep[1].tolist() == [3, 4, 5, 6, 10, 11, 12, 13]


# ---------------------------------------------------------------- 2. pooling around a spike


@pytest.mark.parametrize("policy", SCORED)
def test_spike_keeps_the_pool_neighbourhood_and_the_window(policy):
    s = 12  # candidates 0..9, window 10, 11
    logits = np.zeros((1, 1, WINDOW, s), np.float32)
    logits[..., 5] = 10.0
    logits[..., 11] = 20.0  # the window's own logits play no part
    keys, win_q = _one_hot_case(logits)
    cfg = _cfg(policy, budget=WINDOW + 7)
    keep = _keep(cfg, keys, *_full_rows(1, s)[:2], win_q, jnp.ones((1, WINDOW), bool))
    # B - W = 7 candidates: exactly the kernel-7 neighbourhood 2..8 of the spike; then the window.
    assert keep[0].tolist() == [2, 3, 4, 5, 6, 7, 8, 10, 11]


def test_window_is_kept_even_when_it_scores_nothing():
    s = 12
    logits = np.zeros((1, 1, WINDOW, s), np.float32)
    logits[..., :10] = np.arange(10, 0, -1, dtype=np.float32)  # the oldest tokens score best
    keys, win_q = _one_hot_case(logits)
    keep = _keep(_cfg(KVPolicy.SNAPKV, pool_kernel=1), keys, *_full_rows(1, s)[:2], win_q,
                 jnp.ones((1, WINDOW), bool))
    assert keep[0].tolist() == [0, 1, 2, 3, 4, 5, 10, 11]


# ---------------------------------------------------------------- 3. GQA


@pytest.mark.parametrize("policy", SCORED)
def test_gqa_max_over_query_heads_keeps_each_heads_favourites(policy):
    s = 20  # candidates 0..17, window 18, 19; keep 6 candidates; no pooling
    logits = np.zeros((1, 2, WINDOW, s), np.float32)
    head0, head1, decoys = [2, 4, 6], [10, 12, 14], [1, 3, 5, 7, 9, 11]
    logits[0, 0, :, head0], logits[0, 1, :, head0] = 8.0, -8.0
    logits[0, 0, :, head1], logits[0, 1, :, head1] = -8.0, 8.0
    logits[..., decoys] = 4.0  # what a mean over the heads would keep (mean 4 > mean 0)
    keys, win_q = _one_hot_case(logits)
    cfg = _cfg(policy, pool_kernel=1)
    keep = _keep(cfg, keys, *_full_rows(1, s)[:2], win_q, jnp.ones((1, WINDOW), bool))
    assert keep[0].tolist() == head0 + head1 + [18, 19]


# ---------------------------------------------------------------- 4. window keys take no mass


@pytest.mark.parametrize("policy", SCORED)
def test_a_huge_logit_on_a_window_key_leaves_the_scores_unchanged(policy):
    s = 12
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 2, WINDOW, s)).astype(np.float32)
    spiked = logits.copy()
    spiked[:, :, :, 10] = 1e4
    pos, n_used, win_valid = _full_rows(2, s)
    scores = _jit(selection_scores, _cfg(policy))
    keys, win_q = _one_hot_case(logits)
    base = scores(keys, pos, n_used, win_q, win_valid)
    keys, win_q = _one_hot_case(spiked)
    np.testing.assert_array_equal(scores(keys, pos, n_used, win_q, win_valid), base)
    assert np.all(np.isneginf(np.asarray(base)[:, 10:]))


# ---------------------------------------------------------------- 5. redundancy


def _duplicates_case(n_used: int):
    """Flat attention; keys 1, 2 and 4 identical, the others orthogonal; 10 slots."""
    s = 10
    keys = np.eye(s, dtype=np.float32)
    keys[[2, 4]] = keys[1]
    pos = jnp.where(jnp.arange(s) < n_used, jnp.arange(s), -1)[None].astype(jnp.int32)
    return (jnp.asarray(keys)[None, None], pos, jnp.asarray([n_used], jnp.int32),
            jnp.zeros((1, 1, WINDOW, s)), jnp.ones((1, WINDOW), bool))


def test_redundancy_evicts_the_oldest_duplicate_first_and_spares_the_newest():
    cfg = _cfg(KVPolicy.RKV)
    score, keep = _scores_and_keep(cfg, *_duplicates_case(9))  # candidates 0..6: one must go
    assert keep[0].tolist() == [0, 2, 3, 4, 5, 6, 7, 8]
    assert score[0, 1] < score[0, 2] < score[0, 4] == score[0, 0]
    _, keep = _scores_and_keep(cfg, *_duplicates_case(10))  # candidates 0..7: two go
    assert keep[0].tolist() == [0, 3, 4, 5, 6, 7, 8, 9]


# ---------------------------------------------------------------- 6. pads and empty slots


@pytest.mark.parametrize("policy", [KVPolicy.STREAMING, *SCORED])
def test_pads_and_empty_slots_are_never_kept(policy):
    """One row of 13 tokens placed behind 0, 3 and 7 left pads (and 7, 4 and 0 empty slots) keeps
    the same positions every time, although pads carry keys that every window query loves and
    empty slots carry copies of a real key."""
    rng = np.random.default_rng(1)
    s, n, hkv, h, d = 20, 13, 2, 4, 8
    real_k = rng.normal(size=(hkv, n, d)).astype(np.float32)
    win_q = np.broadcast_to(rng.normal(size=(h, WINDOW, d)), (3, h, WINDOW, d)).astype(np.float32)
    loved = win_q[0].reshape(hkv, -1, d).sum(axis=1)  # per KV head, its queries' direction
    keys = np.empty((3, hkv, s, d), np.float32)
    keys[:, :, :10] = 50.0 * loved[None, :, None]
    keys[:, :, 10:] = 3.0 * real_k[None, :, 3:4]
    pos = np.full((3, s), -1, np.int32)
    pads = [0, 3, 7]
    for r, p in enumerate(pads):
        keys[r, :, p:p + n] = real_k
        pos[r, p:p + n] = np.arange(n)
    n_used = jnp.asarray([p + n for p in pads], jnp.int32)
    keep = _keep(_cfg(policy), jnp.asarray(keys), jnp.asarray(pos), n_used, jnp.asarray(win_q),
                 jnp.ones((3, WINDOW), bool))
    kept_pos = np.take_along_axis(pos, keep, axis=1)
    assert np.all(kept_pos >= 0)
    assert np.all(keep < np.asarray(n_used)[:, None])
    assert (kept_pos == kept_pos[:1]).all()
    assert kept_pos[0, -WINDOW:].tolist() == [n - 2, n - 1]
    assert np.all(np.diff(keep, axis=1) > 0)


def test_window_queries_marked_invalid_are_ignored():
    s = 12
    logits = np.zeros((2, 1, WINDOW, s), np.float32)
    logits[:, :, 0, 2] = 10.0  # the first window query points at 2 ...
    logits[:, :, 1, 7] = 10.0  # ... the second at 7
    keys, win_q = _one_hot_case(logits)
    pos, n_used, _ = _full_rows(2, s)
    win_valid = jnp.asarray([[False, True], [True, True]])
    score = np.asarray(_jit(selection_scores, _cfg(KVPolicy.SNAPKV, pool_kernel=1))(
        keys, pos, n_used, win_q, win_valid))
    assert score[0, 7] == pytest.approx(1.0, abs=1e-3) and score[0, 2] < 1e-3
    assert score[1, 7] == pytest.approx(0.5, abs=1e-3) == score[1, 2]


# ---------------------------------------------------------------- 7. compaction, modes


def test_compact_gathers_kept_slots_and_clears_the_rest():
    rng = np.random.default_rng(2)
    r, hkv, s, d = 2, 2, 12, 3
    keys = jnp.asarray(rng.normal(size=(r, hkv, s, d)), jnp.float32)
    values = jnp.asarray(rng.normal(size=(r, hkv, s, d)), jnp.float32)
    pos = jnp.asarray(np.stack([np.arange(s), np.r_[-1, -1, np.arange(s - 2)]]), jnp.int32)
    keep = jnp.asarray([[0, 1, 2, 3, 7, 9, 10, 11], [2, 3, 4, 5, 6, 8, 10, 11]], jnp.int32)
    k2, v2, pos2, n2 = jax.jit(compact)(keys, values, pos, keep)
    idx = np.asarray(keep)
    for new, old in ((k2, keys), (v2, values)):
        np.testing.assert_array_equal(new[:, :, :BUDGET], np.take_along_axis(
            np.asarray(old), idx[:, None, :, None], axis=2))
        assert not np.any(np.asarray(new[:, :, BUDGET:]))
    np.testing.assert_array_equal(pos2[:, :BUDGET],
                                  np.take_along_axis(np.asarray(pos), idx, axis=1))
    assert np.all(np.asarray(pos2[:, BUDGET:]) == -1)
    assert n2.tolist() == [BUDGET, BUDGET]


def _two_layer_case():
    """Two layers, 14 slots (candidates 0..11): layer 0's window points at slot 2, whose kernel-7
    neighbourhood holds candidates 0..5, layer 1's at slot 9 (neighbourhood 6..11). Row 1 is not
    due for compression."""
    s = 14
    rng = np.random.default_rng(3)
    layers = []
    for spike in (2, 9):
        logits = np.zeros((2, 1, WINDOW, s), np.float32)
        logits[..., spike] = 10.0
        layers.append(_one_hot_case(logits))
    keys = tuple(k for k, _ in layers)
    win_q = tuple(q for _, q in layers)
    values = tuple(jnp.asarray(rng.normal(size=(2, 1, s, 3)), jnp.float32) for _ in range(2))
    pos = jnp.tile(jnp.arange(100, 100 + s, dtype=jnp.int32), (2, 1))
    n_used = jnp.asarray([s, s], jnp.int32)
    return keys, values, pos, n_used, win_q, jnp.ones((2, WINDOW), bool), jnp.asarray([True, False])


@pytest.mark.parametrize("selection", list(Selection))
def test_compress_cache_modes_and_rows_left_alone(selection):
    keys, values, pos, n_used, win_q, win_valid, needs = _two_layer_case()
    cfg = _cfg(KVPolicy.SNAPKV, selection=selection)
    if selection is Selection.SHARED:
        win_q = win_q[:1]  # SHARED reads only layer 0's window buffer
    new_k, new_v, new_pos, new_n = _jit(compress_cache, cfg)(
        keys, values, pos, n_used, win_q, win_valid, needs)
    near2, near9 = [0, 1, 2, 3, 4, 5, 12, 13], [6, 7, 8, 9, 10, 11, 12, 13]
    kept = [near2, near2 if selection is Selection.SHARED else near9]
    for layer in range(2):
        for new, old in ((new_k, keys), (new_v, values)):
            np.testing.assert_array_equal(new[layer][0, :, :BUDGET],
                                          np.asarray(old[layer])[0][:, kept[layer]])
            assert not np.any(np.asarray(new[layer][0, :, BUDGET:]))
            np.testing.assert_array_equal(new[layer][1], old[layer][1])
    # PER_LAYER: the layers hold different positions in the same slots; pos records layer 0's.
    assert np.asarray(new_pos[0]).tolist() == [100 + j for j in near2] + [-1] * 6
    np.testing.assert_array_equal(new_pos[1], pos[1])
    assert new_n.tolist() == [BUDGET, 14]


def test_a_row_whose_tokens_fit_the_budget_only_loses_its_pads():
    s = 14
    logits = np.zeros((2, 1, WINDOW, s), np.float32)
    keys, win_q = _one_hot_case(logits)
    pos = np.full((2, s), -1, np.int32)
    pos[0, 5:12] = np.arange(7)  # 5 pads, 7 tokens, 2 empty slots: 12 slots in use > B
    pos[1, 3:13] = np.arange(10)  # 3 pads, 10 tokens: compressed
    n_used = jnp.asarray([12, 13], jnp.int32)
    values = jnp.asarray(np.random.default_rng(5).normal(size=(2, 1, s, 3)), jnp.float32)
    for policy in (KVPolicy.STREAMING, KVPolicy.SNAPKV):  # R-KV selects as SnapKV does
        (new_k,), (new_v,), new_pos, new_n = _jit(compress_cache, _cfg(policy))(
            (keys,), (values,), jnp.asarray(pos), n_used, (win_q,), jnp.ones((2, WINDOW), bool),
            jnp.asarray([True, True]))
        assert new_n.tolist() == [7, BUDGET]
        assert np.asarray(new_pos[0]).tolist() == list(range(7)) + [-1] * 7
        np.testing.assert_array_equal(new_v[0, :, :7], values[0, :, 5:12])
        np.testing.assert_array_equal(new_k[0, :, :7], keys[0, :, 5:12])
        assert not np.any(np.asarray(new_v[0, :, 7:]))


def test_compress_cache_under_cond_in_a_jitted_loop_keeps_the_schedule():
    """A toy decode loop over left-padded prompts: write a token per step, compress under
    lax.cond when due. n_used never exceeds physical_slots, compressions happen only at multiples
    of I, rows longer than B are left with exactly B tokens (sinks + recent: StreamingLLM), and
    shorter rows keep every token. Keys record each token's position, so slots and positions are
    checked to travel together."""
    cfg = _cfg(KVPolicy.STREAMING)
    prompt_bucket, gen_bucket = 6, 20
    s = cfg.physical_slots(prompt_bucket, gen_bucket)
    assert s == BUDGET + INTERVAL == 12
    prompt_len = np.array([6, 2])
    pos = np.full((2, s), -1, np.int32)
    for r, n in enumerate(prompt_len):
        pos[r, prompt_bucket - n:prompt_bucket] = np.arange(n)
    keys = (jnp.asarray(np.where(pos >= 0, pos, 0), jnp.float32)[:, None, :, None],)
    state = (keys, keys, jnp.asarray(pos), jnp.full((2,), prompt_bucket, jnp.int32))
    win_q = (jnp.zeros((2, 1, WINDOW, 1)),)
    win_valid = jnp.ones((2, WINDOW), bool)

    @jax.jit
    def step(state, t, length):
        (k,), (v,), pos, n_used = state
        rows = jnp.arange(2)
        k = k.at[rows, 0, n_used, 0].set(length - 1.0)
        pos = pos.at[rows, n_used].set(length - 1)
        needs = needs_compression(cfg, t, n_used + 1)
        compress = lambda st: compress_cache(cfg, *st[:4], win_q, win_valid, needs)
        return jax.lax.cond(jnp.any(needs), compress, lambda st: st,
                            ((k,), (v,), pos, n_used + 1)), needs

    for t in range(1, gen_bucket + 1):
        length = prompt_len + t
        state, needs = step(state, t, jnp.asarray(length, jnp.int32))
        (k,), _, pos_t, n_used = (jax.tree.map(np.asarray, x) for x in state)
        assert np.all(n_used <= s)
        assert not np.any(needs) or t % INTERVAL == 0
        valid = pos_t >= 0
        np.testing.assert_array_equal(k[:, 0, :, 0][valid], pos_t[valid])
        for r in range(2):
            kept = pos_t[r][valid[r]]
            assert n_used[r] == len(kept) + (0 if needs[r] else pos_t[r, :n_used[r]].tolist(
                ).count(-1))
            if length[r] <= BUDGET:
                assert kept.tolist() == list(range(length[r]))
            elif needs[r]:
                assert kept.tolist() == [0, 1, 2, 3] + list(range(length[r] - 4, length[r]))


# ---------------------------------------------------------------- 8. numpy reference, jit


def _np_rkv_scores(cfg: KVPolicyConfig, keys, pos, n_used, win_q, win_valid) -> np.ndarray:
    """R-KV scores computed the way the reference does, on each row's list of valid keys."""
    keys, pos, win_q = (np.asarray(x, np.float64) for x in (keys, pos, win_q))
    r_, hkv, s, d = keys.shape
    g = win_q.shape[1] // hkv
    half = cfg.pool_kernel // 2
    out = np.full((r_, s), -np.inf)
    for r in range(r_):
        slots = [j for j in range(int(n_used[r])) if pos[r, j] >= 0]
        n, nc = len(slots), len(slots) - cfg.window
        queries = win_q[r][:, np.asarray(win_valid[r])]
        total = np.zeros(nc)
        for kv in range(hkv):
            k = keys[r, kv, slots]
            z = np.max([queries[kv * g + i] @ k.T for i in range(g)], axis=0) / math.sqrt(d)
            e = np.exp(z[:, :nc] - z[:, :nc].max(axis=1, keepdims=True))
            a = (e / e.sum(axis=1, keepdims=True)).mean(axis=0)
            pooled = np.array([a[max(0, j - half):j + half + 1].max() for j in range(nc)])
            unit = k / (np.linalg.norm(k, axis=1, keepdims=True) + 1e-8)
            cos = unit @ unit.T
            np.fill_diagonal(cos, 0.0)
            for i in range(n):
                above = [j for j in range(n) if cos[i, j] > cfg.redundancy_threshold]
                cos[i, max(above) if above else 0] = 0.0
            mean_cos = cos.sum(axis=0) / n
            red = np.exp(mean_cos - mean_cos.max())
            red = red / red.sum()
            total += cfg.rkv_alpha * pooled - (1 - cfg.rkv_alpha) * red[:nc]
        out[r, slots[:nc]] = total
    return out


def test_rkv_scores_match_an_independent_numpy_reference():
    rng = np.random.default_rng(4)
    r, hkv, h, s, d = 3, 2, 4, 18, 8
    keys = rng.normal(size=(r, hkv, s, d))
    keys[:, :, [5, 9, 12]] = keys[:, :, 3:4] + 0.3 * rng.normal(size=(r, hkv, 3, d))
    keys[:, 1, 0] = 0.3 * keys[:, 1, 1] + rng.normal(size=(r, d))  # cosine with 0 != 0
    pads, lengths = [0, 2, 4], [18, 13, 12]
    pos = np.full((r, s), -1, np.int32)
    for i, (p, n) in enumerate(zip(pads, lengths)):
        pos[i, p:p + n] = np.arange(n)
    n_used = np.asarray([p + n for p, n in zip(pads, lengths)], np.int32)
    win_q = 2.0 * rng.normal(size=(r, h, WINDOW, d))
    win_valid = np.asarray([[True, True], [False, True], [True, True]])
    cfg = _cfg(KVPolicy.RKV)
    args = (jnp.asarray(keys, jnp.float32), jnp.asarray(pos), jnp.asarray(n_used),
            jnp.asarray(win_q, jnp.float32), jnp.asarray(win_valid))
    expected = _np_rkv_scores(cfg, *args)
    got, keep = _scores_and_keep(cfg, *args)
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=0, atol=1e-5)
    # The kept set is the reference's top B - W candidates plus the window.
    for i in range(r):
        top = np.argsort(-expected[i], kind="stable")[:BUDGET - WINDOW]
        window = np.flatnonzero(pos[i] >= 0)[-WINDOW:]
        assert keep[i].tolist() == sorted([*top, *window])


def test_window_buffer_from_prompt_and_push():
    q = jnp.arange(2 * 3 * 2 * 1, dtype=jnp.float32).reshape(2, 3, 2, 1)  # [R, T, H, D]
    mask = jnp.asarray([[True, True, True], [False, False, True]])
    win_q, win_valid = jax.jit(window_from_prompt, static_argnums=2)(q, mask, 4)
    assert win_q.shape == (2, 2, 4, 1)
    assert win_valid.tolist() == [[False, True, True, True], [False, False, False, True]]
    np.testing.assert_array_equal(win_q[:, :, 1:], jnp.transpose(q, (0, 2, 1, 3)))
    win_q, win_valid = jax.jit(push_window)(win_q, win_valid, jnp.full((2, 2, 1), 7.0))
    assert win_valid.tolist() == [[True, True, True, True], [False, False, True, True]]
    np.testing.assert_array_equal(win_q[:, :, :3], jnp.transpose(q, (0, 2, 1, 3)))
    assert np.all(np.asarray(win_q[:, :, 3]) == 7.0)


def test_needs_compression_schedule():
    n_used = jnp.asarray([BUDGET, BUDGET + 1, 3 * BUDGET])
    fn = _jit(needs_compression, _cfg(KVPolicy.RKV))
    assert fn(jnp.int32(INTERVAL), n_used).tolist() == [False, True, True]
    assert fn(jnp.int32(INTERVAL + 1), n_used).tolist() == [False, False, False]
    assert fn(jnp.int32(3 * INTERVAL), n_used).tolist() == [False, True, True]
    assert not _jit(needs_compression, KVPolicyConfig())(jnp.int32(INTERVAL), n_used).any()


def test_physical_slots():
    rkv = KVPolicyConfig(policy="rkv")
    assert rkv.physical_slots(256, 4096) == 512 + 128
    # A prompt longer than the budget is compressed right after prefill.
    assert rkv.physical_slots(1024, 4096) == 512 + 128
    assert rkv.physical_slots(256, 64) == 256 + 64  # never more than dense
    assert KVPolicyConfig().physical_slots(256, 4096) == 256 + 4096
    with pytest.raises(ValueError, match="gen_bucket"):
        rkv.physical_slots(256, 0)


def test_cache_not_larger_than_budget_is_returned_as_is():
    keys, values, pos, n_used, win_q, win_valid, needs = _two_layer_case()
    cfg = KVPolicyConfig(policy="snapkv", budget=14, window=WINDOW)
    out = compress_cache(cfg, keys, values, pos, n_used, win_q, win_valid, needs)
    assert out[0] == keys and out[2] is pos


# ---------------------------------------------------------------- 9. validation


@pytest.mark.parametrize("field, overrides", [
    ("policy", dict(policy="h2o")),
    ("selection", dict(selection="per_head")),
    ("budget", dict(policy="streaming", budget=5, sinks=4, window=2)),
    ("budget", dict(policy="rkv", budget=8, window=8)),
    ("budget", dict(budget=0)),
    ("interval", dict(interval=0)),
    ("interval", dict(interval=2.5)),
    ("window", dict(window=-1)),
    ("pool_kernel", dict(pool_kernel=6)),
    ("pool_kernel", dict(pool_kernel=0)),
    ("rkv_alpha", dict(rkv_alpha=1.5)),
    ("rkv_alpha", dict(rkv_alpha=float("nan"))),
    ("sinks", dict(sinks=-1)),
    ("sinks", dict(sinks=True)),
    ("redundancy_threshold", dict(redundancy_threshold=1.0)),
])
def test_validate_names_the_bad_field(field, overrides):
    with pytest.raises(ValueError, match=f"KVPolicyConfig.{field}:"):
        KVPolicyConfig(**overrides)


def test_defaults_are_sparse_rl_settings_and_hashable():
    cfg = KVPolicyConfig(policy="rkv", selection="per_layer")
    assert (cfg.policy, cfg.selection) == (KVPolicy.RKV, Selection.PER_LAYER)
    assert (cfg.budget, cfg.interval, cfg.window, cfg.pool_kernel) == (512, 128, 8, 7)
    assert (cfg.rkv_alpha, cfg.sinks, cfg.redundancy_threshold) == (0.1, 4, 0.5)
    assert hash(cfg) == hash(KVPolicyConfig(policy="rkv", selection="per_layer"))
    assert KVPolicyConfig(policy="streaming", budget=6, sinks=4, window=2).validate()
    with pytest.raises(ValueError, match="dense"):
        keep_slots(KVPolicyConfig(), *_duplicates_case(9))
