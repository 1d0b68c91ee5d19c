"""Tests for qurl_jax.rl.objectives: hand values, identities between modes, gradients, unbiasedness.

Expected numbers are written by hand or computed by `np_reference`, a per-token float64 loop written
straight from docs/methods.md, never by the functions under test.
"""

from __future__ import annotations

import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qurl_jax.rl import objectives as obj
from qurl_jax.rl.objectives import ObjectiveConfig, policy_loss, token_terms

MODES = ["on_policy", "naive", "tis", "mis", "acr", "sparse_rl"]
AGGS = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"]


# ----------------------------------------------------------------------------- reference


def np_reference(lp, lprox, lbehav, adv, mask, **kw) -> tuple[float, np.ndarray, np.ndarray]:
    """Independent float64 loop: returns (loss, per-token loss [B,T], kept mask [B,T])."""
    mode = kw.get("mode", "acr")
    el, eh = kw.get("eps_low", 0.2), kw.get("eps_high", 0.2)
    lp, lprox, lbehav = (np.asarray(x, np.float64) for x in (lp, lprox, lbehav))
    mask = np.asarray(mask, bool)
    b, t = lp.shape
    adv = np.asarray(adv, np.float64)
    adv = np.repeat(adv[:, None], t, 1) if adv.ndim == 1 else adv
    keep = mask.copy()
    weight = np.ones((b, t))
    upper = np.full((b, t), 1 + eh)
    old = lbehav if mode == "naive" else lprox
    ratio = np.exp(lp - old)
    w = np.exp(lprox - lbehav)
    if mode in ("tis", "acr", "sparse_rl"):
        cap = kw.get("sparse_cap", 1.5) if mode == "sparse_rl" else kw.get("cap", 2.0)
        for i in range(b):
            for j in range(t):
                weight[i, j] = min(w[i, j], cap)
                adaptive = mode == "acr" or kw.get("sparse_base", "tis") == "acr"
                if adaptive and mode != "tis":
                    r = min(1.0, cap / w[i, j])
                    upper[i, j] = (1 + eh) / r
    if mode == "mis":
        lo, hi, level = kw.get("mis_lo", 0.5), kw.get("mis_hi", 2.0), kw.get("mis_level", "token")
        for i in range(b):
            valid_w = [w[i, j] for j in range(t) if mask[i, j]]
            prod = float(np.prod(valid_w)) if valid_w else 1.0
            for j in range(t):
                if level == "token":
                    wij = w[i, j]
                elif level == "sequence":
                    wij = prod
                else:
                    wij = prod ** (1.0 / len(valid_w)) if valid_w else 1.0
                weight[i, j] = wij
                if not lo <= wij <= hi:
                    keep[i, j] = False
    if mode == "sparse_rl":
        tau = kw.get("veto_tau", 1e-4)
        band = kw.get("sparse_mask_band")
        for i in range(b):
            if tau is not None and any(w[i, j] < tau for j in range(t) if mask[i, j]):
                keep[i, :] = False
            if band is not None:
                for j in range(t):
                    if not band[0] <= w[i, j] <= band[1]:
                        keep[i, j] = False
    if kw.get("batch_normalize", False) and keep.any():
        weight = weight / weight[keep].mean()
    tok = np.zeros((b, t))
    dual = kw.get("dual_clip")
    for i in range(b):
        for j in range(t):
            if not keep[i, j]:
                continue
            a, r_ = adv[i, j], ratio[i, j]
            clipped = min(max(r_, 1 - el), upper[i, j])
            pg = -min(r_ * a, clipped * a)
            if dual is not None and a < 0:
                pg = min(pg, -dual * a)
            tok[i, j] = weight[i, j] * pg
    return (
        np_agg(tok, keep, kw.get("agg", "seq_mean_token_mean"), kw.get("agg_norm_len")),
        tok,
        keep,
    )


def np_agg(v: np.ndarray, keep: np.ndarray, agg: str, norm_len: float | None = None) -> float:
    if agg == "token_mean":
        return float(v[keep].sum() / keep.sum()) if keep.any() else 0.0
    rows = [i for i in range(v.shape[0]) if keep[i].any()]
    if not rows:
        return 0.0
    if agg == "seq_mean_token_mean":
        return float(np.mean([v[i][keep[i]].mean() for i in rows]))
    length = v.shape[1] if norm_len is None else norm_len
    return float(np.mean([v[i][keep[i]].sum() / length for i in rows]))


def random_batch(seed: int, b: int = 4, t: int = 6, spread: float = 1.0, pad: bool = True):
    """Random (logp, logp_prox, logp_behav, adv[B], mask) with log w of scale `spread`."""
    rng = np.random.default_rng(seed)
    lprox = np.log(rng.uniform(0.05, 0.95, (b, t)))
    lbehav = lprox - spread * rng.normal(size=(b, t))
    lp = lprox + 0.3 * rng.normal(size=(b, t))
    adv = rng.normal(size=b)
    mask = np.ones((b, t), bool)
    if pad:
        for i in range(b):
            mask[i, rng.integers(2, t + 1) :] = False
    return [x.astype(np.float32) if x.dtype != bool else x for x in (lp, lprox, lbehav, adv, mask)]


