#!/usr/bin/env bash
# Runs qurl_jax on a Cloud TPU VM slice: creates the slice (or reuses it, or requests it through a
# queued resource), installs this checkout on every worker, and runs the same
# `python -m qurl_jax.main` on all of them; jax.distributed finds its peers from the TPU metadata.
#
#   launch/tpu_vm.sh --project=P --zone=Z --accelerator-type=v5p-32 --bucket=gs://B \
#       --run-name=NAME --config=configs/FILE.py [options] [-- --config.FIELD=VALUE ...]
#
# Required: --project, --zone, --accelerator-type, --bucket, --run-name, --config.
# Options:
#   --runtime-version=V    TPU VM image (default from the accelerator type: v4 tpu-ubuntu2204-base,
#                          v5litepod v2-alpha-tpuv5-lite, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e)
#   --capacity=MODE        on-demand (default), spot, reserved, or queued (= on-demand, queued)
#   --queued               request the slice through a queued resource and wait until it is ACTIVE
#   --valid-until=DURATION queued only: give up on the request after DURATION (e.g. 6h)
#   --tpu-name=NAME        the TPU VM's name (default: the run name)
#   --skip-create          reuse an existing TPU VM without checking it
#   --skip-setup           do not copy and install the code (the workers already have it)
#   --detach               start the run in the background on the workers and return
#   --dry-run              print the commands without running any (same as DRY_RUN=1)
# After "--": extra config overrides, appended to the main command.
#
# The workdir is gs://B/NAME (checkpoints need a directory shared by all hosts). The code shipped is
# the committed HEAD of this checkout (git archive). TPU7x and later need GKE: use launch/xpk.sh.
# Spot: the preemption notice (SIGTERM) makes the run save a checkpoint at the step it is in and
# exit 143; rerunning the same command deletes the PREEMPTED slice, creates a new one and resumes.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=launch/common.sh
source "${REPO}/launch/common.sh"

usage() {
  sed -n '2,26s/^# \{0,1\}//p' "$0"
}

PROJECT="" ZONE="" ACCELERATOR_TYPE="" RUNTIME_VERSION="" CAPACITY="on-demand" QUEUED=0
VALID_UNTIL="" TPU_NAME="" BUCKET="" RUN_NAME="" CONFIG="" SKIP_CREATE=0 SKIP_SETUP=0 DETACH=0
OVERRIDES=()
split_flags "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
while (($#)); do
  case "$1" in
    --project) need_value "$@"; PROJECT=$2; shift ;;
    --zone) need_value "$@"; ZONE=$2; shift ;;
    --accelerator-type) need_value "$@"; ACCELERATOR_TYPE=$2; shift ;;
    --runtime-version) need_value "$@"; RUNTIME_VERSION=$2; shift ;;
    --capacity) need_value "$@"; CAPACITY=$2; shift ;;
    --queued) QUEUED=1 ;;
    --valid-until) need_value "$@"; VALID_UNTIL=$2; shift ;;
    --tpu-name) need_value "$@"; TPU_NAME=$2; shift ;;
    --bucket) need_value "$@"; BUCKET=$2; shift ;;
    --run-name) need_value "$@"; RUN_NAME=$2; shift ;;
    --config) need_value "$@"; CONFIG=$2; shift ;;
    --skip-create) SKIP_CREATE=1 ;;
    --skip-setup) SKIP_SETUP=1 ;;
    --detach) DETACH=1 ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage; exit 0 ;;
    --) shift; OVERRIDES=("$@"); break ;;
    *) die "unknown argument '$1' (see --help; config overrides go after '--')" ;;
  esac
  shift
done

require --project "${PROJECT}" --zone "${ZONE}" --accelerator-type "${ACCELERATOR_TYPE}" \
  --bucket "${BUCKET}" --run-name "${RUN_NAME}" --config "${CONFIG}"
