"""`python -m qurl_jax.study`: the rollout-precision study's command line."""

from qurl_jax.study.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
