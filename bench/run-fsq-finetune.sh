#!/usr/bin/env bash
# FSQ fine-tuning that generalizes, on stories260K (bench/results/2026-12-04-fsq-finetune.md):
# codecs initialized by kvcd-calibrate fsq on the model's greedy text from "Once upon a time"
# (512 tokens) at G = 64, 32, 16 (4x, 8x, 16x of the dense K/V bytes), fine-tuned on that
# text plus others (bench/text/stories-train.txt) with the parameters selected on a validation split
# (bench/text/stories-val.txt + greedy from "Sam found a red ball"), and evaluated
# teacher-forced on held-out text B (greedy from "Tom had a big dog", 512 tokens), which no
# step of initialization, training or selection sees. Deterministic (full batch, no
# sampling; seed 0 unused). Needs: scripts/build.sh kvcd_stories kvcd-calibrate, and
# ../shared/data/stories260K. Output in ${OUT:-build/fsq-finetune}.
# STEPS (default 30), LR (5e-4), DECAY (0), EVERY (5): the fine-tuning recipe.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-$b/fsq-finetune}
data=${KVCD_SHARED_DATA:-../shared/data}/stories260K
py="$(./scripts/fsq-venv.sh)/bin/python"
ft=(tools/fsq_finetune/finetune.py)
mkdir -p "$out"
m=(--checkpoint "$data/stories260K.bin" --tokenizer "$data/tok512.bin")
[[ -f $out/calib.dump ]] || "$b/examples/kvcd_stories" "${m[@]}" --steps 512 \
  --dump "$out/calib.dump" --dump-prompts "Once upon a time" --weights "$out/weights.st" >/dev/null
# The init text's tokens (the FP32 greedy run), for training too.
[[ -f $out/train-A.txt ]] || { "$b/examples/kvcd_stories" "${m[@]}" --steps 512 \
  --prompt "Once upon a time" --logits "$out/A.logits.st" >/dev/null && "$py" -c "import sys
from safetensors.numpy import load_file
open(sys.argv[2], 'w').write(' '.join(map(str, load_file(sys.argv[1])['inputs'].astype(int))) + '\n')" \
  "$out/A.logits.st" "$out/train-A.txt"; }
[[ -f $out/heldout-B.txt ]] || "$py" "${ft[@]}" tokens "${m[@]}" --eval "prompt:Tom had a big dog" \
  --out "$out/heldout-B.txt"
[[ -f $out/val-greedy.txt ]] || "$py" "${ft[@]}" tokens "${m[@]}" --eval "prompt:Sam found a red ball" \
  --out "$out/val-greedy.txt"
for g in ${GS:-64 32 16}; do
  "$b/tools/kvcd-calibrate" fsq --dump "$out/calib.dump" --weights "$out/weights.st" \
    --latent "$g" --out "$out/fsq-g$g-init.st" >"$out/fsq-g$g-init.log"
  "$py" "${ft[@]}" train "${m[@]}" --codec "$out/fsq-g$g-init.st" --out "$out/fsq-g$g-tuned.st" \
    --train "tokens:$out/train-A.txt" --train text:bench/text/stories-train.txt \
    --val text:bench/text/stories-val.txt --val "tokens:$out/val-greedy.txt" \
    --steps "${STEPS:-30}" --lr "${LR:-5e-4}" --decay "${DECAY:-0}" --eval-every "${EVERY:-5}" \
    --seed 0 | tee "$out/fsq-g$g-tune.log"
  for s in init tuned; do
    "$py" "${ft[@]}" eval "${m[@]}" --codec "$out/fsq-g$g-$s.st" --eval "tokens:$out/heldout-B.txt" \
      --json "$out/heldout-g$g-$s.json"
  done
done