check_run_name "${RUN_NAME}"
one_of --capacity "${CAPACITY}" on-demand spot reserved queued
if [[ "${CAPACITY}" == queued ]]; then
  CAPACITY=on-demand QUEUED=1
fi
[[ -z "${VALID_UNTIL}" || "${QUEUED}" == 1 ]] || die "flag --valid-until needs --queued"
[[ -f "${REPO}/${CONFIG}" ]] || die "flag --config: no file ${CONFIG} in ${REPO} (give a path relative to the repository root)"
TPU_NAME=${TPU_NAME:-${RUN_NAME}}

if [[ -z "${RUNTIME_VERSION}" ]]; then
  case "${ACCELERATOR_TYPE}" in
    v2-* | v3-* | v4-*) RUNTIME_VERSION=tpu-ubuntu2204-base ;;
    v5litepod-* | v5e-*) RUNTIME_VERSION=v2-alpha-tpuv5-lite ;;
    v5p-*) RUNTIME_VERSION=v2-alpha-tpuv5 ;;
    v6e-*) RUNTIME_VERSION=v2-alpha-tpuv6e ;;
    tpu7* | v7*) die "flag --accelerator-type: ${ACCELERATOR_TYPE} is not supported by the TPU VM API; use launch/xpk.sh (GKE)" ;;
    *) die "missing required flag(s): --runtime-version (no default for accelerator type ${ACCELERATOR_TYPE})" ;;
  esac
fi

WORKDIR=$(gcs_workdir "${BUCKET}" "${RUN_NAME}")
GCLOUD_SCOPE=(--zone="${ZONE}" --project="${PROJECT}")
CAPACITY_FLAGS=()
case "${CAPACITY}" in
  spot) CAPACITY_FLAGS=(--spot) ;;
  reserved) CAPACITY_FLAGS=(--reserved) ;;
esac
need_tool gcloud "install the Google Cloud CLI"

# ---------------------------------------------------------------------------- create or reuse
wait_until_active() {
  local qr=$1 state
  while true; do
    state=$(gcloud compute tpus queued-resources describe "${qr}" "${GCLOUD_SCOPE[@]}" \
      --format='value(state.state)')
    case "${state}" in
      ACTIVE) return 0 ;;
      FAILED | SUSPENDED | SUSPENDING | DELETING) die "queued resource ${qr} is ${state}" ;;
    esac
    note "queued resource ${qr}: ${state}; waiting"
    sleep 60
  done
}

VM_STATE=""
if [[ "${SKIP_CREATE}" != 1 && "${DRY_RUN}" != 1 ]]; then
  VM_STATE=$(gcloud compute tpus tpu-vm describe "${TPU_NAME}" "${GCLOUD_SCOPE[@]}" \
    --format='value(state)' 2>/dev/null) || VM_STATE=""
fi
if [[ "${VM_STATE}" == PREEMPTED || "${VM_STATE}" == TERMINATED ]]; then
  # A spot slice that was preempted cannot restart: delete it and create a new one. The run
  # saved a checkpoint on SIGTERM and resumes from it in the same workdir.
  note "TPU VM ${TPU_NAME} is ${VM_STATE}; deleting it and creating a new one (the run resumes from its checkpoint in ${WORKDIR})"
  run gcloud compute tpus tpu-vm delete "${TPU_NAME}" "${GCLOUD_SCOPE[@]}" --quiet
  if [[ "${QUEUED}" == 1 ]]; then
    run gcloud compute tpus queued-resources delete "${TPU_NAME}" "${GCLOUD_SCOPE[@]}" --quiet \
      --force
  fi
  VM_STATE=""
fi
if [[ "${SKIP_CREATE}" == 1 ]]; then
  note "reusing TPU VM ${TPU_NAME} (--skip-create)"
elif [[ -n "${VM_STATE}" ]]; then
  note "TPU VM ${TPU_NAME} exists (${VM_STATE}); reusing it"
