"""Planning a run for a target without running it: per-device memory of every program, which
low-precision products are native, the decode-speed and interconnect models, the rollout's speed
check."""
