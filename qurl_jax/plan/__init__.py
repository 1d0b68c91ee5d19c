"""Planning a run for a target without running it: `memory_plan` (every program of a run compiled
for a target's devices, its per-device memory, the trainer's preflight), `native_pick` (which
low-precision products a chip runs natively), `collectives` (the collectives of a compiled
program), `roofline` and `interconnect` (predicted decode speed, on one device and on a whole
slice with its collectives), `rollout_speed` (the end-of-run quantized vs full-precision
rollout timing).

Import the module you need (`from qurl_jax.plan import memory_plan`): each pulls in the model,
sampler and learner it compiles."""
