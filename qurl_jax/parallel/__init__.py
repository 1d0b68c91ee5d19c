"""How a run's arrays lie on its devices.

`sharding` (the logical-axis rules table for the `('data', 'fsdp', 'tensor')` mesh, meshes from
sizes), `targets` (compile-only TPU slices and H100s from a target string, a mesh's platform),
`distributed` (joining a multi-process run, each process's block of rows), `rollout_layout` (the
rollout's replicas of the quantized actor and the once-per-step reshard), `program_check` (the
same programs on every process). Import the module you need: the models import `targets` alone."""
