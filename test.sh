#!/usr/bin/env bash
# Runs the fast default test suite (slow tests: ./test.sh -m slow).
set -euo pipefail
cd "$(dirname "$0")"
exec python3 -m pytest -q "$@"
