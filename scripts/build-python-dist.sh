#!/usr/bin/env bash
# Builds the Python client's sdist and wheel into ${1:-dist/python}: the sdist carries the
# .proto files, and the wheel is built from the sdist (so the sdist is known to build on its
# own, without the checkout). Uses (or makes) the venv .cache/python-build-venv with PyPI's
# `build`; the stubs come from pyproject's pinned grpcio-tools in pip's isolated build env.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-dist/python}
venv=.cache/python-build-venv
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q build==1.2.2.post1
fi
rm -rf "$out" client/python/build client/python/src/kvcd.egg-info
"$venv/bin/python" -m build -o "$out" client/python >/dev/null
rm -rf client/python/build client/python/src/kvcd.egg-info  # in-tree build leftovers
ls "$out"/kvcd-*.tar.gz "$out"/kvcd-*-py3-none-any.whl
