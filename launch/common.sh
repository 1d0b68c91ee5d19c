# shellcheck shell=bash
# Helpers sourced by the launch scripts: flag parsing, errors that name the flag, dry runs.
#
# Dry runs (`--dry-run` or DRY_RUN=1) print every command that would touch a cluster as one line
# "+ cmd arg ..." on stdout, quoted so the line can be pasted into a shell (and split with
# Python's shlex.split in the tests), and run none of them. Notes go to stderr.

DRY_RUN="${DRY_RUN:-0}"
[[ "${DRY_RUN}" == "true" ]] && DRY_RUN=1

die() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

note() {
  echo "$(basename "$0"): $*" >&2
}

# Quotes one argument for a POSIX shell: bare when it only has safe characters, else in '...'.
shquote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=,@%+-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\\\'\'}"
  fi
}

# A whole command line, each argument quoted.
quote_cmd() {
  local out="" arg
  for arg in "$@"; do
    out+="${out:+ }$(shquote "${arg}")"
  done
  printf '%s' "${out}"
}

# write_file PATH [append]: writes (or appends) stdin to PATH; a dry run writes nothing and says
# what it would, on stderr: "would write PATH:" and each line indented by four spaces.
write_file() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    note "dry run: would ${2:-write} ${1}:"
    sed 's/^/    /' >&2
  elif [[ "${2:-}" == append ]]; then
    cat >>"$1"
  else
    note "writing $1"
    cat >"$1"
  fi
}

# Prints the command; runs it unless this is a dry run.
run() {
  echo "+ $(quote_cmd "$@")"
  if [[ "${DRY_RUN}" != 1 ]]; then
    "$@"
  fi
}

# Splits "--flag=value" into "--flag" "value" (up to a lone "--"), so each script's parser only
# handles the "--flag value" form. The result is the global array ARGS.
split_flags() {
  ARGS=()
  while (($#)); do
    case "$1" in
      --) ARGS+=("$@"); return ;;
      --*=*) ARGS+=("${1%%=*}" "${1#*=}") ;;
      *) ARGS+=("$1") ;;
    esac
    shift
  done
}

# need_value FLAG [VALUE...]: fails unless the flag is followed by a value.
need_value() {
  [[ $# -ge 2 && "$2" != --* ]] || die "flag $1 needs a value"
}

# require FLAG VALUE [FLAG VALUE ...]: fails, naming every required flag that was not given.
require() {
  local missing=()
  while (($#)); do
    [[ -n "$2" ]] || missing+=("$1")
    shift 2
  done
  ((${#missing[@]} == 0)) || die "missing required flag(s): ${missing[*]} (see --help)"
}

# one_of FLAG VALUE CHOICE...: fails unless VALUE is one of the choices.
one_of() {
  local flag=$1 value=$2 choice
  shift 2
  for choice in "$@"; do
    [[ "${value}" == "${choice}" ]] && return 0
  done
  die "flag ${flag}: '${value}' is not one of: $*"
}

# need_tool NAME HINT: fails with a hint unless NAME is on PATH (not checked in dry runs).
need_tool() {
  if [[ "${DRY_RUN}" != 1 ]] && ! command -v "$1" >/dev/null 2>&1; then
    die "$1 not found on PATH ($2); --dry-run prints the commands without it"
  fi
}

# gs://BUCKET[/PREFIX] or BUCKET[/PREFIX] -> gs://BUCKET[/PREFIX]/RUN_NAME
gcs_workdir() {
  local bucket=${1#gs://}
  bucket=${bucket%/}
  [[ -n "${bucket}" ]] || die "flag --bucket: empty bucket name"
  printf 'gs://%s/%s' "${bucket}" "$2"
}

# Run names become TPU VM / GKE resource names: lower case letters, digits and '-'.
check_run_name() {
  [[ "$1" =~ ^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$ ]] \
    || die "flag --run-name: '$1' must be lower case letters, digits and '-', start with a letter, at most 40 characters"
}

# The pinned jax version from requirements.txt (jax[tpu] / jax[cuda12] must match it).
pinned_jax_version() {
  local version
  version=$(sed -n 's/^jax==\([^ ]*\).*/\1/p' "$1")
  [[ -n "${version}" ]] || die "no 'jax==' pin in $1"
  printf '%s' "${version}"
}
