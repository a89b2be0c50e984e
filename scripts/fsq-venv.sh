#!/usr/bin/env bash
# Creates (or reuses) the virtual environment of the Python FSQ tools, with pinned PyPI
# packages, and prints its path: ~/.cache/kvcd/fsq-venv-<hash> (outside the clone, keyed by
# the packages and the Python version, as the deployment and vLLM venvs: clean clones reuse
# it; ~20 s of the test command's first phase otherwise), or $KVCD_FSQ_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 safetensors==0.8.0 matplotlib==3.11.2 pytest==9.2.0)
python=${PYTHON:-python3}
hash=$( { echo "${packages[*]}"; "$python" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-16)
venv=${KVCD_FSQ_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd/fsq-venv-$hash}
[[ $venv == /* ]] || venv=$PWD/$venv
# The stamp is written last: a venv without it (an interrupted install) is made again.
stamp="$venv/.kvcd-packages"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "${packages[*]}" ]]; then
  rm -rf "$venv"
  mkdir -p "$(dirname "$venv")"
  "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install -q "${packages[@]}" >&2
  echo "${packages[*]}" >"$stamp"
fi
echo "$venv"
