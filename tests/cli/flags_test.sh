#!/usr/bin/env bash
# The command line of every binary (common/cli.h): --help exits 0 and lists the binary's own
# flags, each with its default (and never Abseil's internal ones); a command's --help lists
# that command's flags; --version prints the version; a usage error (unknown flag, missing
# or malformed value, unknown command) exits 2 with one line that names what was wrong and
# the --help to run; a flag's name may be spelled with dashes or underscores.
#   usage: flags_test.sh BINARY...   (paths of the built binaries; each is known by its name)
set -uo pipefail
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# run STATUS -- command...: runs it, checks its exit status; its output is left in $out.
run() {
  local want=$1 rc
  shift 2
  out=$("$@" 2>&1)
  rc=$?
  [[ $rc == "$want" ]] || fail "$* exited $rc, expected $want: $out"
}
# has REGEX WHAT: $out has a line matching the extended regex.
has() { grep -qE -- "$1" <<<"$out" || fail "$2 printed no line matching '$1': $out"; }
hasnt() { ! grep -qE -- "$1" <<<"$out" || fail "$2 printed a line matching '$1': $out"; }
# one_line_error BINARY WHAT -- command...: exit 2, one line, naming WHAT and the --help.
one_line_error() {
  local help=$1 what=$2
  shift 2
  run 2 -- "$@"
  [[ $(wc -l <<<"$out") == 1 ]] || fail "$* printed more than one line: $out"
  grep -qF -- "$what" <<<"$out" || fail "$* did not say '$what': $out"
  grep -qF -- "run '$help --help'" <<<"$out" || fail "$* did not point at '$help --help': $out"
}

# A known flag of each binary and its default, as its --help lists it.
declare -A known=(
  [kvcd]=''
  [kvctl]='--deadline-ms .*\(default: 30000\)'
  [kvcd-calibrate]='--holdout .*\(default: 0.2\)'
  [kvcd-eval]='--positions .*\(default: 16\)'
  [kvcd-int2-study]='--positions .*\(default: 48\)'
  [kvcd_demo]='--system-tokens .*\(default: 512\)'
  [kvcd-llama]='--max-new .*\(default: 32\)'
  [kvcd_stories]='--steps .*\(default: 100\)'
  [kvcd_load]='--put-tokens .*\(default: 64\)'
  [kvcd_soak]='--streams .*\(default: 1000\)'
  [kvcd-replay]='--capacity-pages .*\(default: 1953\)'
  [attention_cpu_bench]='--contexts .*\(default: "4096,32768,100000"\)'
  [fsq_cpu_bench]='--latents .*\(default: "256,84"\)'
  [finite_check_bench]='^Usage: finite_check_bench \[OUT.md\]'
  [attention_cpu_kernel_bench]='^Usage: attention_cpu_kernel_bench \[TOKENS=4096\] \[REPS=100\]'
  [cpu_vector_peak]='^Usage: cpu_vector_peak'
  [kvcd_decode_worker]='--steps .*\(default: 16\)'
  [kvcd_prefill_worker]='--repeat .*\(default: 3\)'
  [cuda_int2_bench]='--check-only .*\(default: false\)'
  [cuda_transform_bench]='--out .*\(default: ""\)'
  [cuda_demote_bench]='--tokens .*\(default: 32768\)'
  [cuda_finite_check_bench]='--reps .*\(default: 15\)'
  [cuda_doorbell_bench]='--rounds .*\(default: 2000\)'
  [cuda_host_cost_bench]='--rounds .*\(default: 200\)'
  [cuda_bf16_split_bench]='--batches .*\(default: "1,8"\)'
  [cuda_fsq_bench]='--quick .*\(default: false\)'
  [cuda_fsq_encode_bench]='--tc-timings .*\(default: false\)'
  [fsq_tc_accuracy]='--attention-tokens .*\(default: 512\)'
)

