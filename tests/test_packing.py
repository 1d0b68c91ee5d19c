"""Packed learner batches (`qurl_jax.learner.packing`, `Learner(packing=True)`).

- packing itself: first-fit decreasing, positions restarting per sequence, segment ids, the gather
  index back to [B, G], bucket sizes, and one-line errors;
- attention with segment ids equals each sequence's attention alone, for every implementation
  that runs here (dense, blockwise with a segment boundary inside a block and a sequence filling a
  row, splash in Pallas interpret mode);
- the learner: packed and padded layouts give the same logp_prox, loss, metrics and gradients in
  float32 for every loss mode and aggregation, KL to a reference, micro-batches and 8 devices.

Tolerance: float32 throughout; "relative 1e-6" is max |packed - padded| <= 1e-6 * max |padded|
per tensor (plus 1e-7 absolute for log-probs near 0). The two layouts differ only in reduction
lengths and order (attention sums over a row of L keys instead of P + G, matmul row counts), so
they agree to float32 rounding, not bit for bit.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.learner import packing
from qurl_jax.learner.learner import Learner, OptimConfig, span_index
from qurl_jax.models import ModelConfig, init_params
from qurl_jax.models import attention as attn
from qurl_jax.parallel import sharding as shd
from qurl_jax.rl.objectives import ObjectiveConfig

CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
P, G = 7, 6


def _padded(prompt_len, resp_len, seed=0, dapo_empty=()):
    """A padded learner batch: left-padded prompts of `prompt_len`, responses of `resp_len`;
    rows in `dapo_empty` have resp_mask 0 (a DAPO-masked group) but stay real tokens."""
    rng = np.random.default_rng(seed)
    prompt_len, resp_len = np.asarray(prompt_len), np.asarray(resp_len)
    b = len(prompt_len)
    prompt_mask = np.arange(P)[None] >= (P - prompt_len)[:, None]
    resp_real = np.arange(G)[None] < resp_len[:, None]
    attn_mask = np.concatenate([prompt_mask, resp_real], axis=1)
    resp_mask = resp_real.astype(np.float32)
    resp_mask[list(dapo_empty)] = 0.0
    return {
        "tokens": rng.integers(0, CFG.vocab_size, (b, P + G)).astype(np.int32),
        "positions": np.maximum(np.cumsum(attn_mask, 1) - 1, 0).astype(np.int32),
        "attn_mask": attn_mask,
        "resp_mask": resp_mask,
        "logp_behav": -rng.uniform(0.5, 4.0, (b, G)).astype(np.float32),
        "logp_ref": -rng.uniform(0.5, 4.0, (b, G)).astype(np.float32),
        "advantages": rng.normal(size=b).astype(np.float32),
    }


# 8 sequences: a 1-token response, responses at G, a prompt at P, a DAPO-masked pair (rows 4, 5).
PROMPTS = [P, 2, 5, 1, 3, 6, 4, P]
RESPONSES = [1, G, 3, G, 2, 4, 1, G]


# ------------------------------------------------------------------------------------ packing
def test_pack_places_every_real_token_once_and_gathers_the_responses():
    batch = _padded(PROMPTS, RESPONSES)
    length = 16
    out = packing.pack(batch["tokens"], batch["attn_mask"], G, length, num_slices=2,
                       resp_mask=batch["resp_mask"])
    a = out.arrays
    assert a["tokens"].shape[1] == length and a["tokens"].shape[0] % 2 == 0
    assert out.real_tokens == int(batch["attn_mask"].sum()) == int(a["attn_mask"].sum())
    # Positions restart at 0 per segment and count up; pads are segment -1.
    for row in range(a["tokens"].shape[0]):
        seg, pos, real = a["segment_ids"][row], a["positions"][row], a["attn_mask"][row]
        assert np.all(seg[~real] == packing.PAD_SEGMENT)
        for s in np.unique(seg[real]):
            np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
    # resp_index + 1 is the response token in its slice's rows (row j * n + i of slice i).
    for seq in range(8):
        i = seq % 2
        rows = a["tokens"][i::2].reshape(-1)
        real = batch["attn_mask"][seq, P:]
        got = rows[a["resp_index"][seq][real] + 1]
        np.testing.assert_array_equal(got, batch["tokens"][seq, P:][real])
        assert np.all(a["resp_index"][seq][~real] == 0)


def test_first_fit_decreasing_fills_rows():
    row, offset = packing.first_fit_decreasing(np.array([5, 9, 3, 0, 7, 1]), 10)
    assert row.tolist() == [2, 0, 1, -1, 1, 0] and offset.tolist() == [0, 0, 7, 0, 0, 9]


def test_bucket_rows_are_few_and_close():
    buckets = {packing.bucket_rows(r) for r in range(1, 257)}
    assert len(buckets) <= 8 + 8 * 5  # 1..8, then 8 sizes per doubling up to 256
    for r in range(1, 257):
        assert r <= packing.bucket_rows(r) <= max(r * 1.125, r + 1)
    assert packing.bucket_rows(13, multiple=4) == 16
    assert packing.default_pack_length(100) == 100 and packing.default_pack_length(513) == 1024


@pytest.mark.parametrize("per_doubling", [1, 2, 4, 16])
def test_fewer_bucket_sizes_pad_at_most_their_share(per_doubling):
    """`train.pack_buckets`: s sizes per doubling above s, at most 1/s of the rows padding."""
    buckets = {packing.bucket_rows(r, per_doubling=per_doubling) for r in range(1, 257)}
    assert len(buckets) <= per_doubling + per_doubling * 8
    for r in range(1, 257):
        b = packing.bucket_rows(r, per_doubling=per_doubling)
        assert r <= b <= max(r * (1 + 1 / per_doubling), r + 1), (r, b)
    assert sorted(b for b in buckets if b <= 64) == (
        {1: [1, 2, 4, 8, 16, 32, 64], 2: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]}.get(
            per_doubling, sorted(b for b in buckets if b <= 64)))
    with pytest.raises(ValueError, match="train.pack_buckets=3 must be a power of two"):
        packing.bucket_rows(5, per_doubling=3)


def test_balance_blocks_equalises_the_processes_tokens():
    # A minibatch in index order: the long sequences all in the first process's block.
    index = np.arange(10, 18)
    lengths = np.array([10, 9, 8, 7, 1, 1, 2, 1])
    out = packing.balance_blocks(index, lengths, 2)
    assert sorted(out.tolist()) == index.tolist()  # the same sequences, each once
    blocks = np.split(out, 2)
    sums = [int(lengths[b - 10].sum()) for b in blocks]
    assert sums == [20, 19] and [len(b) for b in blocks] == [4, 4]
    assert all((np.diff(b) > 0).all() for b in blocks)  # each block keeps the minibatch's order
    assert packing.balance_blocks(index, lengths, 1).tolist() == index.tolist()
    with pytest.raises(ValueError, match="equal blocks"):
        packing.balance_blocks(index[:7], lengths[:7], 2)


def test_balanced_blocks_need_fewer_micro_batches_at_the_configs_lengths():
    """The 1.5B config's packer on two processes (v5p-16's hosts), its four minibatches of 256:
    every process runs as many token-budget micro-batches as the fullest block needs."""
    from qurl_jax.bench.learner_flops import long_tailed_batch

    mask = long_tailed_batch(1024, 1024, 8192, 100, seed=0)["attn_mask"]
    lengths = packing.sequence_lengths(mask)
    order = np.random.default_rng(0).permutation(1024)
    runs = {}
    for balance in (False, True):
        runs[balance] = 0
        for i in range(4):
            idx = np.sort(order[i * 256:(i + 1) * 256])
            if balance:
                idx = packing.balance_blocks(idx, lengths[idx], 2)
            runs[balance] += max(packing.budget_micro_batches(b, 9216, 4)
                                 for b in np.split(mask[idx], 2))
    assert runs[True] < runs[False]
    assert int(mask.sum()) / (runs[True] * 2 * 4 * 9216) >= 0.9

def test_pack_errors_name_the_field():
    batch = _padded(PROMPTS, RESPONSES)
    with pytest.raises(ValueError, match="train.pack_length=8"):
        packing.pack(batch["tokens"], batch["attn_mask"], G, 8)
    gap = batch["attn_mask"].copy()
    gap[1, P] = False  # a hole between prompt and response
    with pytest.raises(ValueError, match="gap"):
        packing.pack(batch["tokens"], gap, G, 16)
    bad = batch["resp_mask"].copy()
    bad[0, G - 1] = 1.0  # beyond row 0's 1-token response
    with pytest.raises(ValueError, match="resp_mask"):
        packing.pack(batch["tokens"], batch["attn_mask"], G, 16, resp_mask=bad)
    with pytest.raises(ValueError, match="rows"):
        packing.pack(batch["tokens"], batch["attn_mask"], G, 16, num_rows=1)


# ---------------------------------------------------------------------------------- attention
def _packed_qkv(lengths, t, seed=0, h=4, hkv=2, d=8):
    """One row holding sequences of `lengths` back to back (then pads), q/k/v for it."""
    rng = np.random.default_rng(seed)
    seg = np.full(t, -1, np.int32)
    pos = np.zeros(t, np.int32)
    o = 0
    for s, n in enumerate(lengths):
        seg[o:o + n], pos[o:o + n] = s, np.arange(n)
        o += n
    q = jnp.asarray(rng.normal(size=(1, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, hkv, t, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, hkv, t, d)), jnp.float32)
    return q, k, v, jnp.asarray(pos[None]), jnp.asarray(seg[None]), jnp.asarray(seg[None] >= 0)


def _per_sequence(q, k, v, lengths):
    """Dense attention of each sequence alone, concatenated (pads: zeros)."""
    outs, o = [], 0
    for n in lengths:
        pos = jnp.arange(n, dtype=jnp.int32)[None]
        outs.append(attn.dot_product_attention(q[:, o:o + n], k[:, :, o:o + n], v[:, :, o:o + n],
                                               pos, pos, jnp.ones((1, n), bool)))
        o += n
    return jnp.concatenate(outs, axis=1), o


IMPLEMENTATIONS = {
    "dense": attn.dot_product_attention,
    # Blocks of 8: the boundaries at 5 and 19 fall inside blocks, 13 spans two blocks.
    "blockwise": lambda *a: attn.blockwise_attention(*a, block_q=8, block_k=8),
    "pallas_tpu": lambda *a: attn.pallas_tpu_attention(*a, interpret=True, block=128),
}


@pytest.mark.parametrize("impl", ["dense", "blockwise",
                                  pytest.param("pallas_tpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("lengths,t", [([5, 14, 1, 4], 32), ([32], 32)])
def test_segment_attention_equals_per_sequence_attention(impl, lengths, t):
    q, k, v, pos, seg, valid = _packed_qkv(lengths, t)
    fn = IMPLEMENTATIONS[impl]
    want, used = _per_sequence(q, k, v, lengths)

    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, pos, pos, valid, seg)[:, :used] * jnp.cos(want))

    got = jax.jit(lambda q, k, v: fn(q, k, v, pos, pos, valid, seg))(q, k, v)
    np.testing.assert_allclose(got[:, :used], want, atol=2e-6, rtol=1e-5)
    assert np.isfinite(np.asarray(got)).all()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    def ref_loss(q, k, v):
        return jnp.sum(_per_sequence(q, k, v, lengths)[0] * jnp.cos(want))

    ref = jax.jit(jax.grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    for g, r in zip(grads, ref, strict=True):
        np.testing.assert_allclose(g, r, atol=1e-5)


def test_blockwise_skips_blocks_between_segments():
    # Two sequences of 16 in blocks of 8: the second's queries never need the first's keys.
    seg = jnp.repeat(jnp.arange(2, dtype=jnp.int32), 16)[None]
    pos = jnp.tile(jnp.arange(16, dtype=jnp.int32), 2)[None]
    valid = jnp.ones((1, 32), bool)
    needed = np.asarray(attn._needed_blocks(pos, pos, valid, 8, 8, seg, seg))
    assert needed.sum() == 6 and not needed[2:, :2].any() and not np.triu(needed, 1).any()


def test_dispatcher_passes_segment_ids():
    q, k, v, pos, seg, valid = _packed_qkv([5, 14, 1, 4], 32)
    want = attn.dot_product_attention(q, k, v, pos, pos, valid, seg)
    got = attn.attention(q, k, v, pos, pos, valid, "blockwise", causal_by_index=True,
                         segment_ids=seg)
    np.testing.assert_allclose(got[:, :24], want[:, :24], atol=2e-6)  # the pad queries see nothing
    with pytest.raises(ValueError, match="T == S"):
        attn.attention(q[:, :3], k, v, pos[:, :3], pos, valid, "dense", segment_ids=seg)


# ------------------------------------------------------------------------------------ learner
def _learner(mesh, objective, num_micro_batches=1, packing_on=False, attention="dense",
             logprob_batch_size=0, pack_buckets=8):
    cfg = dataclasses.replace(CFG, attention=attention)
    return Learner(cfg, objective, OptimConfig(learning_rate=1e-2), mesh, temperature=0.9,
                   num_micro_batches=num_micro_batches, packing=packing_on,
                   pack_length=16 if packing_on else 0, logprob_batch_size=logprob_batch_size,
                   pack_buckets=pack_buckets)


def test_pack_buckets_sets_the_packed_row_count():
    """The learner rounds the rows its packer needs to `pack_buckets` sizes per doubling: the
    same sequences in 5 rows with 8 sizes (5 is one), 6 with 2 (1, 2, 3, 4, 6, 8, ...), 8 with
    1; the packed rows beyond those the packer filled are empty."""
    batch = {k: jnp.asarray(v) for k, v in _padded(PROMPTS, RESPONSES, seed=3).items()}
    mesh = shd.make_mesh()
    used = packing.rows_needed(np.asarray(batch["attn_mask"]), 16, 1)
    rows = {}
    for per in (8, 2, 1):
        packed = _learner(mesh, ObjectiveConfig(), packing_on=True, pack_buckets=per).pack_batch(
            batch, 1)
        rows[per] = packed["tokens"].shape[0]
        assert not np.asarray(packed["attn_mask"])[used:].any()
    assert used == 5 and rows == {8: 5, 2: 6, 1: 8}, (used, rows)
    with pytest.raises(ValueError, match="train.pack_buckets=6"):
        _learner(mesh, ObjectiveConfig(), packing_on=True, pack_buckets=6)


def _rel_close(got, want, what, rel=1e-6, atol=0.0):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    assert err <= rel * scale + atol, f"{what}: max |diff| {err:.3g} vs scale {scale:.3g}"


def _run(learner, params, batch, update=True):
    """(logp_prox, loss, metrics, grads, update metrics or None) of one padded batch."""
    params = learner.shard_params(params)
    batch = learner.shard_batch(batch)
    batch["logp_prox"] = learner.logprobs(params, batch)
    full = learner._maybe_pack(batch, 1)  # the whole batch as one slice
    (loss, metrics), grads = jax.jit(jax.value_and_grad(learner.loss, has_aux=True))(params, full)
    upd = None
    if update:
        _, _, upd = learner.update(params, learner.init_opt_state(params), batch)
    return (np.asarray(batch["logp_prox"]), float(loss), jax.device_get(metrics),
            jax.device_get(grads), jax.device_get(upd))


# Every mode (token_mean), every aggregation (acr), Dr.GRPO's constant, KL + entropy. One case
# runs in the default suite (~40 s of compiles on the shared CPU); the others are slow tests.
CASES = [dict(mode="acr", agg="token_mean", kl_coef=0.1, entropy_coef=0.01)] + [
    pytest.param(c, marks=pytest.mark.slow) for c in
    [dict(mode=m, agg="token_mean") for m in ("on_policy", "naive", "tis", "mis", "acr",
                                                "sparse_rl")]
    + [dict(mode="acr", agg="seq_mean_token_mean"), dict(mode="acr", agg="seq_mean_token_sum_norm"),
       dict(mode="tis", agg="seq_mean_token_sum_norm", agg_norm_len=4)]]


def _case_id(c):
    return "-".join(f"{v}" for v in c.values()) if isinstance(c, dict) else None


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_packed_learner_matches_padded(case):
    objective = ObjectiveConfig(**case)
    params = init_params(CFG, jax.random.key(1))
    batch = _padded(PROMPTS, RESPONSES, seed=3, dapo_empty=(4, 5))
    mesh = shd.make_mesh()
    # Log-probs in two slices of 4 sequences (a lax.map over packed slices), the loss on all 8.
    want = _run(_learner(mesh, objective, logprob_batch_size=4), params, batch, update=False)
    packed_learner = _learner(mesh, objective, packing_on=True, logprob_batch_size=4)
    got = _run(packed_learner, params, batch, update=False)
    real = batch["resp_mask"] > 0
    _rel_close(got[0][real], want[0][real], "logp_prox", atol=1e-7)
    _rel_close(got[1], want[1], "loss")
    for k in want[2]:
        _rel_close(got[2][k], want[2][k], f"metric {k}", atol=1e-7)
    for path, g in jax.tree_util.tree_leaves_with_path(got[3]):
        _rel_close(g, _leaf(want[3], path), f"grad {jax.tree_util.keystr(path)}")
    assert packed_learner.last_pack["learner/real_token_share"] > 0.5


def test_split_rows_splits_each_array_by_its_own_rows():
    from qurl_jax.learner.learner import merge_rows, split_rows

    batch = {"rows": jnp.arange(6 * 3).reshape(6, 3), "seqs": jnp.arange(16)}
    parts = split_rows(batch, 2)
    assert parts["rows"].shape == (2, 3, 3) and parts["seqs"].shape == (2, 8)
    np.testing.assert_array_equal(parts["seqs"][1], np.arange(1, 16, 2))
    np.testing.assert_array_equal(merge_rows(parts["rows"]), batch["rows"])


def _leaf(tree, path):
    for p in path:
        tree = tree[p.key]
    return tree


@pytest.mark.slow  # ~90 s of compiles each on the shared CPU
@pytest.mark.parametrize("attention", ["dense", "blockwise"])
def test_packed_learner_matches_padded_on_8_devices_with_micro_batches(attention, monkeypatch):
    monkeypatch.setattr(attn, "BLOCK_Q", 8)
    monkeypatch.setattr(attn, "BLOCK_K", 8)
    objective = ObjectiveConfig(mode="acr", agg="token_mean", kl_coef=0.1)
    params = init_params(CFG, jax.random.key(2))
    batch = _padded(PROMPTS * 2, RESPONSES[::-1] * 2, seed=5, dapo_empty=(4, 5))
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    want = _run(_learner(mesh, objective, 2, attention=attention), params, batch)
    got = _run(_learner(mesh, objective, 2, packing_on=True, attention=attention), params, batch)
    real = batch["resp_mask"] > 0
    _rel_close(got[0][real], want[0][real], "logp_prox", atol=1e-7)
    for k in ("update/loss", "update/grad_norm"):
        _rel_close(got[4][k], want[4][k], k)


# ------------------------------------------------------------------------------------ trainer
@pytest.mark.slow  # four short tiny-model runs (~2 min here)
@pytest.mark.parametrize("first", [False, True], ids=["padded_then_packed", "packed_then_padded"])
def test_packed_run_reproduces_padded_run_and_resumes_across_layouts(tmp_path, first):
    from qurl_jax.train.trainer import Trainer
    from tests.test_trainer import tiny_config

    def config(packing_on):
        return tiny_config(**{"train.packing": packing_on, "rl.num_micro_batches": 2})

    runs = {}
    for packing_on in (False, True):
        t = Trainer(config(packing_on), str(tmp_path / f"full_{packing_on}"))
        runs[packing_on] = [t.step() for _ in range(3)]
    # Resume: two steps in one layout, a checkpoint, the third step in the other layout.
    workdir = str(tmp_path / "resumed")
    t = Trainer(config(first), workdir)
    t.step(), t.step()
    t._save(force=True)
    resumed = Trainer(config(not first), workdir)
    assert resumed.step_count == 2
    third = resumed.step()
    skip = ("time/", "compile/", "learner/")
    for step, (a, b) in enumerate(zip(runs[False], runs[True], strict=True)):
        for k in a:
            if k.startswith(skip) or k.endswith("tokens_per_s"):
                continue
            assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-6), (step, k)
    for k in runs[False][2]:
        if not k.startswith(skip) and not k.endswith("tokens_per_s"):
            assert third[k] == pytest.approx(runs[not first][2][k], rel=1e-5, abs=1e-6), k
    assert "learner/real_token_share" in runs[True][0]


# ------------------------------------------------------------------ token-budget micro-batches
def test_pack_budget_assigns_whole_sequences_to_micro_batches():
    batch = _padded(PROMPTS * 2, RESPONSES * 2)
    length, rows = 16, 2
    m = packing.bucket_rows(packing.budget_micro_batches(batch["attn_mask"], length, rows))
    seqs = packing.bucket_rows(packing.budget_assignment(batch["attn_mask"], length, m)[3])
    out = packing.pack_budget(batch["tokens"], batch["attn_mask"], G, length, num_micro=m,
                              rows_per_micro=rows, seqs_per_micro=seqs,
                              resp_mask=batch["resp_mask"]).arrays
    assert out["tokens"].shape == (m * rows, length) and out["seq_index"].shape == (m * seqs,)
    assert sorted(out["seq_index"][out["seq_index"] >= 0].tolist()) == list(range(16))
    assert out["resp_span"].shape == (m * seqs, 3) and "resp_index" not in out
    index = np.asarray(span_index(out["resp_span"], G))  # as the update widens it
    for slot, seq in enumerate(out["seq_index"]):
        k = slot % m  # slot s * m + k is micro-batch k's; its rows are j * m + k
        rows_k = out["tokens"][k::m].reshape(-1)
        if seq < 0:
            assert not index[slot].any()
            continue
        real = batch["attn_mask"][seq, P:]
        np.testing.assert_array_equal(rows_k[index[slot][real] + 1],
                                      batch["tokens"][seq, P:][real])
        assert not index[slot][~real].any()  # 0 off the response, as the slot layout had
    # The log-prob pass's index: per sequence, into all rows in their packed (= merged) order.
    flat = out["tokens"].reshape(-1)
    for seq in range(16):
        real = batch["attn_mask"][seq, P:]
        np.testing.assert_array_equal(flat[out["resp_flat"][seq][real] + 1],
                                      batch["tokens"][seq, P:][real])
    # Another process's block (row_offset): its rows follow all of the first block's.
    shifted = packing.pack_budget(batch["tokens"], batch["attn_mask"], G, length, num_micro=m,
                                  rows_per_micro=rows, seqs_per_micro=seqs,
                                  resp_mask=batch["resp_mask"], row_offset=rows).arrays
    real = batch["attn_mask"][:, P:]
    np.testing.assert_array_equal(shifted["resp_flat"][real],
                                  out["resp_flat"][real] + m * rows * length)


@pytest.mark.slow  # two update compiles (~1 min here)
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
def test_token_budget_update_matches_padded(agg):
    objective = ObjectiveConfig(mode="acr", agg=agg, kl_coef=0.1)
    params = init_params(CFG, jax.random.key(4))
    batch = _padded(PROMPTS * 2, RESPONSES * 2, seed=6, dapo_empty=(4, 5))
    mesh = shd.make_mesh(data=2, fsdp=2, tensor=2)
    want = _run(_learner(mesh, objective, 2), params, batch)
    budget = Learner(CFG, objective, OptimConfig(learning_rate=1e-2), mesh, temperature=0.9,
                     packing=True, pack_length=16, tokens_per_micro_batch=32)
    got = _run(budget, params, batch)
    assert budget.last_pack["learner/micro_batches"] >= 2
    for k in ("update/loss", "update/grad_norm", "kept_tokens", "kept_sequences"):
        _rel_close(got[4][k], want[4][k], k)


# --------------------------------------------------------------------------------- fp8_block
@pytest.mark.slow  # two fp8 learners (~1 min of compiles here)
def test_fp8_block_training_on_packed_rows():
    """Jet-RL's fp8_block on packed rows: the forward and dgrad quantize per token (1 x 128
    groups), so the log-probs match the padded layout to float32 rounding of the FP8 products;
    the wgrad quantizes 128-token groups, which hold other tokens in a packed row than in a padded
    one (padding is zeroed out of every group in both), so the gradients may differ by FP8
    rounding: here within 2e-2 of the gradient's max per tensor (FP8 E4M3 has a 2^-4 relative
    step)."""
    objective = ObjectiveConfig(mode="acr", agg="token_mean")
    params = init_params(CFG, jax.random.key(7))
    batch = _padded(PROMPTS, RESPONSES, seed=8)
    mesh = shd.make_mesh()

    def fp8_learner(packing_on):
        return Learner(CFG, objective, OptimConfig(learning_rate=1e-2), mesh, temperature=0.9,
                       packing=packing_on, pack_length=16, precision="fp8_block")

    want = _run(fp8_learner(False), params, batch, update=False)
    got = _run(fp8_learner(True), params, batch, update=False)
    real = batch["resp_mask"] > 0
    _rel_close(got[0][real], want[0][real], "logp_prox", rel=1e-5, atol=1e-6)
    _rel_close(got[1], want[1], "loss", rel=1e-5)
    for path, g in jax.tree_util.tree_leaves_with_path(got[3]):
        _rel_close(g, _leaf(want[3], path), f"grad {jax.tree_util.keystr(path)}", rel=2e-2)


def test_token_budget_logprobs_match_padded():
    """`logprobs` under train.tokens_per_micro_batch: the whole batch's sequences packed into
    slices of 2 rows of 16 (a lax.map), gathered back to [B, G] by sequence (`resp_flat`)."""
    objective = ObjectiveConfig()
    params = init_params(CFG, jax.random.key(2))
    batch = _padded(PROMPTS * 2, RESPONSES * 2, seed=5)
    mesh = shd.make_mesh()
    padded = _learner(mesh, objective)
    want = np.asarray(padded.logprobs(padded.shard_params(params), padded.shard_batch(batch)))
    budget = Learner(CFG, objective, OptimConfig(learning_rate=1e-2), mesh, temperature=0.9,
                     packing=True, pack_length=16, tokens_per_micro_batch=32)
    got = np.asarray(budget.logprobs(budget.shard_params(params), budget.shard_batch(batch)))
    assert budget.last_pack["learner/micro_batches"] >= 2
    real = batch["resp_mask"] > 0
    _rel_close(got[real], want[real], "logp_prox", atol=1e-7)


@pytest.mark.slow  # four learners' compiles (~25 s of CPU)
def test_bf16_packed_differs_from_padded_by_bf16_rounding():
    """In bfloat16 packed and padded differ by rounding (docs/performance.md, "Numerics"): no
    further apart than the padded layout is from float32 (x2 margin)."""
    objective = ObjectiveConfig(mode="acr", agg="token_mean", kl_coef=0.1)
    params = init_params(CFG, jax.random.key(1))
    batch = _padded(PROMPTS, RESPONSES, seed=3, dapo_empty=(4, 5))
    real = batch["resp_mask"] > 0
    mesh = shd.make_mesh()
    res = {}
    for dtype in ("float32", "bfloat16"):
        cfg = dataclasses.replace(CFG, dtype=dtype)
        for packed in (False, True):
            learner = Learner(cfg, objective, OptimConfig(learning_rate=1e-2), mesh,
                              temperature=0.9, packing=packed, pack_length=16 if packed else 0)
            res[dtype, packed] = _run(learner, params, batch, update=False)

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / np.abs(b).max())

    def diffs(a, b):
        grads = max(rel(x, y) for x, y in zip(jax.tree.leaves(a[3]), jax.tree.leaves(b[3])))
        return np.array([rel(a[0][real], b[0][real]), rel(a[1], b[1]), grads])

    layouts = diffs(res["bfloat16", True], res["bfloat16", False])
    rounding = diffs(res["bfloat16", False], res["float32", False])
    assert np.all(layouts <= 2 * rounding), (layouts, rounding)
    # bf16 did run: it is not float32. (The two layouts may agree bit for bit in some of the
    # three: with Eigen's products, the default on AVX2 CPUs, their log-probs and loss do.)
    assert np.all(rounding > 0), rounding


# ------------------------------------------------------------------------------- shared prompts
def _grouped(groups: int, n: int, seed: int) -> dict[str, np.ndarray]:
    """A padded batch of `groups` prompts x `n` samples (prompt-major) that share each prompt."""
    rng = np.random.default_rng(seed)
    batch = _padded(rng.integers(1, P + 1, groups).repeat(n), rng.integers(1, G + 1, groups * n),
                    seed=seed)
    tokens = batch["tokens"].reshape(groups, n, P + G)
    tokens[:, :, :P] = tokens[:, :1, :P]
    batch["tokens"] = tokens.reshape(groups * n, P + G)
    return batch


def test_shared_prompts_pack_each_prompt_once_per_unit():
    """group=4: a unit is the prompt once, then as many of its responses as fit the row (16),
    each a segment whose positions continue the prompt's and whose prefix is the prompt's; each
    response slot is read at the position before it (the prompt's last for the first token)
    with its own token as the target."""
    batch = _grouped(3, 4, seed=1)
    mask, tokens = batch["attn_mask"], batch["tokens"]
    m = 2
    rows = 1 + int(packing.budget_assignment(mask, 16, m, group=4, response_len=G)[1].max())
    out = packing.pack_budget(tokens, mask, G, 16, num_micro=m, rows_per_micro=rows,
                              seqs_per_micro=12, resp_mask=batch["resp_mask"], group=4).arrays
    prompts = mask[:, :P].sum(1)
    responses = mask[:, P:].sum(1)
    units, sizes = packing._units(mask, 16, 4, G)
    assert sum(len(u) for u in units) == 12 and all(len({s // 4 for s in u}) == 1 for u in units)
    assert out["attn_mask"].sum() == sum(prompts[u[0]] for u in units) + responses.sum() \
        == sizes.sum() < mask.sum()
    for slot, seq in enumerate(out["seq_index"]):
        if seq < 0:
            continue
        k = slot % m  # slot s * m + k is micro-batch k's; resp_index is into its rows j * m + k
        flat = {key: out[key][k::m].reshape(-1)
                for key in ("tokens", "positions", "segment_ids", "prefix_ids")}
        real = mask[seq, P:]
        at = out["resp_index"][slot][real]  # the positions that predict the response tokens
        np.testing.assert_array_equal(out["resp_target"][slot][real], tokens[seq, P:][real])
        assert flat["positions"][at[0]] == prompts[seq] - 1  # the prompt's last token
        np.testing.assert_array_equal(flat["positions"][at[1:]],
                                      prompts[seq] + np.arange(real.sum() - 1))
        own = flat["segment_ids"][at[1:]]
        assert (own == own[0]).all() if len(own) else True
        assert (flat["prefix_ids"][at] == flat["segment_ids"][at[0]]).all()
    with pytest.raises(ValueError, match="do not share their prompt"):
        bad = tokens.copy()
        bad[1, P - 1] = (bad[1, P - 1] + 1) % CFG.vocab_size
        packing.pack_budget(bad, mask, G, 16, num_micro=m, rows_per_micro=rows,
                            seqs_per_micro=12, group=4)


def test_shared_prompts_learner_matches_padded():
    """Each prompt run once for its 4 samples (3 groups, 2 micro-batches of whole groups): the
    padded layout's log-probs, loss and gradient norm to float32 rounding."""
    objective = ObjectiveConfig(mode="acr", agg="seq_mean_token_mean")
    params = init_params(CFG, jax.random.key(1))
    batch = _grouped(3, 4, seed=7)
    mesh = shd.make_mesh()
    want = _run(_learner(mesh, objective), params, batch)
    shared = Learner(CFG, objective, OptimConfig(learning_rate=1e-2), mesh, temperature=0.9,
                     packing=True, pack_length=24, num_micro_batches=2, share_prompts=4)
    got = _run(shared, params, batch)
    assert shared.last_pack["learner/micro_batches"] == 2
    real = batch["resp_mask"] > 0
    _rel_close(got[0][real], want[0][real], "logp_prox", atol=1e-6)
    for k in ("update/loss", "update/grad_norm", "kept_tokens"):
        _rel_close(got[4][k], want[4][k], k, rel=1e-5)
