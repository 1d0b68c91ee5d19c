#!/usr/bin/env bash
# Installs everything qurl_jax needs (CPU JAX, test dependencies) into the current Python 3.11+,
# with libtpu (the tpu-compile extra): compile-only TPU devices, so tests/test_targets.py compiles
# a run's programs with the TPU compiler on this machine (no TPU needed; CPU runs are unchanged).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -r requirements.txt
python3 -m pip install -e ".[tpu-compile]"
