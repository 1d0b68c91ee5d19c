"""Policy-gradient objectives for RL with a mismatched (quantized or KV-compressed) rollout policy.

Three policies meet in one loss: the learner `logp` (differentiable), the full-precision old policy
`logp_prox` recomputed by the learner (QuRL's proximal policy, the trust-region anchor) and the
sampler's own `logp_behav` (the INT8/FP8 or sparse-KV behaviour policy that generated the tokens).
`policy_loss` turns them into one scalar with a `mode` that selects the correction: plain PPO/GRPO
(`on_policy`), the quantized actor as old policy (`naive`, the collapsing baseline), decoupled PPO
with a truncated importance weight (`tis`, FlashRL), masked importance sampling (`mis`, IcePop /
verl rollout correction), QuRL's Adaptive Clipping Range (`acr`, the default) and Sparse-RL's
rejection plus reweighting (`sparse_rl`). Everything here is a pure function of arrays that imports
only jax and the standard library, so it jits, vmaps and can be imported into any JAX training
loop. Formulas: docs/methods.md sections 1, 2 and 4.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import numbers
from typing import NamedTuple

import jax
import jax.numpy as jnp

from qurl_jax.runtime.enums import coerce_enum_fields

Array = jax.Array


class Mode(enum.StrEnum):
    """Which old policy the PPO ratio uses and how the behaviour/proximal mismatch is corrected.

    With w = pi_prox / pi_behav (stop-gradient, log clamped to +-`logratio_clamp`) and the ratio
    R = pi_theta / pi_old, every mode computes per token

        loss_t = -weight_t * min(R_t A_t, clip(R_t, 1 - eps_low, upper_t) A_t)

    over the tokens it keeps, and differs in `pi_old`, `weight`, `upper` and the kept tokens:

    - ON_POLICY: pi_old = pi_prox, weight 1, upper 1 + eps_high. Plain PPO/GRPO; correct only when
      the sampler is the full-precision policy (behav == prox).
    - NAIVE: pi_old = pi_behav, weight 1. The quantized actor as old policy (QuRL Eq. 3); kept as
      the baseline that collapses.
    - TIS: pi_old = pi_prox, weight min(w, C), upper 1 + eps_high. Decoupled PPO with FlashRL's
      truncated importance sampling (QuRL Eq. 4/5).
    - MIS: pi_old = pi_prox, weight w, and tokens (or whole sequences, see `ISLevel`) whose weight
      falls outside [mis_lo, mis_hi] are dropped from the loss *and* from its denominator.
    - ACR: QuRL's Adaptive Clipping Range (Eq. 9). pi_old = pi_prox, weight min(w, C) = w * r with
      r = min(1, C / w) = min(1, C * pi_behav / pi_prox) in (0, 1], and the upper clip bound is
      (1 + eps_high) / r; the lower bound stays 1 - eps_low. TIS multiplies the clipped ratio by r,
      so on a truncated token its trust region for r * R is [r (1 - eps_low), r (1 + eps_high)]:
      the upper bound binds too early for A > 0. Dividing the upper bound by r restores the fixed
      cap 1 + eps_high on r * R. On every token that is not truncated (w <= C) we have r = 1, so
      the upper bound is exactly 1 + eps_high and the weight exactly min(w, C) = w: ACR then
      computes the same loss, the same gradient and the same metrics as TIS. The two differ only
      on truncated tokens with A > 0 and R > 1 + eps_high.
    - SPARSE_RL: Sparse-RL (pi_old = pi_prox, the dense-KV policy): a sequence is vetoed (dropped
      with its denominator) when any of its tokens has w < `veto_tau`; the weight is
      min(w, `sparse_cap`); optionally tokens with w outside `sparse_mask_band` are dropped.
      `sparse_base` = ACR also applies the adaptive upper bound with r = min(1, sparse_cap / w),
      for runs that are quantized and sparse at once.
    """

    ON_POLICY = "on_policy"
    NAIVE = "naive"
    TIS = "tis"
    MIS = "mis"
    ACR = "acr"
    SPARSE_RL = "sparse_rl"


class Aggregation(enum.StrEnum):
    """How per-token losses become a scalar (sequences without kept tokens are left out entirely).

    - TOKEN_MEAN (DAPO): sum over all kept tokens / number of kept tokens.
    - SEQ_MEAN_TOKEN_MEAN (GRPO): mean over sequences of the mean over that sequence's kept tokens.
    - SEQ_MEAN_TOKEN_SUM_NORM (Dr.GRPO): mean over sequences of (sum over kept tokens) / L with a
      constant L (`agg_norm_len`, default the padded response length T).
    """

    TOKEN_MEAN = "token_mean"
    SEQ_MEAN_TOKEN_MEAN = "seq_mean_token_mean"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq_mean_token_sum_norm"


class KLEstimator(enum.StrEnum):
    """Per-token estimator of KL(pi_theta || pi_ref) on tokens sampled from the policy.

    K1: log(pi_theta / pi_ref).
    K3 (low variance, always >= 0): pi_ref / pi_theta - log(pi_ref / pi_theta) - 1.
    """

    K1 = "k1"
    K3 = "k3"


class ISLevel(enum.StrEnum):
    """Granularity of the MIS weight: per token, product over the sequence, or geometric mean."""

    TOKEN = "token"
    SEQUENCE = "sequence"
    GEOMETRIC = "geometric"


class SparseBase(enum.StrEnum):
    """Clipping rule under Sparse-RL's reweighting: plain decoupled PPO (TIS) or QuRL's ACR."""

    TIS = "tis"
    ACR = "acr"


def _real(x: object) -> bool:
    """A real number (Python or numpy scalar), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


