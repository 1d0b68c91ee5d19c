"""qurl_jax: reinforcement learning with verifiable rewards for LLMs in JAX, with quantized
(INT8/FP8) or KV-compressed rollouts corrected by decoupled PPO and QuRL's Adaptive Clipping Range.

Sub-packages, one per concern: `models` (Flax decoders and checkpoint formats), `quant` (AQT
recipes, requantization, invariant scaling), `sampling` (jitted prefill/decode), `rl` (functional
objectives and advantages), `data` (math data sets, rewards, evaluation). `sharding` maps logical
axis names to the device mesh. Importing `qurl_jax` itself pulls in nothing heavy.
"""

__version__ = "0.1.0"
