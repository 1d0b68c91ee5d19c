"""Where pi_prox comes from: a separate log-prob pass, or the update's own forward.

Decoupled PPO's proximal policy pi_prox is the learner's policy when the step's rollout batch
reaches the learner (docs/methods.md). The update's first forward pass runs exactly those
parameters on exactly those tokens, so when every optimizer step of the RL step sees parameters
that have not moved yet, the update's own log-probs with the gradient stopped *are* pi_prox, and
the separate pass over the whole batch (`Learner.logprobs`) computes the same numbers again.
`prox_source` decides this once per run from typed settings; the trainer leaves `logp_prox` out
of the update's batch when it says so, and `Learner.loss` then uses `stop_gradient(logp)`.

The separate pass stays where pi_prox differs from what the update's forward sees:
  - more than one optimizer step per RL step (`num_minibatches` > 1 or `ppo_epochs` > 1): every
    step after the first runs moved parameters, while pi_prox is the policy before the first;
  - an FP8 learner (`precision` that quantizes): its activation scales are taken over the rows of
    each forward (`quant.bind_train_precision`), so pi_prox is defined by the recompute's slicing
    and is kept as it is;
Neither `rl.kl_coef` > 0 nor Sparse-RL needs it: the KL needs pi_ref, a separate pass of the
reference parameters that stays; Sparse-RL's veto and band mask are per-token functions of
w = pi_prox / pi_behav inside the objective, computed from the same forward (its batch counts,
`sparse/*`, are then computed inside the update from the same stopped log-probs,
`Learner.loss`). Micro-batches (gradient accumulation) change nothing: the parameters move only
after the last one.
"""

from __future__ import annotations

import dataclasses

from qurl_jax import quant


@dataclasses.dataclass(frozen=True)
class ProxSource:
    """`recompute`: pi_prox from a separate `Learner.logprobs` pass (else from the update's own
    forward, gradient stopped); `reason`: why, in words, for the run's log."""

    recompute: bool
    reason: str

    def describe(self) -> str:
        where = ("a separate log-prob pass before the update" if self.recompute
                 else "the update's own forward (gradient stopped), no separate pass")
        return f"pi_prox from {where}: {self.reason}"


def prox_source(*, num_minibatches: int, ppo_epochs: int,
                precision: str | quant.Recipe = "fp") -> ProxSource:
    """Where pi_prox comes from for a learner that takes `num_minibatches` optimizer steps per PPO
    epoch for `ppo_epochs` epochs per RL step in training `precision` (module doc)."""
    if num_minibatches < 1 or ppo_epochs < 1:
        raise ValueError(f"num_minibatches={num_minibatches} and ppo_epochs={ppo_epochs} must "
                         "be >= 1")
    steps = num_minibatches * ppo_epochs
    if steps > 1:
        return ProxSource(True, f"{num_minibatches} minibatches x {ppo_epochs} PPO epochs = "
                                f"{steps} optimizer steps per RL step; all but the first see "
                                "moved parameters")
    recipe = quant.get_recipe(precision)
    if recipe.quantizes:
        return ProxSource(True, f"the learner trains in {recipe.name}, whose activation scales "
                                "depend on how the batch is sliced")
    return ProxSource(False, "one optimizer step per RL step in float precision, so the "
                             "update's forward runs the parameters pi_prox is defined by")
