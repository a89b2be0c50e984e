# shellcheck shell=bash
# Python virtual environments kept outside the clone, keyed by what they hold, so that runs
# and clean clones (and CI machines with a warm cache) reuse them. Sourced by the scripts
# that need one (scripts/fsq-venv.sh, scripts/vllm-venv.sh, scripts/test-deploy.sh):
#
#   cached_venv_dir NAME [ROOT] <KEY
#     Prints ROOT/NAME-<hash>: the hash is the first 16 hex digits of the SHA-256 of the
#     standard input, the key, which the caller writes (its pins and the Python version). ROOT
#     defaults to ${XDG_CACHE_HOME:-$HOME/.cache}/kvcd. The same key always gives the same
#     directory, so the caller's key must be written byte for byte as before when a script
#     changes (else every warm cache is built again).
#
#   cached_venv_ensure VENV STAMP TEXT PYTHON INSTALL
#     Reuses VENV when its file STAMP holds TEXT (an empty TEXT: when STAMP exists).
#     Otherwise removes VENV, makes it again with `PYTHON -m venv`, runs `INSTALL VENV` (a
#     command or function of the caller: its pip installs) and writes TEXT to STAMP last, so
#     that an interrupted build has no stamp and is made again. Everything it and INSTALL
#     print goes to stderr (the callers print the venv's path on stdout). Returns non-zero,
#     writing no stamp, when a step fails.

cached_venv_dir() {
  local name=$1 root=${2:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd} hash
  hash=$(sha256sum | cut -c1-16) || return
  echo "$root/$name-$hash"
}

cached_venv_ensure() {
  local venv=$1 stamp=$2 text=$3 python=$4 install=$5 label=${0##*/} start=$SECONDS
  label=${label%.sh}
  if [[ -f $venv/$stamp && "$(cat "$venv/$stamp")" == "$text" ]]; then
    return 0
  fi
  echo "$label: making the venv $venv" >&2
  if ! { rm -rf "$venv" && mkdir -p "$(dirname "$venv")" && "$python" -m venv "$venv" >&2 &&
    "$install" "$venv" >&2; }; then
    echo "$label: making the venv $venv failed" >&2
    return 1
  fi
  echo "$text" >"$venv/$stamp" || return
  echo "$label: built $venv in $((SECONDS - start)) s" >&2
}