def floats(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()}


def loss_of(*args, **kw) -> float:
    loss, _ = policy_loss(*[jnp.asarray(a) for a in args], ObjectiveConfig(**kw))
    return float(loss)


# ----------------------------------------------------------------------------- hand values


def one_token(ratio: float, w: float, adv: float, **kw) -> float:
    """Loss of a single token with R = pi/pi_prox and w = pi_prox/pi_behav."""
    lprox = np.log([[0.5]])
    lbehav = lprox - np.log(w)
    lp = lprox + np.log(ratio)
    return loss_of(lp, lprox, lbehav, np.array([adv]), np.ones((1, 1), bool), **kw)


@pytest.mark.parametrize(
    "mode, ratio, w, adv, extra, expected",
    [
        ("on_policy", 1.5, 3.0, 1.0, {}, -1.2),  # clipped at 1 + eps
        ("on_policy", 0.5, 3.0, -1.0, {}, 0.8),  # clipped at 1 - eps for A < 0
        ("on_policy", 1.1, 3.0, 2.0, {}, -2.2),
        ("naive", 1.0, 1.1, 2.0, {}, -2.2),  # ratio against behav = 1.1 (w = prox/behav)
        ("naive", 1.0, 2.0, 1.0, {}, -1.2),  # ratio 2 against behav, clipped
        ("tis", 1.1, 4.0, 1.0, {}, -2.2),  # weight min(4, 2) = 2
        ("tis", 2.0, 4.0, 1.0, {}, -2.4),  # TIS clips at 1.2 even though r = 0.5
        ("tis", 1.1, 1.5, 1.0, {}, -1.65),  # untruncated weight 1.5
        ("acr", 2.0, 4.0, 1.0, {}, -4.0),  # upper = 1.2 / 0.5 = 2.4 does not bind
        ("acr", 3.0, 4.0, 1.0, {}, -4.8),  # binds at 2.4: -2 * 2.4
        ("acr", 0.5, 4.0, -1.0, {}, 1.6),  # lower bound unchanged: -2 * (0.8 * -1)
        ("acr", 2.0, 1.5, 1.0, {}, -1.8),  # not truncated: same as TIS, 1.5 * 1.2
        ("mis", 1.1, 1.5, 1.0, {}, -1.65),
        ("mis", 1.1, 3.0, 1.0, {}, 0.0),  # outside [0.5, 2]: rejected, empty loss
        ("sparse_rl", 1.1, 3.0, 1.0, {}, -1.65),  # weight min(3, 1.5)
        ("sparse_rl", 1.1, 5e-5, 1.0, {}, 0.0),  # vetoed (w < 1e-4)
        ("sparse_rl", 2.0, 3.0, 1.0, {"sparse_base": "acr"}, -3.0),  # upper 1.2 * 2 = 2.4
        ("on_policy", 4.0, 1.0, -1.0, {"dual_clip": 3.0}, 3.0),  # 4 capped at 3
        ("tis", 0.5, 4.0, -1.0, {"dual_clip": 3.0}, 1.6),  # dual clip inactive
    ],
)
def test_single_token_hand_values(mode, ratio, w, adv, extra, expected):
    assert one_token(ratio, w, adv, mode=mode, **extra) == pytest.approx(
        expected, rel=1e-5, abs=1e-6
    )


