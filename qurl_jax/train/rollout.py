"""One step's experience (`Rollout`) and DAPO dynamic sampling's regeneration of the groups
a filter dropped (`regenerate_groups`).

"Refill" in this project means only the sampler's continuous batching
(`qurl_jax.sampling.RefillSampler`); the groups DAPO replaces with further generation rounds are
"regenerated".
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

import numpy as np

from qurl_jax.sampling import SampleOutput, SamplingParams


@dataclasses.dataclass
class Rollout:
    """One step's experience, host-side numpy, rows grouped by prompt (n consecutive rows each).

    tokens i32[N, P+G] prompt (left-padded) + response; attn_mask bool[N, P+G];
    resp_mask f32[N, G]; logp_behav f32[N, G] (see `rollout.behav_logp`);
    logp_truncation_gap f32[N, G]: log-prob under the sampled (top-k/top-p truncated,
    renormalised) distribution minus the one under the full tempered softmax, -log Z >= 0 on every
    generated token (0 without truncation); lengths i32[N].
    rewards f32[N] and accuracy f32[N] (the verifier's 0/1 outcome) are None while the verifier
    still runs in the background (`pending`); `resolve()` waits for them.
    """

    tokens: np.ndarray
    attn_mask: np.ndarray
    resp_mask: np.ndarray
    logp_behav: np.ndarray
    logp_truncation_gap: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray | None = None
    accuracy: np.ndarray | None = None
    pending: concurrent.futures.Future | None = None

    # Fields with one row per sample: what DAPO's group regeneration exchanges between rollouts.
    ROW_FIELDS = ("tokens", "attn_mask", "resp_mask", "logp_behav", "logp_truncation_gap",
                  "lengths", "rewards", "accuracy")

    @property
    def size(self) -> int:
        return self.tokens.shape[0]

    @classmethod
    def from_sample(cls, out: SampleOutput, sampling: SamplingParams,
                    pending: concurrent.futures.Future | None = None) -> Rollout:
        """The rollout of a host-side `SampleOutput` (numpy arrays), its rewards `pending`."""
        resp_mask = np.asarray(out.mask, np.float32)
        tokens = np.concatenate([out.prompt_tokens, out.tokens], axis=1).astype(np.int32)
        attn = np.concatenate([out.prompt_mask, resp_mask > 0], axis=1)
        # pi_behav is the distribution that drew the token: under top-k/top-p the truncated,
        # renormalised q/Z (out.logp). The untruncated log-prob would inflate every kept token's
        # weight pi_prox / pi_behav by 1/Z; it stays selectable for comparison.
        logp_behav = sampling.behaviour_logp(out.logp, out.logp_untruncated)
        gap = (np.asarray(out.logp, np.float32) - np.asarray(out.logp_untruncated, np.float32))
        # Owned, writable copies: device_get returns read-only views.
        return cls(tokens=tokens, attn_mask=attn, resp_mask=resp_mask,
                   logp_behav=np.array(logp_behav, np.float32),
                   logp_truncation_gap=gap * resp_mask,
                   lengths=np.array(out.lengths, np.int32), pending=pending)

    def resolve(self) -> Rollout:
        """Waits for the verifier's rewards and accuracy (a no-op once they are in)."""
        if self.pending is not None:
            rewards, accuracy = self.pending.result()
            self.rewards = np.array(rewards, np.float32)
            self.accuracy = np.array(accuracy, np.float32)
            self.pending = None
        return self


def _left_pad_to_same_width(a: Rollout, b: Rollout) -> tuple[Rollout, Rollout]:
    """Left-pads the prompt part of the narrower rollout so rows of both can be exchanged."""
    width = max(a.tokens.shape[1], b.tokens.shape[1])

    def pad(r: Rollout) -> Rollout:
        extra = width - r.tokens.shape[1]
        if not extra:
            return r
        return dataclasses.replace(
            r, tokens=np.pad(r.tokens, ((0, 0), (extra, 0))),
            attn_mask=np.pad(r.attn_mask, ((0, 0), (extra, 0))))

    return pad(a), pad(b)


def regenerate_groups(r: Rollout, keep: np.ndarray, extra: Rollout, extra_keep: np.ndarray,
                      group_size: int) -> tuple[Rollout, np.ndarray]:
    """DAPO dynamic sampling's group regeneration, a pure function of two resolved rollouts.

    The dropped groups of `r` (keep[g] False), in order, are replaced by the kept groups of
    `extra`, in order, as far as `extra` has them; every per-row field moves with its group. The
    narrower rollout's prompts are left-padded first so rows of both fit one array.

    Args:
      r: the batch so far, B groups of `group_size` rows.
      keep: bool[B], the groups of `r` worth training on.
      extra: a further generation round (any number of groups, any prompt width).
      extra_keep: bool[B'], the groups of `extra` worth training on.
      group_size: rows per group (rollout.n).

    Returns:
      (a new Rollout, bool[B] groups now kept); the inputs are not modified.
    """
    r, extra = _left_pad_to_same_width(r, extra)
    fields = {f: np.array(getattr(r, f)) for f in Rollout.ROW_FIELDS}
    keep = np.array(keep, bool)
    free = np.flatnonzero(~keep)
    take = np.flatnonzero(extra_keep)[: len(free)]
    for dst, src in zip(free[: len(take)], take, strict=True):
        rows_d = slice(dst * group_size, (dst + 1) * group_size)
        rows_s = slice(src * group_size, (src + 1) * group_size)
        for name, array in fields.items():
            array[rows_d] = getattr(extra, name)[rows_s]
        keep[dst] = True
    return dataclasses.replace(r, **fields, pending=None), keep
