#!/usr/bin/env bash
# Packs the Python client for a machine without network (the GPU device): builds the kvcd
# wheel and downloads the pure-Python wheels its tests need into .whl/ (ignored by git;
# the device tool carries it). The image there has torch, numpy and grpcio; protobuf and
# pytest come from .whl. The stubs are generated with an older grpcio-tools
# (KVCD_PY_GRPCIO_TOOLS, default 1.62.*) so that the wheel accepts older grpcio and
# protobuf runtimes (generated code refuses runtimes older than itself).
set -euo pipefail
cd "$(dirname "$0")/.."
tools=${KVCD_PY_GRPCIO_TOOLS:-grpcio-tools==1.62.*}
venv=.cache/python-pack-venv
py=${PYTHON:-python3}
[[ -x $venv/bin/python ]] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q "$tools" "setuptools>=64" wheel
rm -rf .whl && mkdir -p .whl
"$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation -w .whl ./client/python
rm -rf client/python/build client/python/src/kvcd.egg-info
# protobuf (pure-Python wheel) at the floor the wheel asks for, pytest and its deps.
floor=$(unzip -p .whl/kvcd-*.whl 'kvcd-*.dist-info/METADATA' | sed -n 's/^Requires-Dist: protobuf>=\([0-9.]*\).*/\1/p')
"$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --platform any \
  --python-version 3.9 -d .whl "protobuf>=${floor},<6" pytest iniconfig pluggy packaging \
  tomli exceptiongroup typing_extensions pygments
ls -1 .whl
