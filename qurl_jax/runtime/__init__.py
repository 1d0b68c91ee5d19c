"""Runtime services every layer may use: one-line errors, local and remote paths, metrics and run
plots, the persistent compilation cache, checkpoints, the multi-process stall watchdog.

The bottom layer: it imports nothing else of qurl_jax."""
