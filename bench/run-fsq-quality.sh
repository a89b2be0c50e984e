#!/usr/bin/env bash
# FSQ codec quality on stories260K (bench/results/2026-12-03-fsq-quality.md): codecs
# initialized on the model's own residuals from one text (greedy from "Once upon a time"),
# fine-tuned on that text, evaluated on another (greedy from "Tom had a big dog"), at
# G = 64, 32, 16 (4x, 8x, 16x of the dense K/V bytes), beside INT2-OSCAR calibrated on the
# same text. Needs: scripts/build.sh kvcd_stories kvcd-calibrate kvcd-eval, and
# ../shared/data/stories260K. Output in ${OUT:-build/fsq-quality}. STEPS = fine-tuning
# steps (default 150, Adam lr 2e-3). This is the one-text recipe that overfits; the recipe
# that generalizes is bench/run-fsq-finetune.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-$b/fsq-quality}
steps=${STEPS:-150}
data=${KVCD_SHARED_DATA:-../shared/data}/stories260K
py="$(./scripts/fsq-venv.sh)/bin/python"
mkdir -p "$out"
m=(--checkpoint "$data/stories260K.bin" --tokenizer "$data/tok512.bin")
A="Once upon a time"
B="Tom had a big dog"
"$b/examples/kvcd_stories" "${m[@]}" --steps 512 --dump "$out/calib.dump" \
  --dump-prompts "$A" --weights "$out/weights.st" >/dev/null
"$b/examples/kvcd_stories" "${m[@]}" --steps 512 --dump "$out/eval.dump" \
  --dump-prompts "$B" >/dev/null
"$b/tools/kvcd-calibrate" --dump "$out/calib.dump" --out "$out/oscar.st" --search-clip \
  >"$out/oscar.log"
codecs=(--codec "int2-oscar=$out/oscar.st")
for g in 64 32 16; do
  "$b/tools/kvcd-calibrate" fsq --dump "$out/calib.dump" --weights "$out/weights.st" \
    --latent $g --out "$out/fsq-g$g-init.st" | tee "$out/fsq-g$g-init.log"
  "$py" tools/fsq_finetune/finetune.py train "${m[@]}" --codec "$out/fsq-g$g-init.st" \
    --out "$out/fsq-g$g-tuned.st" --train "prompt:$A" --positions 512 --steps "$steps" --lr 2e-3 \
    | tee "$out/fsq-g$g-tune.log"
  codecs+=(--codec "fsq-g$g-init=$out/fsq-g$g-init.st" --codec "fsq-g$g-tuned=$out/fsq-g$g-tuned.st")
  for s in init tuned; do
    "$py" tools/fsq_finetune/finetune.py eval "${m[@]}" --codec "$out/fsq-g$g-$s.st" \
      --eval "prompt:$B" --positions 512 --json "$out/tf-g$g-$s.json"
    # 100 tokens greedy from BOS: the setting of the README's daemon INT2 figures.
    "$py" tools/fsq_finetune/finetune.py eval "${m[@]}" --codec "$out/fsq-g$g-$s.st" \
      --eval "prompt:" --positions 100 --json "$out/bos-g$g-$s.json"
  done
done
"$b/tools/kvcd-eval" --dump "$out/eval.dump" "${codecs[@]}" --sink 4 --recent 8 \
  --rope-pairing interleaved --positions 64 --json "$out/eval.json" | tee "$out/eval.log"
"$py" tools/plot_quality.py "$out/quality-kl.png" "$out/eval.json" --metric kl_mean \
  --title "stories260K, attention KL vs compression (windows 4 + 8, 512 tokens)"
"$py" tools/plot_quality.py "$out/quality-out.png" "$out/eval.json" --metric out_rel_err \
  --title "stories260K, attention-output error vs compression (windows 4 + 8, 512 tokens)"
