#!/usr/bin/env bash
# Installs everything qurl_jax needs (CPU JAX, test dependencies) into the current Python 3.11+.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install -r requirements.txt
python3 -m pip install --no-deps -e .
