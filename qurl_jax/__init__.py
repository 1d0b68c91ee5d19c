"""qurl_jax: reinforcement learning with verifiable rewards for LLMs in JAX, with quantized
(INT8/FP8) or KV-compressed rollouts corrected by decoupled PPO and QuRL's Adaptive Clipping Range.

Sub-packages, one per concern: `models` (Flax decoders and checkpoint formats), `quant` (AQT
recipes, requantization, invariant scaling), `sampling` (jitted prefill/decode), `rl` (functional
objectives and advantages), `data` (math data sets, rewards, evaluation). `sharding` maps logical
axis names to the device mesh. Importing `qurl_jax` itself pulls in nothing heavy, except where
an accelerator's JAX plugin is installed (libtpu, by `./setup.sh`'s TPU compile extra): there it
imports JAX to keep a machine with no accelerator attached on the CPU, as the entry points do, so
that `jax.devices()` does not start the TPU backend and libtpu prints no error about the TPU it
cannot find (`targets.use_cpu_unless_accelerator_attached`; JAX_PLATFORMS, when set, decides).
"""

__version__ = "0.1.0"

# JAX's plugins for accelerators that start a backend (and log errors) on a machine without one.
_ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin")


def _stay_on_the_cpu_without_an_accelerator() -> None:
    import importlib.util
    import os

    if os.environ.get("JAX_PLATFORMS") or not any(
            importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS):
        return
    from qurl_jax.parallel.targets import use_cpu_unless_accelerator_attached

    use_cpu_unless_accelerator_attached()


_stay_on_the_cpu_without_an_accelerator()
