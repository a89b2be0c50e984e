#!/usr/bin/env bash
# Prepares, on this machine, what the H200 FSQ training calls carry (each device call
# carries at most 64 MiB of working tree), in the ignored folder .cache/fsq-stage/:
#   part-1/gguf.part, part-2/gguf.part   SmolLM2-135M-Instruct's Q4_1 GGUF (scripts/
#        fetch-smollm2.sh) cut at 50 MiB, checked against bench/h200-fsq-stage.sha256;
#        part-2 also holds the wheel of the `gguf` package (the H200 image lacks it) for
#        tools/gguf_to_safetensors.py;
#   final/  train.npy, val.npy, corpus.json: the offline corpora, pre-tokenized
#        (tools/fsq_finetune/corpus.py: Python standard library sources, manual pages,
#        /usr/share/doc texts, licence texts; 512-token sequences, split by document);
#        fsq-g{128,48,16}-init.st: the codecs the training starts from, initialized by
#        kvcd-calibrate fsq on the FP32 model's residuals over init.tok (the first 512
#        tokens of bench/text/smollm2-calibration.txt and 3 training sequences spread over
#        the training split; residuals from tools/fsq_finetune/finetune.py dump).
# The evaluation text (bench/text/smollm2-heldout.txt) is used by none of them.
# Needs: scripts/build.sh kvcd-llama kvcd-calibrate; the FSQ venv (scripts/fsq-venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
cache=${KVCD_MODEL_CACHE:-.cache/models}
smol=$(KVCD_MODEL_CACHE=$cache ./scripts/fetch-smollm2.sh | tail -1)
gguf=$cache/wheels/SmolLM2-135M-Instruct.Q4_1.gguf
py="$(./scripts/fsq-venv.sh)/bin/python"
st=.cache/fsq-stage
sums=bench/h200-fsq-stage.sha256
mkdir -p "$st/part-1" "$st/part-2" "$st/final"
want() { awk -v k="$1" '$1 == k { print $2 }' "$sums"; }
[[ "$(sha256sum "$gguf" | cut -d' ' -f1)" == "$(want gguf)" ]] || { echo "make-stage: $gguf is not the GGUF of $sums" >&2; exit 1; }
[[ "$(sha256sum "$smol/model.safetensors" | cut -d' ' -f1)" == "$(want model.safetensors)" ]] ||
  echo "make-stage: warning: $smol/model.safetensors differs from $sums (another converter?)" >&2
head -c $((50 << 20)) "$gguf" >"$st/part-1/gguf.part"
tail -c +$(((50 << 20) + 1)) "$gguf" >"$st/part-2/gguf.part"
for n in 1 2; do
  [[ "$(sha256sum "$st/part-$n/gguf.part" | cut -d' ' -f1)" == "$(want part-$n)" ]] || { echo "make-stage: part $n differs from $sums" >&2; exit 1; }
done
rm -f "$st"/part-2/*.whl
"$py" -m pip download -q --no-deps --only-binary=:all: 'gguf==0.19.0' -d "$st/part-2" >&2
f=$st/final
if [[ ! -f $f/train.npy || ! -f $f/val.npy ]]; then
  nice -n 5 "$py" tools/fsq_finetune/corpus.py --kvcd-llama "$b/examples/kvcd-llama" --model "$smol" --out "$f"
fi
"$b/examples/kvcd-llama" --model "$smol" --encode bench/text/smollm2-calibration.txt >"$f/cal.tok"
"$py" - "$f" <<'PY'
import sys
import numpy as np
f = sys.argv[1]
cal = open(f + "/cal.tok").read().split()
train = np.load(f + "/train.npy")
idx = np.linspace(0, len(train) - 1, 15).astype(int)[[4, 8, 12]]
with open(f + "/init.tok", "w") as out:
    out.write(" ".join(cal[:512]) + "\n")
    for i in idx:
        out.write(" ".join(map(str, train[i].tolist())) + "\n")
PY
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nice -n 5 "$py" tools/fsq_finetune/finetune.py dump --model "$smol/model.safetensors" --positions 512 \
  --eval "tokens:$f/init.tok" --out "$tmp/init.dump" --weights "$tmp/weights.st"
for g in 128 48 16; do
  "$b/tools/kvcd-calibrate" fsq --dump "$tmp/init.dump" --weights "$tmp/weights.st" --latent "$g" \
    --out "$f/fsq-g$g-init.st" >"$f/fsq-g$g-init.log"
done
rm -f "$f/cal.tok"
du -b "$st"/part-1 "$st"/part-2 "$st"/final