@pytest.mark.parametrize(
    "agg, norm_len, expected",
    [
        ("token_mean", None, -7.0 / 3.0),  # -(1 + 2 + 4) / 3
        ("seq_mean_token_mean", None, -2.75),  # -(1.5 + 4) / 2
        ("seq_mean_token_sum_norm", None, -7.0 / 6.0),  # -(3/3 + 4/3) / 2
        ("seq_mean_token_sum_norm", 4.0, -0.875),  # -(3/4 + 4/4) / 2
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_aggregation_hand_values(mode, agg, norm_len, expected):
    # R = 1 and w = 1 everywhere, so every mode's token loss is -A.
    lp = np.log(np.full((3, 3), 0.4))
    adv = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    mask = np.array([[1, 1, 0], [1, 0, 0], [0, 0, 0]], bool)  # third row fully padded
    got = loss_of(lp, lp, lp, adv, mask, mode=mode, agg=agg, agg_norm_len=norm_len)
    assert got == pytest.approx(expected, rel=1e-6)


def test_mis_levels_hand_values():
    # Sequence 0: w = [2, 0.5, 4]: product 4, geometric mean 4^(1/3) = 1.5874.
    # Sequence 1: w = [1, 1].
    w = np.array([[2.0, 0.5, 4.0], [1.0, 1.0, 1.0]])
    lprox = np.log(np.full((2, 3), 0.2))
    lbehav = lprox - np.log(w)
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    adv = np.array([1.0, 1.0])
    args = (lprox, lprox, lbehav, adv, mask)
    kw = dict(mode="mis", agg="token_mean")
    # token level, band [0.5, 2]: the w = 4 token is rejected: -(2 + 0.5 + 1 + 1) / 4.
    assert loss_of(*args, **kw, mis_level="token") == pytest.approx(-4.5 / 4, rel=1e-6)
    # sequence level: weight 4 > 2 rejects sequence 0 entirely: -(1 + 1) / 2.
    assert loss_of(*args, **kw, mis_level="sequence") == pytest.approx(-1.0, rel=1e-6)
    # geometric: sequence 0 kept with weight 1.5874: -(3 * 1.5874 + 2) / 5.
    g = 4.0 ** (1.0 / 3.0)
    assert loss_of(*args, **kw, mis_level="geometric") == pytest.approx(-(3 * g + 2) / 5, rel=1e-6)


def test_sparse_rl_hand_values():
    # Sequence 0 has a token with w = 5e-5 < 1e-4: vetoed.
    # Sequence 1: w = [2, 1, 0.4], R = 1, A = 1.
    w = np.array([[1.0, 5e-5, 1.0], [2.0, 1.0, 0.4]])
    lprox = np.log(np.full((2, 3), 0.3))
    lbehav = lprox - np.log(w)
    args = (lprox, lprox, lbehav, np.array([1.0, 1.0]), np.ones((2, 3), bool))
    kw = dict(mode="sparse_rl", agg="token_mean")
    # weights min(w, 1.5) = [1.5, 1, 0.4]; sequence 0 leaves the denominator.
    assert loss_of(*args, **kw) == pytest.approx(-2.9 / 3, rel=1e-6)
    # band [0.5, 1.5] also drops the w = 2 and w = 0.4 tokens: only the w = 1 token is left.
    assert loss_of(*args, **kw, sparse_mask_band=(0.5, 1.5)) == pytest.approx(-1.0, rel=1e-6)
    # batch normalisation to mean 1 over the kept tokens makes the loss -mean(A) = -1.
    assert loss_of(*args, **kw, batch_normalize=True) == pytest.approx(-1.0, rel=1e-6)
    # no veto: sequence 0 is back with weights [1, 5e-5, 1].
    expected = -(1 + 5e-5 + 1 + 2.9) / 6
    assert loss_of(*args, **kw, veto_tau=None) == pytest.approx(expected, rel=1e-6)


def test_kl_and_entropy_hand_values():
    lp = np.log(np.full((1, 2), 0.25))
    lref = lp + np.log(2.0)  # pi_ref / pi_theta = 2
    ent = np.array([[1.0, 3.0]], np.float32)
    base = dict(mode="on_policy", agg="token_mean")
    args = [jnp.asarray(x) for x in (lp, lp, lp, np.array([1.0]), np.ones((1, 2), bool))]
    k3 = 2.0 - math.log(2.0) - 1.0
    loss, m = policy_loss(*args, ObjectiveConfig(**base, kl_coef=0.1), logp_ref=jnp.asarray(lref))
    assert float(loss) == pytest.approx(-1.0 + 0.1 * k3, rel=1e-6)
    assert float(m["kl_loss"]) == pytest.approx(k3, rel=1e-6)
    cfg = ObjectiveConfig(**base, kl_coef=0.1, kl_estimator="k1")
    loss, _ = policy_loss(*args, cfg, logp_ref=jnp.asarray(lref))
    assert float(loss) == pytest.approx(-1.0 - 0.1 * math.log(2.0), rel=1e-6)
    loss, m = policy_loss(*args, ObjectiveConfig(**base, entropy_coef=0.01), entropy=ent)
    assert float(loss) == pytest.approx(-1.0 - 0.01 * 2.0, rel=1e-6)
    assert float(m["entropy"]) == pytest.approx(2.0)


# ----------------------------------------------------------------------------- reference sweep


SWEEP = [
    dict(mode="on_policy"),
    dict(mode="naive"),
    dict(mode="tis"),
    dict(mode="tis", cap=1.2, eps_high=0.28),
    dict(mode="acr"),
    dict(mode="acr", cap=1.2, eps_low=0.1, eps_high=0.28),
    dict(mode="mis"),
    dict(mode="mis", mis_level="sequence", mis_lo=0.1, mis_hi=10.0),
    dict(mode="mis", mis_level="geometric", batch_normalize=True),
    dict(mode="sparse_rl", veto_tau=0.2),
    dict(mode="sparse_rl", sparse_mask_band=(0.5, 1.5), batch_normalize=True),
    dict(mode="sparse_rl", sparse_base="acr", veto_tau=0.1),
    dict(mode="acr", dual_clip=1.5),
]


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("kw", SWEEP, ids=lambda kw: "-".join(f"{v}" for v in kw.values()))
def test_matches_numpy_reference(kw, agg):
    args = random_batch(seed=len(str(kw)), spread=0.8)
    expected, tok, keep = np_reference(*args, agg=agg, **kw)
    terms = token_terms(*[jnp.asarray(a) for a in args], ObjectiveConfig(agg=agg, **kw))
    np.testing.assert_array_equal(np.asarray(terms.mask), keep)
    np.testing.assert_allclose(np.asarray(terms.loss), tok, rtol=1e-5, atol=1e-6)
    assert loss_of(*args, agg=agg, **kw) == pytest.approx(expected, rel=1e-5, abs=1e-6)


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", ["tis", "acr"])
def test_decoupled_equals_on_policy_when_behav_is_prox(mode, agg):
    lp, lprox, _, adv, mask = random_batch(seed=1)
    cfg = ObjectiveConfig(mode=mode, agg=agg)
    ref = ObjectiveConfig(mode="on_policy", agg=agg)
    loss, _ = policy_loss(lp, lprox, lprox, adv, mask, cfg)
    ref_loss, _ = policy_loss(lp, lprox, lprox, adv, mask, ref)
    assert float(loss) == pytest.approx(float(ref_loss), rel=1e-6)
    assert abs(float(ref_loss)) > 1e-3


@pytest.mark.parametrize("agg", AGGS)
def test_acr_equals_tis_without_truncation(agg):
    lp, lprox, lbehav, adv, mask = random_batch(seed=2, spread=0.2)
    lp = lprox + np.log(1.6) * np.sign(np.random.default_rng(0).normal(size=lp.shape))
    assert np.exp(lprox - lbehav).max() < 2.0  # nothing truncated at C = 2
    args = [jnp.asarray(x) for x in (lp, lprox, lbehav, adv, mask)]
    grad = jax.grad(lambda x, c: policy_loss(x, *args[1:], c)[0])
    acr, tis = ObjectiveConfig(mode="acr", agg=agg), ObjectiveConfig(mode="tis", agg=agg)
    (la, ma), (lt, mt) = policy_loss(*args, acr), policy_loss(*args, tis)
    assert float(la) == float(lt)
    assert floats(ma) == pytest.approx(floats(mt))
    np.testing.assert_array_equal(grad(args[0], acr), grad(args[0], tis))
    assert float(ma["clipfrac_upper"]) > 0  # the clip does bind somewhere


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_mis_with_infinite_band_is_untruncated_decoupled(level):
    lp, lprox, lbehav, adv, mask = random_batch(seed=3, spread=1.5)
    cfg = ObjectiveConfig(mode="mis", mis_lo=0.0, mis_hi=math.inf, mis_level=level)
    got, _ = policy_loss(lp, lprox, lbehav, adv, mask, cfg)
    if level == "token":
        expected, _, _ = np_reference(lp, lprox, lbehav, adv, mask, mode="tis", cap=math.inf)
        untruncated_cfg = ObjectiveConfig(mode="tis", cap=math.inf)
        untruncated, _ = policy_loss(lp, lprox, lbehav, adv, mask, untruncated_cfg)
        assert float(got) == pytest.approx(float(untruncated), rel=1e-6)
        assert np.exp(lprox - lbehav).max() > 2.0  # the default C would have truncated
    else:
        expected, _, _ = np_reference(
            lp, lprox, lbehav, adv, mask, mode="mis", mis_lo=0.0, mis_hi=math.inf, mis_level=level
        )
    assert float(got) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("mode", MODES)
def test_masked_tokens_change_nothing(mode, agg):
    lp, lprox, lbehav, adv, mask = random_batch(seed=4, spread=0.7, pad=False)
    cfg = ObjectiveConfig(mode=mode, agg=agg, agg_norm_len=7.0, kl_coef=0.01)
    lref = lp - 0.2
    base, base_m = policy_loss(lp, lprox, lbehav, adv, mask, cfg, logp_ref=lref)

    # Append one padded column and one padded row full of garbage.
    def pad(x, fill):
        x = np.concatenate([x, np.full((x.shape[0], 1), fill, x.dtype)], 1)
        return np.concatenate([x, np.full((1, x.shape[1]), fill, x.dtype)], 0)

    padded = [pad(lp, np.nan), pad(lprox, -np.inf), pad(lbehav, 1e9), pad(lref, np.nan)]
    adv_p = np.concatenate([adv, [1e6]]).astype(np.float32)
    mask_p = pad(mask, False)
    args = [jnp.asarray(x) for x in (padded[0], padded[1], padded[2], adv_p, mask_p)]
    loss, m = policy_loss(*args, cfg, logp_ref=jnp.asarray(padded[3]))
    assert float(loss) == pytest.approx(float(base), rel=1e-5)
    assert floats(m) == pytest.approx(floats(base_m), rel=1e-5, abs=1e-7)
    g = jax.grad(lambda x: policy_loss(x, *args[1:], cfg, logp_ref=jnp.asarray(padded[3]))[0])
    g_base = jax.grad(lambda x: policy_loss(x, lprox, lbehav, adv, mask, cfg, logp_ref=lref)[0])
    g_pad = np.asarray(g(args[0]))
    np.testing.assert_allclose(g_pad[:-1, :-1], np.asarray(g_base(jnp.asarray(lp))), rtol=1e-5)
    assert np.all(g_pad[-1] == 0) and np.all(g_pad[:, -1] == 0)


def test_acr_differs_from_tis_exactly_on_truncated_positive_tokens():
    rng = np.random.default_rng(5)
    shape = (16, 32)
    lprox = np.log(rng.uniform(0.05, 0.9, shape)).astype(np.float32)
    w = np.exp(rng.uniform(np.log(0.2), np.log(10.0), shape))
    ratio = np.exp(rng.uniform(np.log(0.5), np.log(4.0), shape))
    lbehav = (lprox - np.log(w)).astype(np.float32)
    lp = (lprox + np.log(ratio)).astype(np.float32)
    adv = rng.choice([-1.5, -0.5, 0.5, 2.0], size=shape).astype(np.float32)
    mask = np.ones(shape, bool)
    args = [jnp.asarray(x) for x in (lp, lprox, lbehav, adv, mask)]
    acr = token_terms(*args, ObjectiveConfig(mode="acr", cap=2.0, eps_high=0.28))
    tis = token_terms(*args, ObjectiveConfig(mode="tis", cap=2.0, eps_high=0.28))
    # Use the float32-rounded inputs for the predicate, as the function sees them.
    w32 = np.exp(lprox.astype(np.float64) - lbehav)
    r32 = np.exp(lp.astype(np.float64) - lprox)
    differ = np.abs(np.asarray(acr.loss) - np.asarray(tis.loss)) > 1e-5
    predicted = (w32 > 2.0) & (adv > 0) & (r32 > 1.28)
    assert predicted.sum() > 20
    np.testing.assert_array_equal(differ, predicted)
    upper = 1.28 / np.minimum(1.0, 2.0 / w32)
    np.testing.assert_allclose(np.asarray(acr.upper), upper, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(tis.upper), 1.28, rtol=1e-6)
    expected = -2.0 * np.minimum(r32, upper) * adv
    np.testing.assert_allclose(np.asarray(acr.loss)[predicted], expected[predicted], rtol=1e-5)
    assert np.all(np.asarray(acr.loss)[predicted] < np.asarray(tis.loss)[predicted])


@pytest.mark.parametrize("mode", ["tis", "acr"])
def test_acr_tis_gap_metrics_hand_values(mode):
    # One sequence of four tokens, C = 2, eps_high = 0.2, token_mean over 4 kept tokens:
    #   0: w = 4 (r = 1/2), A > 0, R = 1.5: TIS clips at 1.2, ACR's bound 2.4 does not bind.
    #   1: w = 4, A > 0, R = 3.0: both clip (at 1.2 and 2.4): equal zero gradients.
    #   2: w = 4, A < 0, R = 1.5: the lower side, the same in both.
    #   3: w = 1, A > 0, R = 1.1: not truncated, the same in both.
    w, ratio = np.array([[4.0, 4.0, 4.0, 1.0]]), np.array([[1.5, 3.0, 1.5, 1.1]])
    adv = np.array([[1.0, 1.0, -1.0, 1.0]])
    lprox = np.log(np.full((1, 4), 0.1))
    args = (lprox + np.log(ratio), lprox, lprox - np.log(w), adv, np.ones((1, 4), bool))
    cfg = ObjectiveConfig(mode=mode, cap=2.0, agg="token_mean")
    _, m = policy_loss(*args, cfg)
    assert float(m["acr/bound_frac"]) == pytest.approx(1 / 4)
    # d loss / d logp = -weight * A * R / 4 where the unclipped term is taken, else 0:
    # token 0 only in ACR (-2 * 1.5 / 4), token 2 (-2 * -1 * 1.5 / 4) and 3 (-1.1 / 4) in both.
    g_tis = np.array([0.0, 0.0, 0.75, -0.275])
    expected = 0.75 / np.linalg.norm(g_tis)
    assert float(m["acr/grad_rel_diff"]) == pytest.approx(expected, rel=1e-5)
    grads = {c: np.asarray(jax.grad(lambda x, c=c: policy_loss(x, *args[1:], ObjectiveConfig(
        mode=c, cap=2.0, agg="token_mean"))[0])(jnp.asarray(args[0], jnp.float32)))
        for c in ("tis", "acr")}
    np.testing.assert_allclose(grads["tis"][0], g_tis, rtol=1e-5)
    np.testing.assert_allclose(grads["acr"][0] - grads["tis"][0], [-0.75, 0, 0, 0], atol=1e-6)


def test_acr_tis_gap_is_zero_at_one_optimizer_step_and_absent_elsewhere():
    lp, lprox, lbehav, adv, mask = random_batch(seed=6, spread=1.5)
    assert np.exp(lprox - lbehav)[mask].max() > 2.0  # truncated tokens exist
    _, m = policy_loss(lprox, lprox, lbehav, adv, mask, ObjectiveConfig(mode="acr"))
    assert float(m["acr/bound_frac"]) == 0.0 and float(m["acr/grad_rel_diff"]) == 0.0
    for mode in ("naive", "on_policy", "mis", "sparse_rl"):
        _, m = policy_loss(lp, lprox, lbehav, adv, mask, ObjectiveConfig(mode=mode))
        assert not any(k.startswith("acr/") for k in m), mode


# ----------------------------------------------------------------------------- gradients


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("mode", MODES)
def test_gradient_matches_finite_differences(mode, agg):
    lp, lprox, lbehav, adv, mask = random_batch(seed=6, b=3, t=5, spread=0.7)
    lref = lp - 0.3
    cfg = ObjectiveConfig(mode=mode, agg=agg, kl_coef=0.05, veto_tau=0.05)
    rest = [jnp.asarray(x) for x in (lprox, lbehav, adv, mask)]

    def f(x):
        return policy_loss(x, *rest, cfg, logp_ref=jnp.asarray(lref))[0]

    x0 = jnp.asarray(lp)
    g = np.asarray(jax.grad(f)(x0))
    assert np.all(np.isfinite(g)) and np.abs(g).max() > 1e-3
    direction = np.random.default_rng(7).normal(size=lp.shape).astype(np.float32)
    h = 1e-3
    fd = (float(f(x0 + h * direction)) - float(f(x0 - h * direction))) / (2 * h)
    assert fd == pytest.approx(float(np.sum(g * direction)), rel=2e-2, abs=2e-3)


@pytest.mark.parametrize("mode", MODES)
def test_no_gradient_into_old_policies_or_weights(mode):
    lp, lprox, lbehav, adv, mask = (jnp.asarray(x) for x in random_batch(seed=8, spread=0.7))
    cfg = ObjectiveConfig(mode=mode, batch_normalize=True, kl_coef=0.1, veto_tau=0.05)
    lref = lp - 0.1

    def f(lp_, lprox_, lbehav_, adv_, lref_):
        return policy_loss(lp_, lprox_, lbehav_, adv_, mask, cfg, logp_ref=lref_)[0]

    grads = jax.grad(f, argnums=(0, 1, 2, 3, 4))(lp, lprox, lbehav, adv, lref)
    assert np.abs(np.asarray(grads[0])).max() > 1e-3
    for g in grads[1:]:
        np.testing.assert_array_equal(np.asarray(g), 0.0)
    # The weights do not carry gradient either: d loss / d logp with the weight as a constant.
    terms = token_terms(lp, lprox, lbehav, adv, mask, cfg)
    assert (
        jax.grad(lambda x: jnp.sum(token_terms(x, lprox, lbehav, adv, mask, cfg).weight))(lp).sum()
        == 0.0
    )
    assert terms.weight.shape == lp.shape


# ----------------------------------------------------------------------------- unbiasedness


def _mc_gradient(mode: str, cap: float, n: int, seed: int):
    k = 6
    rng = np.random.default_rng(seed)
    theta = jnp.asarray(rng.normal(size=k), jnp.float32)
    mu = rng.dirichlet(np.full(k, 2.0))
    a_of_x = rng.normal(size=k)
    pi = np.asarray(jax.nn.softmax(theta), np.float64)
    exact = pi * (a_of_x - np.sum(pi * a_of_x))  # grad of sum_x pi(x) A(x) w.r.t. the logits
    x = rng.choice(k, size=n, p=mu)
    lbehav = jnp.asarray(np.log(mu)[x][:, None], jnp.float32)
    adv = jnp.asarray(a_of_x[x], jnp.float32)
    mask = jnp.ones((n, 1), bool)
    cfg = ObjectiveConfig(mode=mode, cap=cap, agg="token_mean")

    def objective(th):
        logp = jax.nn.log_softmax(th)[x][:, None]
        return -policy_loss(logp, jax.lax.stop_gradient(logp), lbehav, adv, mask, cfg)[0]

    estimate = np.asarray(jax.jit(jax.grad(objective))(theta), np.float64)
    # Per-sample terms w A (e_x - pi) give the Monte-Carlo standard error of each component.
    w = np.minimum(pi[x] / mu[x], cap)
    per = (w * a_of_x[x])[:, None] * (np.eye(k)[x] - pi[None, :])
    stderr = per.std(0) / np.sqrt(n)
    return estimate, exact, stderr


def test_tis_with_large_cap_is_unbiased():
    estimate, exact, stderr = _mc_gradient("tis", cap=1e6, n=200_000, seed=11)
    assert np.all(np.abs(estimate - exact) < 5 * stderr + 1e-5), (estimate, exact, stderr)
    # The same check fails for a truncation that binds, so the test can tell biased from unbiased.
    biased, exact_b, stderr_b = _mc_gradient("tis", cap=0.5, n=200_000, seed=11)
    assert np.any(np.abs(biased - exact_b) > 10 * stderr_b)


# ----------------------------------------------------------------------------- metrics


def test_metrics_hand_values():
    # Two sequences, three tokens; the last token of sequence 1 is padding.
    w = np.array([[4.0, 1.0, 0.5], [1.0, 2.0, 9.0]])
    ratio = np.array([[1.5, 1.0, 0.5], [1.0, 1.0, 1.0]])
    lprox = np.log(np.full((2, 3), 0.1))
    lbehav = lprox - np.log(w)
    lp = lprox + np.log(ratio)
    adv = np.array([[1.0, 1.0, -1.0], [1.0, 1.0, 1.0]])
    mask = np.array([[1, 1, 1], [1, 1, 0]], bool)
    _, m = policy_loss(lp, lprox, lbehav, adv, mask, ObjectiveConfig(mode="tis", cap=2.0))
    valid_w = np.array([4.0, 1.0, 0.5, 1.0, 2.0])
    applied = np.minimum(valid_w, 2.0)
    expected = {
        "clipfrac_upper": 1 / 5,  # token (0, 0): A > 0, R = 1.5 > 1.2
        "clipfrac_lower": 1 / 5,  # token (0, 2): A < 0, R = 0.5 < 0.8
        "clipfrac": 2 / 5,
        "truncated_frac": 1 / 5,  # only w = 4 exceeds C = 2 (the padded 9 does not count)
        "masked_token_frac": 0.0,
        "vetoed_seq_frac": 0.0,
        "valid_tokens": 5.0,
        "is_weight_mean": applied.mean(),
        "is_weight_max": 2.0,
        "is_weight_min": 0.5,
        "is_ess": applied.sum() ** 2 / (5 * np.sum(applied**2)),
        "raw_is_weight_mean": valid_w.mean(),
        "raw_is_weight_max": 4.0,
        "raw_is_weight_min": 0.5,
        "raw_is_ess": valid_w.sum() ** 2 / (5 * np.sum(valid_w**2)),
        "raw_is_chi2": np.mean(valid_w**2) - 1.0,
        "kl_behav_prox_k1": np.mean(-np.log(valid_w)),
        "kl_behav_prox_k3": np.mean(valid_w - 1 - np.log(valid_w)),
        "logp_gap_abs_mean": np.mean(np.abs(np.log(valid_w))),
        "logp_gap_abs_max": np.log(4.0),
        "ratio_max": 1.5,
    }
    for key, value in expected.items():
        assert float(m[key]) == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert all(v.shape == () and v.dtype == jnp.float32 for v in m.values())


def test_rejection_metrics():
    w = np.array([[5e-5, 1.0], [1.0, 3.0], [1.0, 1.0]])
    lprox = np.log(np.full((3, 2), 0.5))
    args = (lprox, lprox, lprox - np.log(w), np.ones(3), np.ones((3, 2), bool))
    cfg = ObjectiveConfig(mode="sparse_rl", sparse_mask_band=(0.5, 1.5))
    _, m = policy_loss(*args, cfg)
    assert float(m["vetoed_seq_frac"]) == pytest.approx(1 / 3)
    assert float(m["masked_token_frac"]) == pytest.approx(3 / 6)  # 2 vetoed + the w = 3 token
    assert float(m["kept_tokens"]) == 3.0
    assert float(m["truncated_frac"]) == pytest.approx(1 / 6)  # w = 3 > 1.5


# ----------------------------------------------------------------------------- jit, vmap, dtypes


@pytest.mark.parametrize("mode", MODES)
def test_jit_matches_eager(mode):
    args = [jnp.asarray(x) for x in random_batch(seed=9, spread=0.7)]
    cfg = ObjectiveConfig(mode=mode)
    eager, em = policy_loss(*args, cfg)
    jitted, jm = jax.jit(policy_loss, static_argnames="cfg")(*args, cfg=cfg)
    assert float(jitted) == pytest.approx(float(eager), rel=1e-6)
    assert floats(jm) == pytest.approx(floats(em), rel=1e-5, abs=1e-7)


@pytest.mark.parametrize(
    "kw",
    [
        dict(mode="acr"),
        dict(mode="sparse_rl", veto_tau=0.1),
        dict(mode="mis", mis_level="sequence"),
    ],
)
def test_vmap_matches_loop(kw):
    batches = [random_batch(seed=s, spread=0.8) for s in range(3)]
    stacked = [jnp.asarray(np.stack(parts)) for parts in zip(*batches, strict=True)]
    cfg = ObjectiveConfig(**kw)
    losses, metrics = jax.jit(jax.vmap(lambda *a: policy_loss(*a, cfg)))(*stacked)
    for i, parts in enumerate(batches):
        loss, m = policy_loss(*parts, cfg)
        assert float(losses[i]) == pytest.approx(float(loss), rel=1e-5)
        assert float(metrics["clipfrac"][i]) == pytest.approx(float(m["clipfrac"]))


@pytest.mark.parametrize("mode", MODES)
def test_bfloat16_inputs(mode):
    args = [jnp.asarray(x) for x in random_batch(seed=10, spread=0.7)]
    bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in args]
    up = [a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in bf]
    cfg = ObjectiveConfig(mode=mode)
    loss_bf, m = policy_loss(*bf, cfg)
    loss_up, _ = policy_loss(*up, cfg)
    assert loss_bf.dtype == jnp.float32 and all(v.dtype == jnp.float32 for v in m.values())
    assert float(loss_bf) == pytest.approx(float(loss_up), rel=1e-6, abs=1e-7)
    loss_f32, _ = policy_loss(*args, cfg)
    assert float(loss_bf) == pytest.approx(float(loss_f32), rel=0.1, abs=0.02)
    g = jax.grad(lambda x: policy_loss(x, *bf[1:], cfg)[0])(bf[0])
    assert g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g)))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(mode="flashrl"), "mode"),
        (dict(cap=0.0), "cap"),
        (dict(cap=-2.0), "cap"),
        (dict(agg="sum"), "agg"),
        (dict(eps_low=1.0), "eps_low"),
        (dict(eps_high=-0.1), "eps_high"),
        (dict(kl_estimator="k2"), "kl_estimator"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(mis_lo=2.0, mis_hi=1.0), "mis_hi"),
        (dict(mis_level="batch"), "mis_level"),
        (dict(sparse_cap=0.0), "sparse_cap"),
        (dict(sparse_mask_band=(1.5, 0.5)), "sparse_mask_band"),
        (dict(sparse_mask_band=(0.5,)), "sparse_mask_band"),
        (dict(logratio_clamp=0.0), "logratio_clamp"),
        (dict(agg_norm_len=0.0), "agg_norm_len"),
        (dict(kl_coef=-1.0), "kl_coef"),
        (dict(veto_tau=-1.0), "veto_tau"),
    ],
)
def test_bad_config_raises(kw, field):
    with pytest.raises(ValueError, match=f"ObjectiveConfig.{field}"):
        ObjectiveConfig(**kw)


