"""Bazel entry point: runs pytest on the test files given as arguments, fast tests only.

`tests/BUILD` makes one `py_test` per `test_*.py` with this file as `main`; the `-m 'not slow'`
selection and flags mirror pyproject.toml's pytest settings, which are not in Bazel's runfiles.
"""

import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-m", "not slow", "-p", "no:cacheprovider", *sys.argv[1:]]))
