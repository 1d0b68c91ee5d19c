"""The learner: jitted, sharded log-prob recomputation and the policy update over packed rows.

`Learner` (with its `OptimConfig`) computes `logp_prox` / `logp_ref` and one optimizer step of the
objective (`qurl_jax.rl.objectives`); `packing` lays a step's sequences into rows and
`packed_plan` sizes those rows and micro-batches for a token budget."""

from qurl_jax.learner import packed_plan, packing
from qurl_jax.learner.learner import (
    Learner,
    OptimConfig,
    learning_rate_schedule,
    make_optimizer,
    response_logprobs,
)

__all__ = ["Learner", "OptimConfig", "learning_rate_schedule", "make_optimizer", "packed_plan",
           "packing", "response_logprobs"]
