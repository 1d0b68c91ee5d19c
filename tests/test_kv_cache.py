"""The per-row KV cache (qurl_jax.models.KVCache) through the model's cache path: bookkeeping
(pos, n_used, next_pos) on hand-made prompts, decode steps against a plain full-sequence forward
(the learner's view) for aligned and unaligned rows, and that attention depends on the recorded
positions only, not on which slot holds a key (what a compressed cache relies on)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.models import KVCache, ModelConfig, Transformer, init_params

CONFIG = ModelConfig(model_type="qwen2", vocab_size=97, hidden_size=32, intermediate_size=48,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
PROMPTS = [[5, 17, 9, 3, 41], [12, 60], [20, 21, 22]]
GEN = [[7, 8, 9, 10], [11, 12, 13, 14], [15, 16, 17, 18]]  # tokens fed to the decode steps
SLOTS = 12  # every decoded cache has this many slots: the tests share compiled programs


@functools.cache
def _params() -> dict:
    params = init_params(CONFIG, jax.random.key(0))
    # 5x the default init: peaked attention, so a wrongly masked key shows in the logits.
    return jax.tree.map(lambda x: x * 5 if x.ndim > 1 else x, params)


@functools.cache
def _apply():
    return jax.jit(Transformer(CONFIG).apply)


def _left_pad(prompts: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p):] = p
        mask[i, width - len(p):] = True
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return tokens, mask, positions


def _prefill(prompts: list[list[int]], width: int, slots: int) -> tuple[jax.Array, KVCache]:
    tokens, mask, positions = _left_pad(prompts, width)
    return _apply()({"params": _params()}, jnp.asarray(tokens), jnp.asarray(positions),
                    jnp.asarray(mask), cache=KVCache.zeros(CONFIG, len(prompts), slots))


def _step(cache: KVCache, tokens: list[int]) -> tuple[np.ndarray, KVCache]:
    """One decode step at each row's next position; logits f32[R, V]."""
    logits, cache = _apply()({"params": _params()}, jnp.asarray(tokens, jnp.int32)[:, None],
                             cache.next_pos[:, None], None, cache=cache)
    return np.asarray(logits[:, 0]), cache


def _full_logits(prompts: list[list[int]], steps: int) -> list[np.ndarray]:
    """Per row, f32[len(prompt) + steps, V] logits of one plain forward over prompt + GEN."""
    seqs = [p + g[:steps] for p, g in zip(prompts, GEN, strict=True)]
    width = max(map(len, seqs))
    tokens, mask, positions = _left_pad(seqs, width)
    logits = np.asarray(_apply()({"params": _params()}, jnp.asarray(tokens),
                                 jnp.asarray(positions), jnp.asarray(mask))[0])
    return [logits[i, width - len(s):] for i, s in enumerate(seqs)]


def _concat_rows(caches: list[KVCache]) -> KVCache:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *caches)


def test_bookkeeping_after_prefill_and_decode_steps() -> None:
    _, cache = _prefill(PROMPTS, width=6, slots=6)
    assert cache.length == 6
    np.testing.assert_array_equal(np.asarray(cache.pos), [[-1, 0, 1, 2, 3, 4],
                                                          [-1, -1, -1, -1, 0, 1],
                                                          [-1, -1, -1, 0, 1, 2]])
    np.testing.assert_array_equal(np.asarray(cache.n_used), [6, 6, 6])
    np.testing.assert_array_equal(np.asarray(cache.next_pos), [5, 2, 3])
    # GRPO copies: rows repeated n = 2 times, slots grown to SLOTS (empty).
    cache = cache.repeat(2, SLOTS)
    np.testing.assert_array_equal(np.asarray(cache.pos)[:, 6:], -1)
    np.testing.assert_array_equal(np.asarray(cache.pos)[2, :6], [-1, -1, -1, -1, 0, 1])
    np.testing.assert_array_equal(np.asarray(cache.n_used), [6] * 6)
    np.testing.assert_array_equal(np.asarray(cache.next_pos), [5, 5, 2, 2, 3, 3])
    for k in range(1, 3):
        _, cache = _step(cache, [1] * 6)
        np.testing.assert_array_equal(np.asarray(cache.n_used), [6 + k] * 6)
        np.testing.assert_array_equal(np.asarray(cache.next_pos), np.array([5, 5, 2, 2, 3, 3]) + k)
    np.testing.assert_array_equal(np.asarray(cache.pos)[:, 6:9], [[5, 6, -1]] * 2
                                  + [[2, 3, -1]] * 2 + [[3, 4, -1]] * 2)
    assert cache.k[0].shape == (6, CONFIG.num_kv_heads, SLOTS, CONFIG.head_dim)


