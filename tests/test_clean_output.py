"""No error-level line from a successful CPU run where libtpu is installed (`./setup.sh` installs
the TPU compile extra): importing qurl_jax keeps a machine without an accelerator on the CPU, as
the entry points do, so a library user's `jax.devices()` does not start libtpu, which prints
"E0000 ... INVALID_ARGUMENT" about the TPU workers it cannot find."""

import importlib.util
import os
import re
import subprocess
import sys

import pytest
from jax._src import hardware_utils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu not installed")
@pytest.mark.skipif(bool(hardware_utils.num_available_tpu_chips_and_device_id()[0])
                    or hardware_utils.has_visible_nvidia_gpu(), reason="an accelerator is attached")
def test_a_library_users_devices_print_no_libtpu_error():
    # JAX_PLATFORMS unset, as for a user; libtpu's one-process lock lifted so that a libtpu
    # started by another process on this machine cannot hide the error this test looks for.
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    code = "import qurl_jax.models, jax; print(jax.devices()[0].platform)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip() == "cpu"
    errors = [line for line in out.stderr.splitlines()
              if re.match(r"^[EF]\d{4} ", line) or "INVALID_ARGUMENT" in line]
    assert not errors, out.stderr