_ENUM_FIELDS = {
    "mode": Mode,
    "agg": Aggregation,
    "kl_estimator": KLEstimator,
    "mis_level": ISLevel,
    "sparse_base": SparseBase,
}


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Hyper-parameters of `policy_loss`; frozen and hashable, so it can be a static jit argument.

    String values are accepted for the enum fields and converted; the config validates itself on
    construction (and `policy_loss` validates again), raising ValueError that names the field.

    Attributes:
      mode: correction mode, see `Mode`. Default ACR (QuRL).
      eps_low, eps_high: PPO clip range [1 - eps_low, 1 + eps_high] (clip-higher: eps_high 0.28).
      cap: truncation C of w = pi_prox / pi_behav for TIS and ACR (FlashRL: 2 for GSM8K, 5 or 8
        for DAPO). May be math.inf (no truncation).
      agg: loss aggregation, see `Aggregation`.
      agg_norm_len: the constant L of SEQ_MEAN_TOKEN_SUM_NORM; None uses the padded length T.
      kl_coef: coefficient of the KL(pi_theta || pi_ref) penalty (QuRL GRPO 1e-3, Sparse-RL 1e-4);
        needs `logp_ref`.
      kl_estimator: K1 or K3 (default, low variance).
      entropy_coef: coefficient of the entropy bonus (subtracted from the loss); needs `entropy`.
      dual_clip: None, or c > 1: for A < 0 the per-token loss is capped at -c * A (dual-clip PPO).
      logratio_clamp: safety clamp |log ratio| <= this for both w and R (Sparse-RL / verl use 20).
      mis_lo, mis_hi: MIS acceptance band for the weight (IcePop [0.5, 5]; token MIS [0.5, 2]).
        mis_lo = 0 and mis_hi = math.inf accept everything (plain decoupled PPO with weight w).
      mis_level: MIS weight granularity, see `ISLevel`.
      veto_tau: Sparse-RL sequence veto threshold on w (1e-4); None disables the veto.
      sparse_cap: Sparse-RL truncation of w (1.5); `cap` is not used in SPARSE_RL mode.
      sparse_mask_band: None, or (lo, hi): Sparse-RL also drops tokens whose w is outside [lo, hi]
        (the released config uses (0.5, 1.5)).
      sparse_base: TIS or ACR clipping in SPARSE_RL mode.
      batch_normalize: rescale the applied weights to mean 1 over the kept tokens of the batch (MIS,
        Sparse-RL option). No effect in ON_POLICY/NAIVE, whose weights are all 1.
    """

    mode: Mode = Mode.ACR
    eps_low: float = 0.2
    eps_high: float = 0.2
    cap: float = 2.0
    agg: Aggregation = Aggregation.SEQ_MEAN_TOKEN_MEAN
    agg_norm_len: float | None = None
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = KLEstimator.K3
    entropy_coef: float = 0.0
    dual_clip: float | None = None
    logratio_clamp: float = 20.0
    mis_lo: float = 0.5
    mis_hi: float = 2.0
    mis_level: ISLevel = ISLevel.TOKEN
    veto_tau: float | None = 1e-4
    sparse_cap: float = 1.5
    sparse_mask_band: tuple[float, float] | None = None
    sparse_base: SparseBase = SparseBase.TIS
    batch_normalize: bool = False

    def __post_init__(self) -> None:
        coerce_enum_fields(self, _ENUM_FIELDS)
        if self.sparse_mask_band is not None:
            band = self.sparse_mask_band
            if not isinstance(band, tuple | list) or len(band) != 2 or not all(map(_real, band)):
                raise ValueError(
                    "ObjectiveConfig.sparse_mask_band: expected None or a (lo, hi) pair of "
                    f"numbers, got {band!r}"
                )
            object.__setattr__(self, "sparse_mask_band", (float(band[0]), float(band[1])))
        self.validate()

    def validate(self) -> ObjectiveConfig:
        """Checks every field; raises ValueError naming the first bad one. Returns self."""

        def fail(field: str, message: str) -> None:
            raise ValueError(f"ObjectiveConfig.{field}: {message}, got {getattr(self, field)!r}")

        def finite(x: object) -> bool:
            return _real(x) and math.isfinite(x)

        for name, kind in _ENUM_FIELDS.items():
            if not isinstance(getattr(self, name), kind):
                fail(name, f"must be a {kind.__name__}")
        if not finite(self.eps_low) or not 0.0 <= self.eps_low < 1.0:
            fail("eps_low", "must be in [0, 1)")
        if not finite(self.eps_high) or self.eps_high < 0.0:
            fail("eps_high", "must be a finite number >= 0")
        if not _real(self.cap) or math.isnan(self.cap) or self.cap <= 0.0:
            fail("cap", "the truncation C must be > 0 (math.inf disables truncation)")
        norm_len = self.agg_norm_len
        if norm_len is not None and (not finite(norm_len) or norm_len <= 0):
            fail("agg_norm_len", "must be None or a finite number > 0")
        if not finite(self.kl_coef) or self.kl_coef < 0.0:
            fail("kl_coef", "must be a finite number >= 0")
        if not finite(self.entropy_coef):
            fail("entropy_coef", "must be a finite number")
        if self.dual_clip is not None and (not finite(self.dual_clip) or self.dual_clip <= 1.0):
            fail("dual_clip", "must be None or a finite number > 1")
        if not finite(self.logratio_clamp) or self.logratio_clamp <= 0.0:
            fail("logratio_clamp", "must be a finite number > 0")
        if not finite(self.mis_lo) or self.mis_lo < 0.0:
            fail("mis_lo", "must be a finite number >= 0")
        if not _real(self.mis_hi) or math.isnan(self.mis_hi):
            fail("mis_hi", "must be a number (math.inf allowed)")
        if self.mis_hi <= self.mis_lo:
            fail("mis_hi", f"must be > mis_lo = {self.mis_lo}")
        if self.veto_tau is not None and (not finite(self.veto_tau) or self.veto_tau < 0.0):
            fail("veto_tau", "must be None or a finite number >= 0")
        if not _real(self.sparse_cap) or math.isnan(self.sparse_cap) or self.sparse_cap <= 0.0:
            fail("sparse_cap", "must be > 0 (math.inf disables truncation)")
        if self.sparse_mask_band is not None:
            lo, hi = self.sparse_mask_band
            if math.isnan(lo) or math.isnan(hi) or lo < 0.0 or hi <= lo:
                fail("sparse_mask_band", "must satisfy 0 <= lo < hi")
        if not isinstance(self.batch_normalize, bool):
            fail("batch_normalize", "must be a bool")
        return self


class TokenTerms(NamedTuple):
    """Per-token pieces of the objective, all [B, T] except `vetoed` [B].

    loss: f32 per-token policy-gradient loss weight * (-clipped surrogate), 0 where not kept.
    mask: bool tokens that enter the loss and its denominators (valid and not rejected or vetoed).
    weight: f32 applied importance weight (stop-gradient; 1 in ON_POLICY/NAIVE).
    ratio: f32 R = pi_theta / pi_old (differentiable).
    lower, upper: f32 clip bounds used for R.
    log_w: f32 log(pi_prox / pi_behav) after the safety clamp (0 on invalid tokens).
    truncated: bool valid tokens whose weight was truncated by the cap (TIS, ACR, SPARSE_RL).
    vetoed: bool sequences removed by the Sparse-RL veto.
    """

    loss: Array
    mask: Array
    weight: Array
    ratio: Array
    lower: Array
    upper: Array
    log_w: Array
    truncated: Array
    vetoed: Array


def _safe_div(num: Array, den: Array) -> Array:
    """num / den, or 0 where den == 0 (empty masks)."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


