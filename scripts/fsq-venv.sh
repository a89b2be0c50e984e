#!/usr/bin/env bash
# Creates (or reuses) the virtual environment of the Python FSQ tools, with pinned PyPI
# packages, and prints its path: ~/.cache/kvcd/fsq-venv-<hash> (outside the clone, keyed by
# the packages and the Python version by scripts/cached-venv.sh, as the deployment and vLLM
# venvs: clean clones reuse it; ~20 s of the test command's first phase otherwise), or $KVCD_FSQ_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
packages=(jax==0.10.2 jaxlib==0.10.2 numpy==2.4.6 safetensors==0.8.0 matplotlib==3.11.2 pytest==9.2.0)
python=${PYTHON:-python3}
source scripts/cached-venv.sh
venv=$( { echo "${packages[*]}"; "$python" -c 'import sys; print(sys.version)'; } | cached_venv_dir fsq-venv)
venv=${KVCD_FSQ_VENV:-$venv}
[[ $venv == /* ]] || venv=$PWD/$venv
install() { "$1/bin/python" -m pip install -q "${packages[@]}"; }
cached_venv_ensure "$venv" .kvcd-packages "${packages[*]}" "$python" install
echo "$venv"
