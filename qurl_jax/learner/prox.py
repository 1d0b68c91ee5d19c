"""Where pi_prox comes from: a separate log-prob pass, the update's own forward, or both.

Decoupled PPO's proximal policy pi_prox is the learner's policy when the step's rollout batch
reaches the learner (docs/methods.md). The update's first forward pass runs exactly those
parameters on exactly those tokens, so the update's own log-probs with the gradient stopped *are*
pi_prox for every row the first optimizer step sees, and a separate pass over those rows
(`Learner.logprobs`) computes the same numbers again. `prox_source` decides once per run, from
typed settings, which rows need the separate pass:
  - none, with one optimizer step per RL step (`num_minibatches` 1, `ppo_epochs` 1) in float
    precision: the trainer leaves `logp_prox` out of the update's batch and `Learner.loss` uses
    `stop_gradient(logp)`;
  - all but the first minibatch's, with several minibatches and one PPO epoch in float precision
    (`ProxSource.skip_first`): every optimizer step after the first runs moved parameters, so
    those rows are recomputed before the first update; the first minibatch's rows carry
    `prox_from_forward` and take pi_prox from the update's forward. The pass shrinks by
    1 / num_minibatches;
  - all, with more than one PPO epoch (the first minibatch's rows come back in a later epoch,
    when the parameters have moved, and the update's forward is gone by then) or an FP8 learner
    (`precision` that quantizes: its activation scales are taken over the rows of each forward,
    `quant.bind_train_precision`, so pi_prox is defined by the recompute's slicing and is kept
    as it is).
Neither `rl.kl_coef` > 0 nor Sparse-RL needs the pass: the KL needs pi_ref, a separate pass of the
reference parameters that stays; Sparse-RL's veto and band mask are per-token functions of
w = pi_prox / pi_behav inside the objective, computed from the same forward (its batch counts,
`sparse/*`, are then counted inside the update from the same stopped log-probs, `Learner.loss`,
and added to the pass's counts of the other rows). Micro-batches (gradient accumulation) change
nothing: the parameters move only after the last one.
"""

from __future__ import annotations

import dataclasses

from qurl_jax import quant


@dataclasses.dataclass(frozen=True)
class ProxSource:
    """`recompute`: pi_prox from a separate `Learner.logprobs` pass (else from the update's own
    forward, gradient stopped); `skip_first`: the pass leaves out the first optimizer step's rows,
    which take pi_prox from that update's forward; `reason`: why, in words, for the run's log."""

    recompute: bool
    reason: str
    skip_first: bool = False

    def __post_init__(self) -> None:
        if self.skip_first and not self.recompute:
            raise ValueError("ProxSource: skip_first needs recompute")

    def describe(self) -> str:
        if self.skip_first:
            where = ("the first minibatch's update forward (gradient stopped) for its rows, and "
                     "a separate log-prob pass over the other minibatches' rows")
        elif self.recompute:
            where = "a separate log-prob pass before the update"
        else:
            where = "the update's own forward (gradient stopped), no separate pass"
        return f"pi_prox from {where}: {self.reason}"


def prox_source(*, num_minibatches: int, ppo_epochs: int,
                precision: str | quant.Recipe = "fp") -> ProxSource:
    """Where pi_prox comes from for a learner that takes `num_minibatches` optimizer steps per PPO
    epoch for `ppo_epochs` epochs per RL step in training `precision` (module doc)."""
    if num_minibatches < 1 or ppo_epochs < 1:
        raise ValueError(f"num_minibatches={num_minibatches} and ppo_epochs={ppo_epochs} must "
                         "be >= 1")
    steps = num_minibatches * ppo_epochs
    recipe = quant.get_recipe(precision)
    if recipe.quantizes:
        return ProxSource(True, f"the learner trains in {recipe.name}, whose activation scales "
                                "depend on how the batch is sliced")
    if ppo_epochs > 1:
        return ProxSource(True, f"{num_minibatches} minibatches x {ppo_epochs} PPO epochs = "
                                f"{steps} optimizer steps per RL step; every row comes back "
                                "in a later epoch, after the parameters moved")
    if steps > 1:
        return ProxSource(True, f"{num_minibatches} minibatches per RL step: the first "
                                "optimizer step runs the parameters pi_prox is defined by, "
                                f"the other {num_minibatches - 1} see moved parameters",
                          skip_first=True)
    return ProxSource(False, "one optimizer step per RL step in float precision, so the "
                             "update's forward runs the parameters pi_prox is defined by")