def _masked_mean(x: Array, mask: Array) -> Array:
    return _safe_div(jnp.sum(jnp.where(mask, x, 0.0)), jnp.sum(mask, dtype=jnp.float32))


def _masked_max(x: Array, mask: Array) -> Array:
    return jnp.where(jnp.any(mask), jnp.max(jnp.where(mask, x, -jnp.inf)), 0.0)


def _masked_min(x: Array, mask: Array) -> Array:
    return jnp.where(jnp.any(mask), jnp.min(jnp.where(mask, x, jnp.inf)), 0.0)


def _ess(w: Array, mask: Array) -> Array:
    """Normalised effective sample size (sum w)^2 / (n sum w^2) in (0, 1]; 1 = uniform weights."""
    n = jnp.sum(mask, dtype=jnp.float32)
    s1 = jnp.sum(jnp.where(mask, w, 0.0))
    s2 = jnp.sum(jnp.where(mask, w * w, 0.0))
    return _safe_div(s1 * s1, n * s2)


def aggregate(
    values: Array, mask: Array, agg: Aggregation | str, norm_len: float | None = None
) -> Array:
    """Reduces per-token values f[B, T] over bool mask[B, T] to a scalar f32 (see `Aggregation`).

    Tokens outside the mask are ignored, whatever they hold, and sequences without any masked-in
    token are left out of the sequence count. An empty mask gives 0.
    """
    agg = Aggregation(agg)
    mask = mask.astype(bool)
    v = jnp.where(mask, values.astype(jnp.float32), 0.0)
    tokens_per_seq = jnp.sum(mask, axis=-1, dtype=jnp.float32)
    if agg == Aggregation.TOKEN_MEAN:
        return _safe_div(jnp.sum(v), jnp.sum(tokens_per_seq))
    if agg == Aggregation.SEQ_MEAN_TOKEN_MEAN:
        per_seq = _safe_div(jnp.sum(v, axis=-1), tokens_per_seq)
    else:
        length = float(values.shape[-1]) if norm_len is None else float(norm_len)
        per_seq = jnp.sum(v, axis=-1) / length
    n_seq = jnp.sum(tokens_per_seq > 0, dtype=jnp.float32)
    return _safe_div(jnp.sum(per_seq), n_seq)


