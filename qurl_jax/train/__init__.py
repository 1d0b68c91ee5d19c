"""The RL run: the trainer's step (requantize, roll out, reward, advantages, learn), the task a
config names, the supervised warm start, the step's experience (`rollout.Rollout`), preemption.

`Trainer(config, workdir).train()` is the whole run; `Trainer.step()` one RL step."""

from qurl_jax.train.trainer import Stream, Trainer, stream_key

__all__ = ["Stream", "Trainer", "stream_key"]
