"""Functional RL objectives: advantages, the decoupled policy loss with QuRL's ACR, mismatch stats.

`objectives` holds `policy_loss(logp, logp_prox, logp_behav, advantages, mask, cfg)` with its
`ObjectiveConfig` (modes on_policy, naive, tis, mis, acr, sparse_rl), `token_terms`, `aggregate`,
`mismatch_metrics` and `sparse_rl_rejections`; `advantages` holds GRPO / Dr.GRPO / RLOO
advantages, DAPO's dynamic-sampling filter and overlong penalty. Pure functions over arrays:
importing this package pulls in jax and nothing heavier (no flax, no models).
"""

from qurl_jax.rl import advantages, objectives
from qurl_jax.rl.advantages import (
    contiguous_group_ids,
    dr_grpo_advantages,
    groups_to_keep,
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
)
from qurl_jax.rl.objectives import (
    Aggregation,
    ISLevel,
    KLEstimator,
    Mode,
    ObjectiveConfig,
    SparseBase,
    TokenTerms,
    aggregate,
    mismatch_metrics,
    policy_loss,
    sparse_rl_rejections,
    token_terms,
)

__all__ = [
    "Aggregation",
    "ISLevel",
    "KLEstimator",
    "Mode",
    "ObjectiveConfig",
    "SparseBase",
    "TokenTerms",
    "advantages",
    "aggregate",
    "contiguous_group_ids",
    "dr_grpo_advantages",
    "groups_to_keep",
    "grpo_advantages",
    "mismatch_metrics",
    "objectives",
    "overlong_penalty",
    "policy_loss",
    "sparse_rl_rejections",
    "rloo_advantages",
    "token_terms",
]