def loss_weight(metrics: dict[str, Array], agg: Aggregation | str) -> Array:
    """The count `aggregate` divided by in the batch that produced `metrics` (`policy_loss`'s):
    kept tokens for token_mean, kept sequences otherwise.

    Splitting a batch into micro-batches and combining their losses (and gradients) weighted by
    this count, divided by its total, gives exactly the loss of the whole batch; a plain mean of the
    micro-batch losses does not when micro-batches keep different numbers of tokens.
    """
    if Aggregation(agg) == Aggregation.TOKEN_MEAN:
        return metrics["kept_tokens"]
    return metrics["kept_sequences"]


def _check_inputs(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    logp_ref: Array | None,
    entropy: Array | None,
) -> None:
    shape = jnp.shape(logp)
    if len(shape) != 2:
        raise ValueError(f"logp: expected shape [batch, response_len], got {shape}")
    named = {"logp": logp, "logp_prox": logp_prox, "logp_behav": logp_behav, "mask": mask}
    if logp_ref is not None:
        named["logp_ref"] = logp_ref
    if entropy is not None:
        named["entropy"] = entropy
    for name, x in named.items():
        if jnp.shape(x) != shape:
            raise ValueError(f"{name}: shape {jnp.shape(x)} does not match logp shape {shape}")
        if name != "mask" and not jnp.issubdtype(jnp.result_type(x), jnp.floating):
            raise ValueError(f"{name}: expected a floating dtype, got {jnp.result_type(x)}")
    if jnp.shape(advantages) not in (shape, shape[:1]):
        raise ValueError(
            f"advantages: expected shape {shape[:1]} (per sequence) or {shape} (per token), "
            f"got {jnp.shape(advantages)}"
        )


def _checked(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    cfg: ObjectiveConfig,
    logp_ref: Array | None,
    entropy: Array | None,
) -> tuple[Array | None, ...]:
    """Validates the config and the inputs (eagerly, before tracing); returns them as jax arrays."""
    if not isinstance(cfg, ObjectiveConfig):
        raise TypeError(f"cfg: expected an ObjectiveConfig, got {type(cfg).__name__}")
    cfg.validate()
    arrays = [jnp.asarray(x) for x in (logp, logp_prox, logp_behav, advantages, mask)]
    logp_ref = None if logp_ref is None else jnp.asarray(logp_ref)
    entropy = None if entropy is None else jnp.asarray(entropy)
    _check_inputs(*arrays, logp_ref, entropy)
    return (*arrays, logp_ref, entropy)


