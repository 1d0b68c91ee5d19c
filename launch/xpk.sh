#!/usr/bin/env bash
# Runs qurl_jax as a GKE workload with xpk, on TPU slices (--tpu-type, --num-slices) or GPU nodes
# (--device-type, --num-nodes). Every pod runs the same `python -m qurl_jax.main`: TPU pods find
# their peers from the TPU environment; GPU pods get --coordinator_address, --num_processes and
# --process_id from xpk's JAX_COORDINATOR_ADDRESS / JAX_COORDINATOR_PORT, NNODES and NODE_RANK.
#
#   launch/xpk.sh --cluster=C --project=P --zone=Z --tpu-type=v5p-128 [--num-slices=N] \
#       --bucket=gs://B --run-name=NAME --config=configs/FILE.py [options] [-- overrides]
#   launch/xpk.sh --cluster=C --project=P --zone=Z --device-type=h100-80gb-8 --num-nodes=N \
#       --bucket=gs://B --run-name=NAME --config=configs/FILE.py [options] [-- overrides]
#
# Required: --cluster, --project, --zone, --bucket, --run-name, --config, and either --tpu-type
# or --device-type with --num-nodes.
# Options:
#   --num-slices=N           TPU slices (default 1)
#   --docker-image=IMG       an image with qurl_jax installed, used as is (python3 on its PATH,
#                            working directory holding configs/)
#   --base-docker-image=IMG  otherwise: xpk layers this checkout on IMG (default python:3.11) and each
#                            pod installs it (launch/install.sh) before the run
#   --max-restarts=K         restarts of the whole workload on failure (default 0; the run resumes
#                            from its last checkpoint in the workdir)
#   --priority=P             very-low, low, medium (default), high, very-high
#   --create-cluster         first create the cluster with xpk cluster create (capacity below)
#   --capacity=MODE          with --create-cluster: on-demand (default), spot, reserved (needs
#                            --reservation=NAME), or flex
#   --dry-run                print the xpk commands without running them (same as DRY_RUN=1)
# After "--": extra config overrides, appended to the main command.
#
# The workdir is gs://B/NAME. TPU7x and later run only here (the TPU VM API does not support them).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=launch/common.sh
source "${REPO}/launch/common.sh"

usage() {
  sed -n '2,30s/^# \{0,1\}//p' "$0"
}

CLUSTER="" PROJECT="" ZONE="" TPU_TYPE="" DEVICE_TYPE="" NUM_SLICES="" NUM_NODES="" BUCKET=""
RUN_NAME="" CONFIG="" DOCKER_IMAGE="" BASE_DOCKER_IMAGE="" MAX_RESTARTS=0 PRIORITY=medium
CREATE_CLUSTER=0 CAPACITY="" RESERVATION=""
OVERRIDES=()
split_flags "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
while (($#)); do
  case "$1" in
    --cluster) need_value "$@"; CLUSTER=$2; shift ;;
    --project) need_value "$@"; PROJECT=$2; shift ;;
    --zone) need_value "$@"; ZONE=$2; shift ;;
    --tpu-type) need_value "$@"; TPU_TYPE=$2; shift ;;
    --device-type) need_value "$@"; DEVICE_TYPE=$2; shift ;;
    --num-slices) need_value "$@"; NUM_SLICES=$2; shift ;;
    --num-nodes) need_value "$@"; NUM_NODES=$2; shift ;;
    --bucket) need_value "$@"; BUCKET=$2; shift ;;
    --run-name) need_value "$@"; RUN_NAME=$2; shift ;;
    --config) need_value "$@"; CONFIG=$2; shift ;;
    --docker-image) need_value "$@"; DOCKER_IMAGE=$2; shift ;;
    --base-docker-image) need_value "$@"; BASE_DOCKER_IMAGE=$2; shift ;;
    --max-restarts) need_value "$@"; MAX_RESTARTS=$2; shift ;;
    --priority) need_value "$@"; PRIORITY=$2; shift ;;
    --create-cluster) CREATE_CLUSTER=1 ;;
    --capacity) need_value "$@"; CAPACITY=$2; shift ;;
    --reservation) need_value "$@"; RESERVATION=$2; shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; config overrides go after '--')" ;;
  esac
  shift
done

require --cluster "${CLUSTER}" --project "${PROJECT}" --zone "${ZONE}" --bucket "${BUCKET}" \
  --run-name "${RUN_NAME}" --config "${CONFIG}"
check_run_name "${RUN_NAME}"
[[ -f "${REPO}/${CONFIG}" ]] || die "flag --config: no file ${CONFIG} in ${REPO} (give a path relative to the repository root)"
if [[ -n "${TPU_TYPE}" && -n "${DEVICE_TYPE}" ]]; then
  die "give one of --tpu-type (TPU) or --device-type (GPU), not both"
