#!/usr/bin/env bash
# A short FSQ fine-tuning run on SmolLM2-135M-Instruct at G = 48 (24 code bytes per token
# per layer: 32x of the dense K/V's 2 x 3 heads x 64 x 2 B = 768 B), to show that the tool
# works on a llama-family safetensors model (GQA 9/3, RoPE half): the codec is initialized
# by kvcd-calibrate fsq on bench/text/smollm2-calibration.txt (519 tokens; residuals
# dumped by finetune.py dump), fine-tuned on its first 256 tokens (2 sequences of 128) with
# the parameters selected on the first 128 tokens of bench/text/smollm2-heldout.txt, and
# evaluated teacher-forced on its tokens 256.. (379 tokens, 3 sequences of at most 128),
# which neither initialization, training nor selection see; windows sink 16 + recent 32
# (the kvcd-llama defaults). Short on purpose (the shared 2-core machine): STEPS (default
# 4), LR (1e-3). Needs: scripts/fetch-smollm2.sh, scripts/build.sh kvcd-llama
# kvcd-calibrate. Output in ${OUT:-build/fsq-finetune-smollm2}.
set -euo pipefail
cd "$(dirname "$0")/.."
b=${KVCD_BUILD_DIR:-build}
out=${OUT:-build/fsq-finetune-smollm2}
g=${G:-48}
smol=$(./scripts/fetch-smollm2.sh)
py="$(./scripts/fsq-venv.sh)/bin/python"
ft=(tools/fsq_finetune/finetune.py)
mkdir -p "$out"
"$b/examples/kvcd-llama" --model "$smol" --encode bench/text/smollm2-calibration.txt >"$out/cal.tok"
"$b/examples/kvcd-llama" --model "$smol" --encode bench/text/smollm2-heldout.txt >"$out/held.tok"
"$py" -c "import sys; ids = open(sys.argv[1]).read().split()
open(sys.argv[2], 'w').write(' '.join(ids[:128]) + '\n'); open(sys.argv[3], 'w').write(' '.join(ids[256:]) + '\n')
ids = open(sys.argv[4]).read().split(); open(sys.argv[5], 'w').write(' '.join(ids[:256]) + '\n')" \
  "$out/held.tok" "$out/val128.tok" "$out/eval.tok" "$out/cal.tok" "$out/train256.tok"
"$py" "${ft[@]}" dump --model "$smol/model.safetensors" --positions 512 --eval "tokens:$out/cal.tok" \
  --out "$out/cal.dump" --weights "$out/weights.st"
m=(--model "$smol/model.safetensors" --sink 16 --recent 32 --positions 128)
"$b/tools/kvcd-calibrate" fsq --dump "$out/cal.dump" --weights "$out/weights.st" --latent "$g" \
  --out "$out/fsq-g$g-init.st" >"$out/fsq-g$g-init.log"
/usr/bin/time -f "train: %e s wall, %U s user" "$py" "${ft[@]}" train "${m[@]}" \
  --codec "$out/fsq-g$g-init.st" --out "$out/fsq-g$g-tuned.st" --train "tokens:$out/train256.tok" \
  --val "tokens:$out/val128.tok" --steps "${STEPS:-4}" --lr "${LR:-1e-3}" --eval-every 2 --seed 0 \
  2>&1 | tee "$out/fsq-g$g-tune.log"
for s in init tuned; do
  /usr/bin/time -f "eval: %e s wall, %U s user" "$py" "${ft[@]}" eval "${m[@]}" --codec "$out/fsq-g$g-$s.st" --eval "tokens:$out/eval.tok" \
    --json "$out/heldout-g$g-$s.json"
done