def token_terms(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    cfg: ObjectiveConfig,
) -> TokenTerms:
    """Per-token policy-gradient terms for `cfg.mode` (see `Mode`), before aggregation.

    Args:
      logp: f[B, T] learner log-probs of the sampled tokens (the only input that gets a gradient).
      logp_prox: f[B, T] full-precision old-policy log-probs (stop-gradient).
      logp_behav: f[B, T] sampler (behaviour) log-probs (stop-gradient).
      advantages: f[B] per sequence or f[B, T] per token (stop-gradient).
      mask: bool (or 0/1) [B, T] valid response tokens. Values of the other inputs outside the mask
        never matter, not even NaNs or infinities in padding.
      cfg: the objective configuration.
    """
    args = _checked(logp, logp_prox, logp_behav, advantages, mask, cfg, None, None)
    return _token_terms(*args[:5], cfg)


def _token_terms(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    cfg: ObjectiveConfig,
) -> TokenTerms:
    """`token_terms` on already checked arrays."""
    f32 = jnp.float32
    valid = jnp.asarray(mask).astype(bool)
    # Sanitise padding before any exp/log so that neither values nor gradients see garbage there.
    lp = jnp.where(valid, logp.astype(f32), 0.0)
    lp_prox = jnp.where(valid, jax.lax.stop_gradient(logp_prox.astype(f32)), 0.0)
    lp_behav = jnp.where(valid, jax.lax.stop_gradient(logp_behav.astype(f32)), 0.0)
    adv = jax.lax.stop_gradient(advantages.astype(f32))
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, lp.shape)
    adv = jnp.where(valid, adv, 0.0)
    clamp = float(cfg.logratio_clamp)

    log_w = jnp.clip(lp_prox - lp_behav, -clamp, clamp)
    lp_old = lp_behav if cfg.mode == Mode.NAIVE else lp_prox
    ratio = jnp.exp(jnp.clip(lp - lp_old, -clamp, clamp))

    keep = valid
    vetoed = jnp.zeros(lp.shape[:1], bool)
    truncated = jnp.zeros(lp.shape, bool)
    upper = jnp.full(lp.shape, 1.0 + cfg.eps_high, f32)
    weight = jnp.ones(lp.shape, f32)

    if cfg.mode == Mode.MIS:
        if cfg.mis_level == ISLevel.TOKEN:
            log_weight = log_w
        else:
            seq_sum = jnp.sum(log_w, axis=-1, keepdims=True)
            if cfg.mis_level == ISLevel.GEOMETRIC:
                count = jnp.sum(valid, axis=-1, keepdims=True, dtype=f32)
                seq_sum = _safe_div(seq_sum, count)
            log_weight = jnp.broadcast_to(jnp.clip(seq_sum, -clamp, clamp), lp.shape)
        weight = jnp.exp(log_weight)
        keep = keep & (weight >= cfg.mis_lo) & (weight <= cfg.mis_hi)
    elif cfg.mode in (Mode.TIS, Mode.ACR, Mode.SPARSE_RL):
        cap = cfg.sparse_cap if cfg.mode == Mode.SPARSE_RL else cfg.cap
        # log r = log(min(w, C) / w) <= 0; computed in log space so that huge w cannot overflow.
        if math.isfinite(cap):
            log_r = jnp.minimum(0.0, math.log(cap) - log_w)
        else:
            log_r = jnp.zeros_like(log_w)
        weight = jnp.exp(log_w + log_r)
        truncated = valid & (log_r < 0.0)
        adaptive = cfg.mode == Mode.ACR or (
            cfg.mode == Mode.SPARSE_RL and cfg.sparse_base == SparseBase.ACR
        )
        if adaptive:
            upper = (1.0 + cfg.eps_high) * jnp.exp(-log_r)
        if cfg.mode == Mode.SPARSE_RL:
            if cfg.veto_tau is not None and cfg.veto_tau > 0.0:
                below = valid & (log_w < math.log(cfg.veto_tau))
                vetoed = jnp.any(below, axis=-1)
                keep = keep & ~vetoed[:, None]
            if cfg.sparse_mask_band is not None:
                lo, hi = cfg.sparse_mask_band
                w_raw = jnp.exp(log_w)
                keep = keep & (w_raw >= lo) & (w_raw <= hi)

    if cfg.batch_normalize:
        weight = weight / jnp.where(jnp.any(keep), _masked_mean(weight, keep), 1.0)

    lower = jnp.full(lp.shape, 1.0 - cfg.eps_low, f32)
    clipped = jnp.clip(ratio, lower, upper)
    pg = -jnp.minimum(ratio * adv, clipped * adv)
    if cfg.dual_clip is not None:
        pg = jnp.where(adv < 0, jnp.minimum(pg, -cfg.dual_clip * adv), pg)
    weight = jax.lax.stop_gradient(weight)
    loss = jnp.where(keep, weight * pg, 0.0)
    return TokenTerms(loss, keep, weight, ratio, lower, upper, log_w, truncated, vetoed)