def test_bad_inputs_raise():
    lp, lprox, lbehav, adv, mask = (jnp.asarray(x) for x in random_batch(seed=12))
    cfg = ObjectiveConfig()
    with pytest.raises(ValueError, match="logp_prox"):
        policy_loss(lp, lprox[:, :-1], lbehav, adv, mask, cfg)
    with pytest.raises(ValueError, match="logp_behav"):
        policy_loss(lp, lprox, lbehav[:-1], adv, mask, cfg)
    with pytest.raises(ValueError, match="mask"):
        policy_loss(lp, lprox, lbehav, adv, mask[:, :2], cfg)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lprox, lbehav, adv[:-1], mask, cfg)
    with pytest.raises(ValueError, match="logp: expected shape"):
        policy_loss(lp[0], lprox[0], lbehav[0], adv, mask[0], cfg)
    with pytest.raises(ValueError, match="logp: expected a floating"):
        policy_loss(lp.astype(jnp.int32), lprox, lbehav, adv, mask, cfg)
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(lp, lprox, lbehav, adv, mask, ObjectiveConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(lp, lprox, lbehav, adv, mask, cfg, logp_ref=lp[:, :1])
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(lp, lprox, lbehav, adv, mask, ObjectiveConfig(entropy_coef=0.1))
    with pytest.raises(TypeError, match="cfg"):
        policy_loss(lp, lprox, lbehav, adv, mask, {"mode": "acr"})


def test_config_accepts_strings_and_is_hashable():
    cfg = ObjectiveConfig(mode="tis", agg="token_mean", sparse_mask_band=[0.5, 1.5])
    assert cfg.mode is obj.Mode.TIS and cfg.agg == "token_mean"
    assert cfg.sparse_mask_band == (0.5, 1.5)
    assert hash(cfg) == hash(
        ObjectiveConfig(mode=obj.Mode.TIS, agg="token_mean", sparse_mask_band=(0.5, 1.5))
    )
    assert ObjectiveConfig().mode == "acr"


def test_import_stays_light():
    code = (
        "import sys, qurl_jax.rl, qurl_jax.rl.objectives;"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('flax', 'transformers', 'torch',"
        " 'optax') or m.startswith(('qurl_jax.models', 'qurl_jax.quant', 'qurl_jax.sampling'))];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
