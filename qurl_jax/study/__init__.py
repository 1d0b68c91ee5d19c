"""The rollout-precision study: one task under every rollout precision, correction and KV cache
(`python -m qurl_jax.study`)."""
