#!/usr/bin/env bash
# Runs the fast default test suite (slow tests: ./test.sh -m slow), one test file per worker on
# QURL_TEST_WORKERS processes (default 2; test files are independent, as under Bazel).
set -euo pipefail
cd "$(dirname "$0")"
exec python3 -m pytest -q -n "${QURL_TEST_WORKERS:-2}" --dist loadfile "$@"
