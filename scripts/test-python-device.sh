#!/usr/bin/env bash
# Runs the Python client tests on the GPU device (no network): installs the wheels packed by
# scripts/pack-python-device.sh (.whl: kvcd, protobuf, pytest) into a private folder, uses the
# image's torch, numpy and grpcio, and starts the CUDA daemon from .devbin (scripts/pack-device.sh)
# for the tests. Arguments are passed to pytest (e.g. -k cuda).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
site=${KVCD_PY_SITE:-/tmp/kvcd-python-site}
rm -rf "$site"
# The image's own protobuf (grpcio's) when it has one: a second copy on the path mixes the
# two versions' modules.
pkgs=(kvcd pytest iniconfig pluggy packaging pygments tomli exceptiongroup typing_extensions)
if ! "$py" -c 'import google.protobuf' 2>/dev/null; then pkgs+=(protobuf); fi
"$py" -c 'import google.protobuf as p; print("image protobuf", p.__version__)' 2>/dev/null || true
"$py" -m pip install -q --no-index --find-links .whl --target "$site" --no-deps "${pkgs[@]}"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || true
root=$PWD
cd client/python
PYTHONPATH="$site" LD_LIBRARY_PATH="$root/.devlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  KVCD_BINARY=${KVCD_BINARY:-$root/.devbin/kvcd} \
  exec "$py" -m pytest -p no:cacheprovider -q -rs "$@" tests
