"""Runtime services every layer may use; the bottom layer, importing nothing else of qurl_jax.

`errors` (one-line `UserError`s: `ConfigError`, `DataError`, `WorkdirError`, ...), `paths`
(local paths and URLs through fsspec), `metrics` (metrics.jsonl, TensorBoard, phase timers, the
summary), `report` (the run's plots), `compilation` (the persistent compilation cache),
`checkpoint` (orbax checkpoints and resume), `watchdog` (the multi-process stall watchdog),
`enums` (enum fields of frozen dataclasses from config strings), `xla_cpu` and `malloc` (XLA:CPU's
products and glibc's arenas, set before JAX starts). Import the module you need; this
file imports none of them, so `import qurl_jax.runtime.errors` stays light."""