declare -A bin
for path in "$@"; do
  name=$(basename "$path")
  [[ -v known[$name] ]] || { fail "no expectation for binary $name"; continue; }
  bin[$name]=$path
  run 0 -- "$path" --help
  has '^Usage: ' "$name --help"
  [[ -n ${known[$name]} ]] && has "${known[$name]}" "$name --help"
  hasnt '--(flagfile|fromenv|tryfromenv|undefok)' "$name --help"
  run 0 -- "$path" -h
  has '^Usage: ' "$name -h"
  run 0 -- "$path" --version
  has "^$name [0-9]+\.[0-9]+\.[0-9]+$" "$name --version"
  one_line_error "$name" "unknown flag '--no-such-flag'" "$path" --no-such-flag
done

# kvcd-replay: the trace is required; a bad capacity is a usage error.
if [[ -v bin[kvcd-replay] ]]; then
  one_line_error kvcd-replay "--trace is required" "${bin[kvcd-replay]}"
  one_line_error kvcd-replay "--capacity-pages must be > 0" "${bin[kvcd-replay]}" --trace x \
    --capacity-pages 0
fi

for name in kvcd kvctl kvcd-calibrate; do
  [[ -v bin[$name] ]] || fail "$name was not given"
done
kvcd=${bin[kvcd]:-false} kvctl=${bin[kvctl]:-false} calibrate=${bin[kvcd-calibrate]:-false}

# kvcd: the commands, each with its help; usage errors.
run 0 -- "$kvcd" --help
has '^  serve +start the daemon' "kvcd --help"
has '^  check-config +validate a config file' "kvcd --help"
run 0 -- "$kvcd" help
has '^  serve ' "kvcd help"
for cmd in serve check-config; do
  run 0 -- "$kvcd" "$cmd" --help
  has "^Usage: kvcd $cmd " "kvcd $cmd --help"
  has '^  --config +.*\(default: ""\)' "kvcd $cmd --help"
  has '^  --metrics-listen +.*\(default: ""\)' "kvcd $cmd --help"
  has '^  --insecure +.*\(default: false\)' "kvcd $cmd --help"
done
run 0 -- "$kvcd" --version
has '^kvcd [0-9]+\.[0-9]+\.[0-9]+$' "kvcd --version"
one_line_error kvcd "no command given" "$kvcd"
one_line_error kvcd "unknown command 'frobnicate'" "$kvcd" frobnicate
one_line_error "kvcd serve" "unknown flag '--no-such-flag'" "$kvcd" serve --no-such-flag
one_line_error "kvcd serve" "flag --config needs a value" "$kvcd" serve --config
one_line_error "kvcd serve" "bad value 'maybe' for --insecure" "$kvcd" serve --insecure=maybe
one_line_error "kvcd check-config" "check-config needs --config FILE" "$kvcd" check-config
one_line_error "kvcd serve" "unexpected argument 'extra'" "$kvcd" serve extra

# check-config reads the flags it is given, in each spelling Abseil and the scripts use.
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
cat >"$dir/kvcd.yaml" <<'YAML'
listen: 127.0.0.1:0
backend: cpu
memory_budget: 64MiB
models:
  - builtin: tiny
    memory: 1MiB
YAML
for spelling in "--listen 127.0.0.1:7001" "--listen=127.0.0.1:7001" "-listen 127.0.0.1:7001"; do
  # shellcheck disable=SC2086  # the spelling is two words or one
  run 0 -- "$kvcd" check-config --config "$dir/kvcd.yaml" $spelling
  has '^config OK: listen 127.0.0.1:7001, backend cpu' "kvcd check-config $spelling"
done
run 0 -- "$kvcd" check-config --config "$dir/kvcd.yaml"
has '^config OK: listen 127.0.0.1:0,' "kvcd check-config (the config's listen)"
# A non-loopback address needs TLS and tokens, or --insecure (a boolean flag, also --insecure=true).
for spelling in "--insecure" "--insecure=true"; do
  # shellcheck disable=SC2086
  run 0 -- "$kvcd" check-config --config "$dir/kvcd.yaml" --listen 0.0.0.0:7002 $spelling
