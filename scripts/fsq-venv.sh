#!/usr/bin/env bash
# Creates (or reuses) the virtual environment of the Python FSQ tools, .cache/fsq-venv
# (or $KVCD_FSQ_VENV), with pinned PyPI packages, and prints its path.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${KVCD_FSQ_VENV:-.cache/fsq-venv}
[[ $venv == /* ]] || venv=$PWD/$venv
packages=(jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 safetensors==0.8.0 matplotlib==3.11.2 pytest==9.2.0)
stamp="$venv/.kvcd-packages"
if [[ ! -x "$venv/bin/python" ]]; then
  mkdir -p "$(dirname "$venv")"
  "${PYTHON:-python3}" -m venv "$venv" >&2
fi
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "${packages[*]}" ]]; then
  "$venv/bin/python" -m pip install -q "${packages[@]}" >&2
  echo "${packages[*]}" >"$stamp"
fi
echo "$venv"
