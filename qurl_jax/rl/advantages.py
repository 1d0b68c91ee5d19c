"""Group-relative advantages and DAPO reward shaping: pure JAX functions over per-sequence arrays.

Every prompt is sampled G times; the G responses form a group, and each response's advantage is
its reward relative to the rest of its group: GRPO (minus the group mean, divided by the group
std), Dr.GRPO (minus the mean only) and RLOO (minus the mean of the *other* members). Groups are
given either as integer ids i32[B] in [0, B), in any order, or as `group_size` G for the common
contiguous layout [p0 x G, p1 x G, ...]. Also here: DAPO's dynamic-sampling filter, which reports
the groups whose rewards are all equal (zero advantage, zero gradient) so the trainer can drop and
regenerate them (`qurl_jax.train.rollout`), and DAPO's soft overlong penalty. Formulas:
docs/methods.md section 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def contiguous_group_ids(batch_size: int, group_size: int) -> Array:
    """Group ids i32[batch_size] for contiguous groups: [0]*G + [1]*G + ...

    Raises ValueError unless group_size >= 1 divides batch_size.
    """
    if group_size < 1 or batch_size % group_size != 0:
        raise ValueError(
            f"group_size: {group_size} must be >= 1 and divide the batch size {batch_size}"
        )
    return jnp.arange(batch_size, dtype=jnp.int32) // group_size


def _resolve_groups(
    rewards: Array, group_ids: Array | None, group_size: int | None
) -> tuple[Array, Array]:
    """Validates inputs; returns (rewards f32[B], group ids i32[B] in [0, B))."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim != 1:
        raise ValueError(f"rewards: expected shape [batch], got {rewards.shape}")
    batch = rewards.shape[0]
    if (group_ids is None) == (group_size is None):
        raise ValueError("group_ids / group_size: pass exactly one of them")
    if group_size is not None:
        return rewards.astype(jnp.float32), contiguous_group_ids(batch, group_size)
    group_ids = jnp.asarray(group_ids)
    if group_ids.shape != (batch,):
        raise ValueError(f"group_ids: expected shape {(batch,)}, got {group_ids.shape}")
    if not jnp.issubdtype(group_ids.dtype, jnp.integer):
        raise ValueError(f"group_ids: expected an integer dtype, got {group_ids.dtype}")
    if not isinstance(group_ids, jax.core.Tracer):
        lo, hi = int(jnp.min(group_ids)), int(jnp.max(group_ids))
        if lo < 0 or hi >= batch:
            raise ValueError(f"group_ids: must lie in [0, {batch}), got values in [{lo}, {hi}]")
    return rewards.astype(jnp.float32), group_ids.astype(jnp.int32)


def _group_sum(x: Array, ids: Array) -> Array:
    """Sum of x over each sample's group, gathered back to f32[B]."""
    return jax.ops.segment_sum(x, ids, num_segments=x.shape[0])[ids]


def grpo_advantages(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    group_size: int | None = None,
    eps: float = 1e-6,
    std_normalize: bool = True,
    unbiased_std: bool = True,
) -> Array:
    """GRPO advantages A_i = (r_i - mean_g) / (std_g + eps) over each sample's group g.

    Args:
      rewards: f[B] per-sequence rewards.
      group_ids: i32[B] group of each sample, values in [0, B); or pass `group_size` instead.
      group_size: G for contiguous groups of G samples (B must be a multiple of G).
      eps: added to the std, so an all-equal group gets advantage 0, not NaN.
      std_normalize: False gives Dr.GRPO's A_i = r_i - mean_g.
      unbiased_std: std with the n - 1 denominator (verl / TRL, torch.std); False uses n. A group of
        one sample has std 0 either way.

    Returns:
      f32[B] advantages.
    """
    r, ids = _resolve_groups(rewards, group_ids, group_size)
    n = _group_sum(jnp.ones_like(r), ids)
    centred = r - _group_sum(r, ids) / n
    if not std_normalize:
        return centred
    dof = n - 1.0 if unbiased_std else n
    var = jnp.where(dof > 0, _group_sum(centred * centred, ids) / jnp.maximum(dof, 1.0), 0.0)
    return centred / (jnp.sqrt(var) + eps)


def dr_grpo_advantages(
    rewards: Array, group_ids: Array | None = None, *, group_size: int | None = None
) -> Array:
    """Dr.GRPO advantages A_i = r_i - mean_g (no std normalisation), f32[B].

    Dr.GRPO's other change, no 1/|o_i| length normalisation, is the loss aggregation
    `seq_mean_token_sum_norm` in `qurl_jax.rl.objectives`.
    """
    return grpo_advantages(rewards, group_ids, group_size=group_size, std_normalize=False)


def rloo_advantages(
    rewards: Array, group_ids: Array | None = None, *, group_size: int | None = None
) -> Array:
    """RLOO advantages A_i = r_i - mean of the other members of the group, f32[B].

    Equal to n / (n - 1) * (r_i - mean_g) for a group of n; a group of one sample gets 0.
    """
    r, ids = _resolve_groups(rewards, group_ids, group_size)
    n = _group_sum(jnp.ones_like(r), ids)
    others = jnp.where(n > 1, (_group_sum(r, ids) - r) / jnp.maximum(n - 1.0, 1.0), r)
    return r - others


def groups_to_keep(
    rewards: Array,
    group_ids: Array | None = None,
    *,
    group_size: int | None = None,
    atol: float = 0.0,
) -> Array:
    """DAPO dynamic sampling: bool[B], False for every sample of a group whose rewards all agree.

    A group with max - min <= atol (all correct or all wrong under a 0/1 reward) has zero advantage
    and contributes no gradient; DAPO drops such groups and samples more prompts until the batch is
    full. With contiguous groups, `keep[::G]` is the per-group answer.
    """
    r, ids = _resolve_groups(rewards, group_ids, group_size)
    num = r.shape[0]
    high = jax.ops.segment_max(r, ids, num_segments=num)
    low = jax.ops.segment_min(r, ids, num_segments=num)
    return (high - low)[ids] > atol


def overlong_penalty(lengths: Array, max_len: int, buffer: int, factor: float = 1.0) -> Array:
    """DAPO soft overlong punishment added to the reward, f32[B] (0 or negative).

    With L_max = `max_len` and L_c = `buffer`: 0 if |y| <= L_max - L_c; the linear ramp
    ((L_max - L_c) - |y|) / L_c * factor inside the buffer; -factor when |y| > L_max.

    Args:
      lengths: i32[B] response lengths in tokens.
      max_len: L_max, the maximum response length (DAPO 20480).
      buffer: L_c, the length of the punishment ramp, 0 < buffer <= max_len (DAPO 4096).
      factor: the penalty at and beyond L_max (DAPO 1.0).
    """
    if buffer <= 0 or buffer > max_len:
        raise ValueError(f"buffer: must satisfy 0 < buffer <= max_len = {max_len}, got {buffer}")
    lengths = jnp.asarray(lengths)
    if lengths.ndim != 1:
        raise ValueError(f"lengths: expected shape [batch], got {lengths.shape}")
    excess = lengths.astype(jnp.float32) - float(max_len - buffer)
    return 0.0 - factor * jnp.clip(excess / float(buffer), 0.0, 1.0)
