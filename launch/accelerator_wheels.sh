#!/usr/bin/env bash
# Downloads, on a machine with network, the wheels an accelerator host without network needs to run
# the accelerator tests (`./test.sh --accelerator OUTDIR`, docs/accelerators.md): the pins of
# requirements.txt and their dependencies, for manylinux x86_64 and CPython 3.12 and 3.11, into
# DIR, with DIR/requirements.txt naming what to install. Left out unless asked: jax and jaxlib (the
# host's own JAX build; --with-jax adds jax[cuda12|cuda13|tpu] at the pinned version), torch
# (large, and images with a GPU usually hold one; --with-torch adds the CPU build), ruff (lint).
#
#   launch/accelerator_wheels.sh --dest=DIR [--python=3.12,3.11] [--with-jax=cuda12|cuda13|tpu]
#       [--with-torch] [--torch-index-url=URL] [--dry-run]
#
# On the host: python3 -m pip install --no-index --find-links=DIR -r DIR/requirements.txt
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/common.sh
source launch/common.sh

usage() {
  sed -n '2,12s/^# \{0,1\}//p' "$0"
}

DEST=""
PYTHONS="3.12,3.11"
WITH_JAX=""
WITH_TORCH=0
TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu"
split_flags "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
while (($#)); do
  case "$1" in
    --dest) need_value "$@"; DEST=$2; shift ;;
    --python) need_value "$@"; PYTHONS=$2; shift ;;
    --with-jax) need_value "$@"; WITH_JAX=$2; shift ;;
    --with-torch) WITH_TORCH=1 ;;
    --torch-index-url) need_value "$@"; TORCH_INDEX_URL=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
  shift
done
require --dest "${DEST}"
[[ -z "${WITH_JAX}" ]] || one_of --with-jax "${WITH_JAX}" cuda12 cuda13 tpu
for version in ${PYTHONS//,/ }; do
  one_of --python "${version}" 3.11 3.12 3.13
done

JAX_VERSION=$(pinned_jax_version requirements.txt)
# pip matches each manylinux tag exactly: the tags today's wheels of these pins carry.
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)
PLATFORM_FLAGS=()
for tag in "${PLATFORMS[@]}"; do
  PLATFORM_FLAGS+=(--platform "${tag}")
done

run mkdir -p "${DEST}"
REQUIREMENTS="${DEST}/requirements.txt"
# Every pin but jax/jaxlib (constraints below keep their versions), torch and ruff.
{
  grep -E '^[A-Za-z0-9_.-]+==' requirements.txt | grep -vE '^(jax|jaxlib|torch|ruff)=='
  [[ -z "${WITH_JAX}" ]] || echo "jax[${WITH_JAX}]==${JAX_VERSION}"
} | write_file "${REQUIREMENTS}"
CONSTRAINTS="${DEST}/constraints.txt"
printf 'jax==%s\njaxlib==%s\n' "${JAX_VERSION}" "${JAX_VERSION}" | write_file "${CONSTRAINTS}"

for version in ${PYTHONS//,/ }; do
  run python3 -m pip download --dest "${DEST}" --only-binary=:all: --implementation cp \
    --python-version "${version}" "${PLATFORM_FLAGS[@]}" -r "${REQUIREMENTS}" -c "${CONSTRAINTS}"
  if ((WITH_TORCH)); then
    torch_pin=$(grep -E '^torch==' requirements.txt)
    run python3 -m pip download --dest "${DEST}" --only-binary=:all: --implementation cp \
      --python-version "${version}" "${PLATFORM_FLAGS[@]}" --index-url "${TORCH_INDEX_URL}" \
      --extra-index-url https://pypi.org/simple "${torch_pin}+cpu"
  fi
done
if [[ -z "${WITH_JAX}" ]]; then
  # Dependencies of flax, optax, orbax and aqtp; the host keeps its own JAX.
  run find "${DEST}" -maxdepth 1 \( -name 'jax-*.whl' -o -name 'jaxlib-*.whl' \) -delete
fi
if ((WITH_TORCH)); then
  echo "$(grep -E '^torch==' requirements.txt)+cpu" | write_file "${REQUIREMENTS}" append
fi
note "done; on the host: python3 -m pip install --no-index --find-links=${DEST} -r ${REQUIREMENTS}"
