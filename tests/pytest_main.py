"""Bazel entry point: runs pytest on the test files given as arguments, fast tests only.

`tests/BUILD` makes one `py_test` per `test_*.py` with this file as `main`; the `-m 'not slow'`
selection and flags mirror pyproject.toml's pytest settings, which are not in Bazel's runfiles. A
file whose tests are all slow (`test_embedded_default.py`) selects nothing; pytest's exit code 5
("no tests collected") then counts as a pass, every other failure still fails the target.
"""

import sys

import pytest

if __name__ == "__main__":
    code = pytest.main(["-q", "-m", "not slow", "-p", "no:cacheprovider", *sys.argv[1:]])
    sys.exit(0 if code == pytest.ExitCode.NO_TESTS_COLLECTED else code)
