"""qurl_jax: reinforcement learning with verifiable rewards for LLMs in JAX, with quantized
(INT8/FP8) or KV-compressed rollouts corrected by decoupled PPO and QuRL's Adaptive Clipping Range.

`Trainer(config, workdir).train()` is a whole run (`python -m qurl_jax.main`); `from qurl_jax.rl
import objectives` gives the losses alone. Sub-packages by layer, each importing only those below
it (docs/architecture.md): `runtime` (errors, paths, metrics, checkpoints), `cpu_kernels`, `quant`,
`rl`, `data`, `parallel` (meshes, compile targets, the rollout layout), `models`, `sampling`,
`learner`, `config` (the base config and the typed settings), `plan` (memory and speed for a
target), `train` (the trainer's step), `study`, `bench`. Importing `qurl_jax` itself pulls in
nothing heavy, except where an accelerator's JAX plugin is installed (libtpu, by `./setup.sh`'s
TPU compile extra): there it imports JAX to keep a machine with no accelerator attached on the
CPU, as the entry points do, so that `jax.devices()` does not start the TPU backend and libtpu
prints no error about the TPU it cannot find (`parallel.targets.
use_cpu_unless_accelerator_attached`; JAX_PLATFORMS, when set, decides).
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


def __getattr__(name: str):
    """`qurl_jax.Trainer`, imported on first use (it pulls in JAX, flax, orbax)."""
    if name == "Trainer":
        from qurl_jax.train.trainer import Trainer

        return Trainer
    raise AttributeError(f"module 'qurl_jax' has no attribute {name!r}")
