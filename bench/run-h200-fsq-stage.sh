#!/usr/bin/env bash
# Stage call N of the H200 FSQ training (bench/run-h200-fsq-train.sh): appends part N of
# SmolLM2-135M-Instruct's GGUF, carried in .cache/fsq-stage/part-N (made here by
# bench/make-h200-fsq-stage.sh; a device call carries at most 64 MiB), to
# ${FSQ_STAGE:-/root/fsq-stage}/model.gguf, checking the part's sha256 against
# bench/h200-fsq-stage.sha256 before and the whole file's after the last part. Part 1
# starts the file afresh; part N > 1 needs parts 1..N-1 appended by the calls before on the
# same (warm) machine, and says so if they are not there. Part N may also carry wheels
# (*.whl), copied to the stage for the training call.
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:?usage: bench/run-h200-fsq-stage.sh N}
stage=${FSQ_STAGE:-/root/fsq-stage}
sums=bench/h200-fsq-stage.sha256
src=.cache/fsq-stage/part-$n
want() { awk -v k="$1" '$1 == k { print $'"$2"' }' "$sums"; }
parts=$(grep -c '^part-' "$sums")
[[ -n $(want "part-$n" 2) ]] || { echo "stage: no part $n in $sums (parts 1..$parts)" >&2; exit 2; }
[[ -f $src/gguf.part ]] || { echo "stage: $src/gguf.part missing: carry .cache/fsq-stage/part-$n" >&2; exit 2; }
got=$(sha256sum "$src/gguf.part" | cut -d' ' -f1)
if [[ $got != "$(want "part-$n" 2)" ]]; then
  echo "stage: $src/gguf.part: sha256 $got, expected $(want "part-$n" 2)" >&2
  exit 1
fi
mkdir -p "$stage"
if [[ $n == 1 ]]; then
  rm -f "$stage/model.gguf" "$stage/model.gguf.partial" "$stage/parts-done"
  : >"$stage/model.gguf.partial"
elif [[ "$(cat "$stage/parts-done" 2>/dev/null)" != "$((n - 1))" ]]; then
  echo "stage: part $n needs parts 1..$((n - 1)) in $stage (found: $(cat "$stage/parts-done" 2>/dev/null || echo none));" \
    "the machine went cold between calls: start again with part 1" >&2
  exit 1
fi
cat "$src/gguf.part" >>"$stage/model.gguf.partial"
echo "$n" >"$stage/parts-done"
for whl in "$src"/*.whl; do
  [[ -e $whl ]] && cp "$whl" "$stage/"
done
size=$(stat -c %s "$stage/model.gguf.partial")
echo "stage: part $n/$parts appended ($(stat -c %s "$src/gguf.part") bytes, sha256 ok); $size bytes staged"
if [[ $n == "$parts" ]]; then
  got=$(sha256sum "$stage/model.gguf.partial" | cut -d' ' -f1)
  if [[ $got != "$(want gguf 2)" || $size != "$(want gguf 3)" ]]; then
    echo "stage: the reassembled GGUF has sha256 $got ($size bytes), expected $(want gguf 2) ($(want gguf 3))" >&2
    exit 1
  fi
  mv "$stage/model.gguf.partial" "$stage/model.gguf"
  echo "stage: $stage/model.gguf complete, sha256 ok"
fi
