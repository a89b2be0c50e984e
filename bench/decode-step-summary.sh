#!/usr/bin/env bash
# The summary table of bench/run-decode-step.sh (markdown, batch 1, 36 layers) from its raw
# log, the cuDNN loop (bench/sdpa_baseline.py output) and the kernels alone
# (cuda_finite_check_bench output):
#   bench/decode-step-summary.sh decode-step-device.log sdpa.txt kernels.txt
# Per layer: "mean" = 1e6 / (tokens/s * 36); "p50" = the worker's layer total p50 (pipelined).
# Overhead beyond kvcd's kernels (INT2 32k only, where the kernels-alone bench has the same
# call): per-layer mean and p50 - (fused append row store + INT2 decode call, kernels back to
# back); it still holds the worker's 3 synthetic kernels and the BF16 window kernel. The
# worker's per-layer times are often bimodal (p50 far from the mean): read both.
set -euo pipefail
log=$1 sdpa=${2:-/dev/null} kernels=${3:-/dev/null}
awk -v SDPA="$sdpa" -v KERN="$kernels" '
  BEGIN {
    while ((getline l < SDPA) > 0) {
      split(l, f, " ")
      if (f[1] == "cudnn" && f[3] == 1 && f[5] + 0 > 0) cudnn[f[2]] = f[5]
    }
    while ((getline l < KERN) > 0) {
      n = split(l, f, "|")
      if (n < 7) continue
      if (f[2] ~ /batch 1: fused append row store/) store = f[6] + 0
      if (f[2] ~ /batch 1: INT2 decode call, 32768/) call32 = f[6] + 0
    }
  }
  /^=================== .* tokens, batch/ {
    split($0, h, /[ ,]+/); run = h[2] " " h[3]; runs[++nr] = run; sec = ""; next
  }
  /^=================== / { run = ""; next }
  run == "" { next }
  /^--- channel, pipelined/ { sec = "pipe"; next }
  /^--- channel, host waits/ { sec = "sync"; next }
  /^--- gRPC stream/ { sec = "grpc"; next }
  /^tokens\/s:/ { tps[run, sec] = $2 }
  sec == "pipe" && /worker.layer total/ { layer[run] = $(NF - 1) }
  sec == "pipe" && /daemon.channel.total/ { daemon[run] = $(NF - 1) }
  sec == "pipe" && /#daemon.kernel launches/ { launches[run] = $(NF - 2) }
  sec == "pipe" && /#daemon.H2D copies/ { h2d[run] = $(NF - 2) }
  sec == "pipe" && /#daemon.host syncs/ { syncs[run] = $(NF - 2) }
  /per call with the result on the host/ { for (i = 1; i < NF; ++i) if ($i == "p50") onhost[run] = $(i + 1) }
  END {
    print "| history, context | kvcd pipelined tok/s | per layer mean / p50 (us) | daemon host p50 (us) | host waits each result tok/s | result on host p50 (us) | gRPC tok/s | cuDNN loop tok/s (us/layer) | kvcd / cuDNN | launches / H2D / host syncs per call | overhead beyond kvcd kernels, mean / p50 (us) |"
    print "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"
    for (i = 1; i <= nr; ++i) {
      r = runs[i]; split(r, p, " ")
      hist = "BF16"; if (p[1] ~ /int2/) hist = "INT2"
      ctx = p[2] + 0; best = ""; bd = 1e18
      for (c in cudnn) { d = c - ctx; if (d < 0) d = -d; if (d < bd) { bd = d; best = c } }
      t = tps[r, "pipe"] + 0
      cu = 0; if (best != "") cu = 1e6 / (36 * cudnn[best])
      mean = 0; if (t > 0) mean = 1e6 / (36 * t)
      over = "n/a"
      if (hist == "INT2" && ctx == 32768 && call32 > 0 && layer[r] != "")
        over = sprintf("%.1f / %.1f", mean - store - call32, layer[r] - store - call32)
      ts = "failed"; if (t > 0) ts = sprintf("%.1f", t)
      cs = "n/a"; if (cu > 0) cs = sprintf("%.1f (%.1f)", cu, cudnn[best])
      rs = "n/a"; if (t > 0 && cu > 0) rs = sprintf("%.2fx", t / cu)
      printf "| %s, %d | %s | %.1f / %s | %s | %s | %s | %s | %s | %s | %s / %s / %s | %s |\n", hist, ctx, ts, mean, layer[r], daemon[r], tps[r, "sync"], onhost[r], tps[r, "grpc"], cs, rs, launches[r], h2d[r], syncs[r], over
    }
    if (call32 > 0)
      printf "\nKernels alone, batch 1 (cuda_finite_check_bench, median): fused append row store %.1f us, INT2 decode call at 32768 tokens %.1f us.\n", store, call32
  }' "$log"