done
run 2 -- "$kvcd" check-config --config "$dir/kvcd.yaml" --listen 0.0.0.0:7002 --insecure=false

# kvctl: every command's help lists its own flags and the global ones.
run 0 -- "$kvctl" --help
for cmd in health stats models register put match pin unpin decode; do
  has "^  $cmd " "kvctl --help"
done
has '^  --target +.*\(default: "127.0.0.1:50051"\)' "kvctl --help"
run 0 -- "$kvctl" put --help
has '^Usage: kvctl put --model M' "kvctl put --help"
has '^  --synthetic +.*\(default: 0\)' "kvctl put --help"
has '^  --seed +.*\(default: 1\)' "kvctl put --help"
has '^  --safetensors ' "kvctl put --help"
has '^  --deadline-ms +.*\(default: 30000\)' "kvctl put --help"
hasnt '^  --steps ' "kvctl put --help"
run 0 -- "$kvctl" decode --help
has '^  --steps +.*\(default: 8\)' "kvctl decode --help"
run 0 -- "$kvctl" register --help
has '^  --profile +.*\(default: ""\)' "kvctl register --help"
run 0 -- "$kvctl" match --help
has '^  --tokens ' "kvctl match --help"
run 0 -- "$kvctl" pin --help
has '^  --ttl-ms +.*\(default: 0\)' "kvctl pin --help"
has '^  --tokens ' "kvctl pin --help"
run 0 -- "$kvctl" unpin --help
has '^Usage: kvctl unpin PIN_ID' "kvctl unpin --help"
run 0 -- "$kvctl" health --help
has '^Usage: kvctl health' "kvctl health --help"
one_line_error kvctl "no command given" "$kvctl"
one_line_error kvctl "unknown command 'frobnicate'" "$kvctl" frobnicate
one_line_error "kvctl put" "unknown flag '--bogus'" "$kvctl" put --bogus=1
one_line_error "kvctl health" "bad value 'soon' for --deadline-ms" "$kvctl" health --deadline-ms soon
one_line_error "kvctl match" "bad value 'x' for --seed" "$kvctl" --seed=x match
# Both spellings of a dashed flag reach the client: a 1 ms deadline to a closed port fails
# the call (exit 1), it is not a usage error (exit 2).
for spelling in --deadline-ms --deadline_ms; do
  run 1 -- "$kvctl" --target 127.0.0.1:1 "$spelling" 1 health
done

# kvcd-calibrate: the default command and fsq and synth, each with its help.
run 0 -- "$calibrate" --help
has '^  fsq +a Transformer-FSQ codec' "kvcd-calibrate --help"
has '^  --search-clip +.*\(default: false\)' "kvcd-calibrate --help"
run 0 -- "$calibrate" fsq --help
has '^  --latent +.*\(default: 0\)' "kvcd-calibrate fsq --help"
run 0 -- "$calibrate" synth --help
has '^  --head-dim +.*\(default: 128\)' "kvcd-calibrate synth --help"
one_line_error kvcd-calibrate "--out is required" "$calibrate"
one_line_error "kvcd-calibrate synth" "bad value for --head-dim: 12" "$calibrate" synth --out "$dir/d" --head-dim 12
run 0 -- "$calibrate" synth --out "$dir/dump.safetensors" --tokens 64 --layers 1 --head-dim 8 --q-heads 2 --kv-heads 1
has '^wrote .*: 1 layers x 64 tokens \(2 q / 1 kv heads, head_dim 8\)' "kvcd-calibrate synth"

# The workers read the flags they share (worker_common.cc) and list them in their help.
for name in kvcd_decode_worker kvcd_prefill_worker; do
  [[ -v bin[$name] ]] || continue
  run 0 -- "${bin[$name]}" --help
  has '^  --target +.*\(default: "127.0.0.1:50051"\)' "$name --help"
  has '^  --token-file ' "$name --help"
  has '^  --model +.*\(default: "qwen3-8b-int2"\)' "$name --help"
done

if ((failures)); then
  echo "$failures failure(s)"
  exit 1
fi
echo "all command lines behave"
