#!/usr/bin/env bash
# The H200 FSQ training call (issue #38), after the stage calls (bench/run-h200-fsq-stage.sh
# 1 and 2) on the same warm machine: reassembles and checks SmolLM2-135M-Instruct's GGUF
# in ${FSQ_STAGE:-/root/fsq-stage}, converts it with tools/gguf_to_safetensors.py (the
# `gguf` wheel staged by part 2) and checks the result against the file the CPU
# evaluation uses (bench/h200-fsq-stage.sha256), then trains the FSQ codecs G = 128, 48, 16
# side by side (tools/fsq_finetune/train_batched.py, JAX on the GPU) from the initialized
# codecs and pre-tokenized corpora carried in .cache/fsq-stage/final (bench/
# make-h200-fsq-stage.sh), adding the model's own sampled continuations; the validation
# split selects each codec's parameters. Writes to $OUT: fsq-g{128,48,16}.st (the selected
# codecs, rewritten at each improvement: the checkpoints), train.json, train.log,
# samples.npy. Wall budget: BUDGET seconds (default 450) for the whole call, compile
# included: the trainer gets what the preparation leaves, less a margin.
# Knobs: BATCH (32), LR (5e-3), SAMPLES (256), EVAL_SECONDS (45), TRAIN_SECONDS (0: the budget).
# Validation: 38 held-aside corpus sequences + 26 sampled ones (two batches of 32).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
budget=${BUDGET:-450}
stage=${FSQ_STAGE:-/root/fsq-stage}
out=${OUT:?set OUT to the output folder}
final=.cache/fsq-stage/final
sums=bench/h200-fsq-stage.sha256
want() { awk -v k="$1" '$1 == k { print $'"${2:-2}"' }' "$sums"; }
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}
mkdir -p "$out"
log=$out/train.log
say() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$log"; }
say "start: $(hostname), $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo no nvidia-smi)"
for f in fsq-g128-init.st fsq-g48-init.st fsq-g16-init.st train.npy val.npy; do
  [[ -f $final/$f ]] || { say "missing $final/$f: carry .cache/fsq-stage/final (bench/make-h200-fsq-stage.sh)"; exit 2; }
done
if [[ ! -f $stage/model.gguf ]]; then
  say "no $stage/model.gguf (parts done: $(cat "$stage/parts-done" 2>/dev/null || echo none)): run bench/run-h200-fsq-stage.sh 1 and 2 first, on the same warm machine"
  exit 2
fi
got=$(sha256sum "$stage/model.gguf" | cut -d' ' -f1)
[[ $got == "$(want gguf)" ]] || { say "model.gguf: sha256 $got, expected $(want gguf)"; exit 1; }
say "model.gguf sha256 ok"
model=$stage/model/model.safetensors
if [[ ! -f $model || "$(sha256sum "$model" | cut -d' ' -f1)" != "$(want model.safetensors)" ]]; then
  whl=$(ls "$stage"/gguf-*.whl 2>/dev/null | head -1)
  [[ -n $whl ]] || { say "no gguf wheel in $stage (part 2 carries it)"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$stage/site" "$whl"
  # The converter records the GGUF's file name (kvcd.source): give it the original one.
  ln -sf model.gguf "$stage/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -rf "$stage/model" "$stage/model.tmp"
  PYTHONPATH=$stage/site python3 tools/gguf_to_safetensors.py "$stage/SmolLM2-135M-Instruct.Q4_1.gguf" "$stage/model.tmp" >>"$log" 2>&1
  mv "$stage/model.tmp" "$stage/model"
fi
got=$(sha256sum "$model" | cut -d' ' -f1)
tensors=$(python3 -c "import hashlib, struct, sys
f = open(sys.argv[1], 'rb'); f.seek(8 + struct.unpack('<Q', f.read(8))[0]); h = hashlib.sha256()
for b in iter(lambda: f.read(1 << 24), b''): h.update(b)
print(h.hexdigest())" "$model")
if [[ $got == "$(want model.safetensors)" ]]; then
  say "model.safetensors sha256 ok: the model the CPU evaluation uses"
elif [[ $tensors == "$(want model.tensors)" ]]; then
  say "model.safetensors: header differs ($got), tensor bytes identical to the CPU evaluation's ($tensors)"
else
  say "WARNING: model.safetensors tensor bytes sha256 $tensors differ from the CPU evaluation's $(want model.tensors)"
fi
left=$((budget - ($(date +%s) - start) - 25))
say "training, $left s left for it (compile, sampling and validation included)"
set +e
python3 tools/fsq_finetune/train_batched.py --model "$model" \
  --codec "$final/fsq-g128-init.st" --codec "$final/fsq-g48-init.st" --codec "$final/fsq-g16-init.st" \
  --train "$final/train.npy" --val "$final/val.npy" --out-dir "$out" \
  --batch "${BATCH:-32}" --sink 16 --recent 32 --lr "${LR:-5e-3}" --warmup 20 \
  --eval-every 0 --eval-seconds "${EVAL_SECONDS:-45}" --val-seqs 38 --samples "${SAMPLES:-256}" \
  --prompt-len 32 --temperature 1.0 --sample-val 0.1 --precision tensorfloat32 \
  --val-precision tensorfloat32 --seed 0 \
  --seconds "${TRAIN_SECONDS:-0}" --deadline "$left" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
set -e
say "trainer exit $rc; files: $(cd "$out" && ls -l | tail -n +2 | awk '{print $9 "=" $5}' | tr '\n' ' ')"
exit "$rc"
