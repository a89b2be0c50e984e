#!/usr/bin/env bash
# Tests of the Python FSQ tools (tools/fsq_finetune: the JAX models against the C++ workers,
# fine-tuning a codec: training loss and held-out KL go down; tools/plot_quality.py) on the
# real stories260K model (../shared/data; they skip without it) and SmolLM2 when fetched.
# Needs the C++ tools built (scripts/build.sh kvcd_stories kvcd-calibrate kvcd-eval
# kvcd-llama). Creates (or reuses) the virtual
# environment of scripts/fsq-venv.sh with its pinned PyPI packages (JAX CPU: ~100 MB, no
# CUDA). Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVCD_BUILD_DIR=${KVCD_BUILD_DIR:-build}
venv=$(./scripts/fsq-venv.sh)
exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs "$@" tools/fsq_finetune/tests