def mismatch_metrics(
    logp_prox: Array, logp_behav: Array, mask: Array, logratio_clamp: float = 20.0
) -> dict[str, Array]:
    """Behaviour/proximal mismatch statistics over valid tokens (no truncation, no rejection).

    Tokens are sampled from pi_behav, so with w = pi_prox / pi_behav (log clamped to
    +-`logratio_clamp`): KL(behav || prox) is estimated by k1 = mean(-log w) and by the
    low-variance, always non-negative k3 = mean(w - 1 - log w); chi2(prox || behav) by
    mean(w^2) - 1.

    Args:
      logp_prox, logp_behav: f[B, T] log-probs of the sampled tokens.
      mask: bool [B, T] valid tokens.

    Returns:
      f32 scalars: raw_is_weight_mean/max/min, raw_is_ess, raw_is_chi2, kl_behav_prox_k1,
      kl_behav_prox_k3, logp_gap_abs_mean, logp_gap_abs_max.
    """
    valid = jnp.asarray(mask).astype(bool)
    lp_prox = jnp.where(valid, jax.lax.stop_gradient(logp_prox).astype(jnp.float32), 0.0)
    lp_behav = jnp.where(valid, jax.lax.stop_gradient(logp_behav).astype(jnp.float32), 0.0)
    gap = lp_prox - lp_behav
    log_w = jnp.clip(gap, -logratio_clamp, logratio_clamp)
    w = jnp.exp(log_w)
    return {
        "raw_is_weight_mean": _masked_mean(w, valid),
        "raw_is_weight_max": _masked_max(w, valid),
        "raw_is_weight_min": _masked_min(w, valid),
        "raw_is_ess": _ess(w, valid),
        "raw_is_chi2": _masked_mean(w * w, valid) - jnp.where(jnp.any(valid), 1.0, 0.0),
        "kl_behav_prox_k1": _masked_mean(-log_w, valid),
        "kl_behav_prox_k3": _masked_mean(w - 1.0 - log_w, valid),
        "logp_gap_abs_mean": _masked_mean(jnp.abs(gap), valid),
        "logp_gap_abs_max": _masked_max(jnp.abs(gap), valid),
    }


