"""launch/tpu_vm.sh on a spot slice that was preempted: rerunning the same command deletes the
PREEMPTED TPU VM, creates a new one and starts the run again in the same workdir (where it resumes
from the checkpoint it saved on SIGTERM). gcloud is a stand-in that records its calls."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAUNCH = REPO / "launch"
if not (LAUNCH / "tpu_vm.sh").exists():
    pytest.skip("launch/ is not in this tree", allow_module_level=True)


def _run(tmp_path: Path, state: str, ssh_status: int = 0) -> tuple[int, list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp_path / "calls"
    gcloud = bin_dir / "gcloud"
    gcloud.write_text(f"""#!/bin/sh
echo "gcloud $*" >> {calls}
case "$*" in
  *"tpu-vm describe"*) [ -n "{state}" ] && echo "{state}" && exit 0; exit 1 ;;
  *"tpu-vm ssh"*"qurl_jax.main"*) exit {ssh_status} ;;
esac
exit 0
""")
    gcloud.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", TMPDIR=str(tmp_path))
    env.pop("DRY_RUN", None)
    proc = subprocess.run(
        ["bash", str(LAUNCH / "tpu_vm.sh"), "--project=p", "--zone=z",
         "--accelerator-type=v5p-32", "--capacity=spot", "--bucket=gs://b/q", "--run-name=r1",
         "--config=configs/deepscaler_r1_1p5b_int8.py", "--skip-setup"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return proc.returncode, calls.read_text().splitlines(), proc.stderr


def test_preempted_spot_vm_is_recreated_and_the_run_restarted(tmp_path):
    code, calls, err = _run(tmp_path, "PREEMPTED")
    assert code == 0, err
    verbs = [" ".join(c.split()[1:5]) for c in calls]
    assert verbs.index("compute tpus tpu-vm delete") < verbs.index("compute tpus tpu-vm create")
    create = next(c for c in calls if "tpu-vm create" in c)
    assert "--spot" in create
    assert "--workdir=gs://b/q/r1" in calls[-1] and "PREEMPTED" in err


def test_ready_vm_is_reused_and_a_preempted_run_says_how_to_resume(tmp_path):
    code, calls, err = _run(tmp_path, "READY", ssh_status=143)
    assert code == 143
    assert not any("delete" in c or "create" in c for c in calls)
    assert "rerun this same command to resume" in err