elif [[ -n "${TPU_TYPE}" ]]; then
  [[ -z "${NUM_NODES}" ]] || die "flag --num-nodes is for GPUs (--device-type); TPUs use --num-slices"
  NUM_SLICES=${NUM_SLICES:-1}
elif [[ -n "${DEVICE_TYPE}" ]]; then
  [[ -z "${NUM_SLICES}" ]] || die "flag --num-slices is for TPUs (--tpu-type); GPUs use --num-nodes"
  require --num-nodes "${NUM_NODES}"
else
  die "missing required flag(s): --tpu-type or --device-type (see --help)"
fi
[[ -z "${DOCKER_IMAGE}" || -z "${BASE_DOCKER_IMAGE}" ]] \
  || die "give one of --docker-image or --base-docker-image, not both"
one_of --priority "${PRIORITY}" very-low low medium high very-high
if [[ "${CREATE_CLUSTER}" == 1 ]]; then
  CAPACITY=${CAPACITY:-on-demand}
  one_of --capacity "${CAPACITY}" on-demand spot reserved flex
  [[ "${CAPACITY}" != reserved || -n "${RESERVATION}" ]] \
    || die "missing required flag(s): --reservation (for --capacity=reserved)"
elif [[ -n "${CAPACITY}${RESERVATION}" ]]; then
  die "flags --capacity/--reservation need --create-cluster (a workload uses its cluster's capacity)"
fi

WORKDIR=$(gcs_workdir "${BUCKET}" "${RUN_NAME}")
SCOPE=(--cluster="${CLUSTER}" --project="${PROJECT}" --zone="${ZONE}")
if [[ -n "${TPU_TYPE}" ]]; then
  DEVICE=(--tpu-type="${TPU_TYPE}" --num-slices="${NUM_SLICES}")
  ACCELERATOR=tpu
else
  DEVICE=(--device-type="${DEVICE_TYPE}" --num-nodes="${NUM_NODES}")
  ACCELERATOR=cuda12
fi

# The pod's command, run by bash in the image's /app (this checkout when xpk builds the image).
MAIN=(-m qurl_jax.main --config="${CONFIG}" --workdir="${WORKDIR}")
if [[ -n "${DOCKER_IMAGE}" ]]; then
  IMAGE=(--docker-image="${DOCKER_IMAGE}")
  COMMAND="python3 $(quote_cmd "${MAIN[@]}")"
else
  IMAGE=(--base-docker-image="${BASE_DOCKER_IMAGE:-python:3.11}" --script-dir="${REPO}")
  COMMAND="bash launch/install.sh --accelerator=${ACCELERATOR} --venv=/opt/qurl_venv"
  COMMAND+=" && /opt/qurl_venv/bin/python $(quote_cmd "${MAIN[@]}")"
fi
if [[ -n "${DEVICE_TYPE}" ]]; then
  # Expanded in the pod; xpk's GPU pods give the coordinator host without its port.
  # shellcheck disable=SC2016
  COMMAND+=' --coordinator_address=${JAX_COORDINATOR_ADDRESS}:${JAX_COORDINATOR_PORT}'
  # shellcheck disable=SC2016
  COMMAND+=' --num_processes=${NNODES} --process_id=${NODE_RANK}'
fi
if ((${#OVERRIDES[@]})); then
  COMMAND+=" $(quote_cmd "${OVERRIDES[@]}")"
fi
# xpk writes the GPU command into a double-quoted YAML string.
[[ "${COMMAND}" != *'"'* ]] || die "config overrides must not contain double quotes (use single quotes)"
need_tool xpk "pip install xpk"

if [[ "${CREATE_CLUSTER}" == 1 ]]; then
  case "${CAPACITY}" in
    reserved) CAPACITY_FLAG=(--reservation="${RESERVATION}") ;;
    *) CAPACITY_FLAG=("--${CAPACITY}") ;;
  esac
  run xpk cluster create "${SCOPE[@]}" "${DEVICE[@]}" "${CAPACITY_FLAG[@]}"
fi
run xpk workload create "${SCOPE[@]}" --workload="${RUN_NAME}" "${DEVICE[@]}" "${IMAGE[@]}" \
  --max-restarts="${MAX_RESTARTS}" --priority="${PRIORITY}" --command="${COMMAND}"
note "follow it with: xpk workload list $(quote_cmd "${SCOPE[@]}") --filter-by-job=${RUN_NAME}; metrics in ${WORKDIR}"
