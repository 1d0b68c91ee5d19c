#!/usr/bin/env bash
# Installs qurl_jax on an accelerator host (a TPU VM worker, a container, a GPU node), the
# accelerator version of ./setup.sh: a virtual environment with Python >= 3.11, the runtime pins
# of requirements.txt (the test-only section is skipped), jax[tpu] or jax[cuda12] at the pinned jax
# version, then the project itself with --no-deps.
#
#   launch/install.sh --accelerator=tpu|cuda12|cpu [--venv=DIR] [--dry-run]
#
# The environment goes to --venv (default $HOME/qurl_venv); run with DIR/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

usage() {
  sed -n '2,10s/^# \{0,1\}//p' "$0"
}

ACCELERATOR=""
VENV="${HOME}/qurl_venv"
split_flags "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
while (($#)); do
  case "$1" in
    --accelerator) need_value "$@"; ACCELERATOR=$2; shift ;;
    --venv) need_value "$@"; VENV=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
require --accelerator "${ACCELERATOR}"
one_of --accelerator "${ACCELERATOR}" tpu cuda12 cpu

# TPU VM images (Ubuntu 22.04) ship Python 3.10; the project needs 3.11.
PYTHON="${PYTHON:-python3}"
if ! "${PYTHON}" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  PYTHON=python3.11
  if ! command -v python3.11 >/dev/null 2>&1; then
    SUDO=""
    [[ "$(id -u)" != 0 ]] && SUDO=sudo
    run ${SUDO:+"${SUDO}"} apt-get update -q
    run ${SUDO:+"${SUDO}"} apt-get install -y -q python3.11 python3.11-venv
  fi
fi

JAX_VERSION=$(pinned_jax_version requirements.txt)
RUNTIME_REQUIREMENTS="${TMPDIR:-/tmp}/qurl_jax_requirements.txt"
# The lines above "# Test-only dependencies" (torch, pytest and ruff are never used by a run).
sed '/^# Test-only/,$d' requirements.txt | write_file "${RUNTIME_REQUIREMENTS}"

run "${PYTHON}" -m venv "${VENV}"
run "${VENV}/bin/python" -m pip install -q --upgrade pip
run "${VENV}/bin/python" -m pip install -q -r "${RUNTIME_REQUIREMENTS}"
case "${ACCELERATOR}" in
  tpu) run "${VENV}/bin/python" -m pip install -q "jax[tpu]==${JAX_VERSION}" ;;
  cuda12) run "${VENV}/bin/python" -m pip install -q "jax[cuda12]==${JAX_VERSION}" ;;
  cpu) ;;
esac
run "${VENV}/bin/python" -m pip install -q --no-deps -e .