elif [[ "${QUEUED}" == 1 ]]; then
  [[ "${DRY_RUN}" == 1 ]] && note "(dry run: the create commands are skipped when ${TPU_NAME} exists)"
  run gcloud compute tpus queued-resources create "${TPU_NAME}" "${GCLOUD_SCOPE[@]}" \
    --node-id="${TPU_NAME}" --accelerator-type="${ACCELERATOR_TYPE}" \
    --runtime-version="${RUNTIME_VERSION}" "${CAPACITY_FLAGS[@]+"${CAPACITY_FLAGS[@]}"}" \
    ${VALID_UNTIL:+"--valid-until-duration=${VALID_UNTIL}"}
  echo "+ $(quote_cmd gcloud compute tpus queued-resources describe "${TPU_NAME}" \
    "${GCLOUD_SCOPE[@]}" "--format=value(state.state)")  # every 60 s until ACTIVE"
  [[ "${DRY_RUN}" == 1 ]] || wait_until_active "${TPU_NAME}"
else
  [[ "${DRY_RUN}" == 1 ]] && note "(dry run: the create command is skipped when ${TPU_NAME} exists)"
  run gcloud compute tpus tpu-vm create "${TPU_NAME}" "${GCLOUD_SCOPE[@]}" \
    --accelerator-type="${ACCELERATOR_TYPE}" --version="${RUNTIME_VERSION}" \
    "${CAPACITY_FLAGS[@]+"${CAPACITY_FLAGS[@]}"}"
fi

# ------------------------------------------------------------------------- install on all workers
if [[ "${SKIP_SETUP}" == 0 ]]; then
  TARBALL="${TMPDIR:-/tmp}/qurl_jax-${RUN_NAME}.tar.gz"
  if [[ -n "$(git -C "${REPO}" status --porcelain --untracked-files=no)" ]]; then
    note "warning: uncommitted changes are not shipped (the workers get HEAD)"
  fi
  run git -C "${REPO}" archive --format=tar.gz --output="${TARBALL}" HEAD
  run gcloud compute tpus tpu-vm scp "${TARBALL}" "${TPU_NAME}:qurl_jax.tar.gz" \
    --worker=all "${GCLOUD_SCOPE[@]}"
  run gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --worker=all "${GCLOUD_SCOPE[@]}" \
    --command="rm -rf ~/qurl_jax && mkdir -p ~/qurl_jax && tar xzf ~/qurl_jax.tar.gz -C ~/qurl_jax && bash ~/qurl_jax/launch/install.sh --accelerator=tpu --venv=\$HOME/qurl_venv"
fi

# ------------------------------------------------------------------------- the same run everywhere
# shellcheck disable=SC2088  # the tilde is expanded by the workers' shell
MAIN="~/qurl_venv/bin/python $(quote_cmd -m qurl_jax.main --config="${CONFIG}" --workdir="${WORKDIR}" \
  "${OVERRIDES[@]+"${OVERRIDES[@]}"}")"
if [[ "${DETACH}" == 1 ]]; then
  MAIN="setsid nohup ${MAIN} >~/${RUN_NAME}.log 2>&1 </dev/null &"
  note "detached: logs in ~/${RUN_NAME}.log on each worker; metrics in ${WORKDIR}"
fi
STATUS=0
run gcloud compute tpus tpu-vm ssh "${TPU_NAME}" --worker=all "${GCLOUD_SCOPE[@]}" \
  --command="cd ~/qurl_jax && ${MAIN}" || STATUS=$?
if [[ "${STATUS}" != 0 && "${CAPACITY}" == spot ]]; then
  # SIGTERM before a spot preemption: the run saved a checkpoint and exited 143 (or the ssh
  # session died with the VM).
  note "the run ended with status ${STATUS} (a preempted spot run saves a checkpoint first): rerun this same command to resume it"
fi
exit "${STATUS}"
