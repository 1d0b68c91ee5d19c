"""The RL run: the trainer's step (requantize, roll out, reward, advantages, learn), the task a
config names, the supervised warm start, the step's experience, preemption."""
