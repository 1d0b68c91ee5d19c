#!/bin/sh
# Stand-in coverage tool: coverage needs Bazel's downloaded tools, which this offline set-up lacks.
echo "bazel coverage is not supported by this offline set-up (use pytest --cov instead)" >&2
exit 1
