#!/usr/bin/env bash
# Runs the fast default test suite (slow tests: ./test.sh -m slow), one test file per worker on
# QURL_TEST_WORKERS processes (default 2; test files are independent, as under Bazel).
#
# ./test.sh --accelerator OUTDIR [options]: the accelerator selection on the GPU/TPU (or CPU) JAX
# sees, results streamed to OUTDIR (python -m tests.accelerator --help; docs/accelerators.md).
set -euo pipefail
cd "$(dirname "$0")"
if [[ "${1:-}" == "--accelerator" ]]; then
  shift
  exec python3 -m tests.accelerator "$@"
fi
exec python3 -m pytest -q -n "${QURL_TEST_WORKERS:-2}" --dist loadfile "$@"
