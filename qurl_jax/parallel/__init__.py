"""How a run's arrays lie on its devices: the logical-axis sharding rules and meshes, compile targets
(TPU slices and H100s without a device), multi-process helpers, the rollout's replicas and their
once-per-step reshard, and the same-programs check across processes."""
