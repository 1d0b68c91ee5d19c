#!/bin/sh
# Bazel's Python interpreter: the python3 on the caller's PATH (the environment ./setup.sh filled).
exec python3 "$@"