def test_unaligned_rows_bookkeeping() -> None:
    # Rows prefilled on their own, without padding, sit at different slots (as after a slot
    # refill): each decode step writes each row at its own n_used.
    caches = [_prefill([p], width=len(p), slots=SLOTS)[1] for p in PROMPTS]
    cache = _concat_rows(caches)
    np.testing.assert_array_equal(np.asarray(cache.n_used), [5, 2, 3])
    np.testing.assert_array_equal(np.asarray(cache.next_pos), [5, 2, 3])
    _, cache = _step(cache, [1, 1, 1])
    expected = np.full((3, SLOTS), -1)
    for r, p in enumerate(PROMPTS):
        expected[r, : len(p) + 1] = np.arange(len(p) + 1)
    np.testing.assert_array_equal(np.asarray(cache.pos), expected)
    np.testing.assert_array_equal(np.asarray(cache.n_used), [6, 3, 4])


@pytest.mark.parametrize("layout", ["left_padded", "unaligned"])
def test_decode_steps_equal_full_forward(layout: str) -> None:
    steps = 4
    if layout == "left_padded":
        prefill, cache = _prefill(PROMPTS, width=6, slots=6)
        cache = cache.repeat(1, SLOTS)
        prefill_last = np.asarray(prefill)[:, -1]
    else:
        outs = [_prefill([p], width=len(p), slots=SLOTS) for p in PROMPTS]
        cache = _concat_rows([c for _, c in outs])
        prefill_last = np.stack([np.asarray(lg)[0, -1] for lg, _ in outs])
    full = _full_logits(PROMPTS, steps)
    np.testing.assert_allclose(prefill_last, [f[len(p) - 1] for f, p in zip(full, PROMPTS)],
                               atol=1e-5)
    for j in range(steps):
        logits, cache = _step(cache, [g[j] for g in GEN])
        for r, p in enumerate(PROMPTS):
            np.testing.assert_allclose(logits[r], full[r][len(p) + j], atol=1e-5,
                                       err_msg=f"{layout}: row {r}, decode step {j}")


def test_attention_reads_positions_not_slots() -> None:
    """Evicting keys by emptying their slots equals gathering the kept slots to the front (a
    compaction): the next step's logits agree, though every kept key changed slot."""
    prompt, steps = [[5, 17, 9, 3, 41, 60, 2, 33]], 3
    _, cache = _prefill(prompt, width=8, slots=SLOTS)
    for j in range(steps):
        _, cache = _step(cache, [GEN[0][j]])
    n = int(cache.n_used[0])  # 11 slots in use, positions 0..10
    keep = np.array([0, 1, 4, 6, 7, 9, 10])
    evict = np.setdiff1d(np.arange(n), keep)
    masked = cache.replace(pos=cache.pos.at[0, evict].set(-1))
    src = np.concatenate([keep, np.full(cache.length - len(keep), cache.length - 1)])

    def gather(x: jax.Array, axis: int) -> jax.Array:
        return jnp.take(x, jnp.asarray(src), axis=axis)

    compacted = cache.replace(
        k=tuple(gather(x, KVCache.SLOT_AXIS) for x in cache.k),
        v=tuple(gather(x, KVCache.SLOT_AXIS) for x in cache.v),
        pos=gather(cache.pos, 1).at[0, len(keep):].set(-1),
        n_used=jnp.asarray([len(keep)], jnp.int32),
    )
    dense, _ = _step(cache, [GEN[0][steps]])
    want, masked = _step(masked, [GEN[0][steps]])
    got, compacted = _step(compacted, [GEN[0][steps]])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert np.abs(dense - want).max() > 1e-2  # the eviction matters
    assert int(compacted.n_used[0]) == len(keep) + 1
    assert int(compacted.next_pos[0]) == int(masked.next_pos[0]) == n + 1