def policy_loss(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    cfg: ObjectiveConfig,
    *,
    logp_ref: Array | None = None,
    entropy: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The RL loss to minimise: aggregated policy-gradient loss + KL penalty - entropy bonus.

        loss = agg(token_terms.loss) + kl_coef * agg(KL_t) - entropy_coef * agg(H_t)

    with KL_t an estimate of KL(pi_theta || pi_ref), all aggregated with `cfg.agg` over the kept
    tokens (valid and not rejected/vetoed, so a rejected token or sequence leaves every
    denominator). Computation is in float32 whatever the input dtype; gradients flow only into
    `logp` (and `entropy`). Shapes and the config are checked in Python, so they fail at trace time
    under `jax.jit(policy_loss, static_argnames="cfg")`.

    Args:
      logp: f[B, T] learner log-probs of the sampled tokens.
      logp_prox: f[B, T] full-precision old-policy (proximal) log-probs.
      logp_behav: f[B, T] behaviour (sampler) log-probs as reported by the rollout engine.
      advantages: f[B] or f[B, T].
      mask: bool [B, T] valid response tokens.
      cfg: an `ObjectiveConfig` (static under jit).
      logp_ref: f[B, T] reference-policy log-probs; required when cfg.kl_coef > 0.
      entropy: f[B, T] per-token policy entropy; required when cfg.entropy_coef != 0.

    Returns:
      (loss f32[], metrics) with metrics a dict of f32 scalars (stop-gradient): loss, pg_loss,
      kl_loss, entropy, clipfrac, clipfrac_upper (A > 0, R above the upper bound), clipfrac_lower
      (A < 0, R below the lower bound), dual_clipfrac, ratio_mean, ratio_max, upper_bound_mean,
      truncated_frac (valid tokens whose weight hit the cap), masked_token_frac (valid tokens
      removed by rejection or veto), vetoed_seq_frac (valid sequences vetoed), kept_tokens,
      kept_sequences, valid_tokens, valid_sequences, is_weight_mean/max/min and is_ess (applied
      weights over kept tokens; the clip fractions are over kept tokens too), and the raw
      pre-truncation statistics of
      `mismatch_metrics` (raw_is_weight_*, raw_is_ess, raw_is_chi2, kl_behav_prox_k1/k3,
      logp_gap_abs_mean/max) over all valid tokens; in TIS and ACR modes also
      acr/bound_frac and acr/grad_rel_diff (`acr_tis_gap`: where and how far the two modes'
      gradients differ on this batch).
    """
    args = _checked(logp, logp_prox, logp_behav, advantages, mask, cfg, logp_ref, entropy)
    if cfg.kl_coef > 0.0 and logp_ref is None:
        raise ValueError(f"logp_ref: required because ObjectiveConfig.kl_coef = {cfg.kl_coef} > 0")
    if cfg.entropy_coef != 0.0 and entropy is None:
        raise ValueError(
            f"entropy: required because ObjectiveConfig.entropy_coef = {cfg.entropy_coef} != 0"
        )
    return _policy_loss(*args, cfg=cfg)


def _policy_loss(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    logp_ref: Array | None,
    entropy: Array | None,
    cfg: ObjectiveConfig,
) -> tuple[Array, dict[str, Array]]:
    """`policy_loss` on already checked arrays."""
    terms = _token_terms(logp, logp_prox, logp_behav, advantages, mask, cfg)
    keep = terms.mask
    valid = mask.astype(bool)

    def agg(x: Array) -> Array:
        return aggregate(x, keep, cfg.agg, cfg.agg_norm_len)

    pg_loss = agg(terms.loss)
    zero = jnp.zeros((), jnp.float32)
    kl_loss = zero
    if logp_ref is not None:
        lp = jnp.where(keep, logp.astype(jnp.float32), 0.0)
        lp_ref = jnp.where(keep, jax.lax.stop_gradient(logp_ref.astype(jnp.float32)), 0.0)
        log_ref_ratio = jnp.clip(lp_ref - lp, -cfg.logratio_clamp, cfg.logratio_clamp)
        if cfg.kl_estimator == KLEstimator.K1:
            kl = -log_ref_ratio
        else:
            kl = jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0
        kl_loss = agg(kl)
    mean_entropy = zero if entropy is None else agg(entropy)
    loss = pg_loss
    if cfg.kl_coef > 0.0:
        loss = loss + cfg.kl_coef * kl_loss
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * mean_entropy

    sg = jax.lax.stop_gradient
    ratio = sg(terms.ratio)
    adv = sg(advantages.astype(jnp.float32))
    adv = jnp.broadcast_to(adv[:, None] if adv.ndim == 1 else adv, ratio.shape)
    n_keep = jnp.sum(keep, dtype=jnp.float32)
    n_valid = jnp.sum(valid, dtype=jnp.float32)
    clip_up = keep & (adv > 0) & (ratio > terms.upper)
    clip_lo = keep & (adv < 0) & (ratio < terms.lower)
    if cfg.dual_clip is None:
        dual = jnp.zeros_like(keep)
    else:
        dual = keep & (adv < 0) & (jnp.maximum(ratio, terms.lower) > cfg.dual_clip)
    seqs = jnp.any(valid, axis=-1)
    metrics = {
        "loss": loss,
        "pg_loss": pg_loss,
        "kl_loss": kl_loss,
        "entropy": mean_entropy,
        "clipfrac": _safe_div(jnp.sum(clip_up | clip_lo, dtype=jnp.float32), n_keep),
        "clipfrac_upper": _safe_div(jnp.sum(clip_up, dtype=jnp.float32), n_keep),
        "clipfrac_lower": _safe_div(jnp.sum(clip_lo, dtype=jnp.float32), n_keep),
        "dual_clipfrac": _safe_div(jnp.sum(dual, dtype=jnp.float32), n_keep),
        "ratio_mean": _masked_mean(ratio, keep),
        "ratio_max": _masked_max(ratio, keep),
        "upper_bound_mean": _masked_mean(terms.upper, keep),
        "truncated_frac": _safe_div(jnp.sum(terms.truncated, dtype=jnp.float32), n_valid),
        "masked_token_frac": _safe_div(n_valid - n_keep, n_valid),
        "vetoed_seq_frac": _safe_div(
            jnp.sum(terms.vetoed & seqs, dtype=jnp.float32), jnp.sum(seqs, dtype=jnp.float32)
        ),
        "kept_tokens": n_keep,
        "kept_sequences": jnp.sum(jnp.any(keep, axis=-1), dtype=jnp.float32),
        "valid_tokens": n_valid,
        "valid_sequences": jnp.sum(seqs, dtype=jnp.float32),
        "is_weight_mean": _masked_mean(terms.weight, keep),
        "is_weight_max": _masked_max(terms.weight, keep),
        "is_weight_min": _masked_min(terms.weight, keep),
        "is_ess": _ess(terms.weight, keep),
    }
    metrics.update(mismatch_metrics(logp_prox, logp_behav, valid, cfg.logratio_clamp))
    if cfg.mode in (Mode.TIS, Mode.ACR):
        metrics.update({f"acr/{k}": v for k, v in acr_tis_gap(
            logp, logp_prox, logp_behav, advantages, mask, cfg).items()})
    return loss, {k: sg(v).astype(jnp.float32) for k, v in metrics.items()}


def acr_tis_gap(
    logp: Array,
    logp_prox: Array,
    logp_behav: Array,
    advantages: Array,
    mask: Array,
    cfg: ObjectiveConfig,
) -> dict[str, Array]:
    """How far ACR's policy gradient is from TIS's on one batch, everything else as `cfg`.

    The two objectives differ only in the upper clip bound of truncated tokens (`Mode`), so their
    gradients with respect to the token log-probs, g = d agg(loss_t) / d logp [B, T] (the
    coefficients the model's backward multiplies d logp / d theta by), differ only on truncated
    tokens with A > 0 and 1 + eps_high < R <= (1 + eps_high) / r: there TIS's clip stops the
    gradient and ACR's wider bound lets it through. With one optimizer step per RL step R = 1 and
    the two are equal. Inputs as `policy_loss`'s (checked arrays); f32 scalars, stop-gradient:
      bound_frac: share of the kept tokens on which g_ACR != g_TIS (ACR's bound is what decides);
      grad_rel_diff: ||g_ACR - g_TIS|| / ||g_TIS|| over the batch's tokens (0 when g_TIS is 0).
    """
    lp = jax.lax.stop_gradient(logp)

    def grad_of(mode: Mode) -> tuple[Array, Array]:
        c = dataclasses.replace(cfg, mode=mode)

        def pg(x: Array) -> tuple[Array, Array]:
            terms = _token_terms(x, logp_prox, logp_behav, advantages, mask, c)
            return aggregate(terms.loss, terms.mask, c.agg, c.agg_norm_len), terms.mask

        return jax.grad(pg, has_aux=True)(lp)

    (g_acr, keep), (g_tis, _) = grad_of(Mode.ACR), grad_of(Mode.TIS)
    differ = keep & (g_acr != g_tis)
    norm = lambda x: jnp.sqrt(jnp.sum(jnp.square(x)))  # noqa: E731
    return {
        "bound_frac": _safe_div(jnp.sum(differ, dtype=jnp.float32),
                                jnp.sum(keep, dtype=jnp.float32)),
        "grad_rel_diff": _safe_div(norm(g_acr - g_tis), norm(g_tis)),
    }


def sparse_rl_rejections(
    logp_prox: Array, logp_behav: Array, mask: Array, cfg: ObjectiveConfig
) -> dict[str, Array]:
    """What Sparse-RL's corrections take out of a rollout batch, as counts (f32 scalars).

    logp_prox f[B, T] dense (recomputed) log-probs, logp_behav f[B, T] the sparse sampler's, mask
    [B, T] valid response tokens; cfg in SPARSE_RL mode. The rules are `token_terms`' own:
      vetoed_sequences / vetoed_tokens: sequences (and their valid tokens) dropped because a token
        has w = pi_prox / pi_behav < veto_tau;
      band_masked_tokens / band_masked_sequences: valid tokens of sequences that were not vetoed
        whose w lies outside `sparse_mask_band` (0 without a band), and the sequences with any.
    """
    if cfg.mode != Mode.SPARSE_RL:
        raise ValueError(f"sparse_rl_rejections: needs mode 'sparse_rl', got {cfg.mode.value!r}")
    zeros = jnp.zeros(jnp.shape(logp_prox)[:1], jnp.float32)
    terms = token_terms(logp_prox, logp_prox, logp_behav, zeros, mask, cfg)
    valid = jnp.asarray(mask).astype(bool)
    vetoed_tokens = valid & terms.vetoed[:, None]
    band = valid & ~terms.vetoed[:, None] & ~terms.mask
    f32 = jnp.float32
    return {
        "vetoed_sequences": jnp.sum(terms.vetoed & jnp.any(valid, axis=-1), dtype=f32),
        "vetoed_tokens": jnp.sum(vetoed_tokens, dtype=f32),
        "band_masked_tokens": jnp.sum(band, dtype=f32),
        "band_masked_sequences": jnp.sum(jnp.any(band, axis=-1), dtype=f32),
    }
