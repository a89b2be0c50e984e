#!/usr/bin/env python3
"""Attention across daemons against pulling the pages (docs/cluster.md "Attention across
daemons"), CPU backend, two daemons on loopback started by this script.

A shared history of H tokens lives on daemon A; a session's own T tokens on daemon B. Per
decode step (every layer, one query token) the session either
  across: calls AttentionDecode on A (history) and B (own turns) concurrently and merges the
          two (o, LSE) exactly: nothing moves;
  pulled: first moves the history's pages to B as stored (FetchPages on A, PushPages on B:
          what PullPrefix does between daemons), then calls AttentionDecode on B alone.
Reports the one-time move, the per-step latency of both, and the steps after which the move
has paid for itself (if ever). Checks on every configuration that both answers agree.
    python3 bench/cluster_attention_vs_pull.py [--history 1024,8192,32768] [--steps 50]
Needs the kvcd Python client (scripts/test-python.sh --prepare makes .cache/python-venv) and
the daemon binary (build/server/kvcd or KVCD_BINARY).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

import kvcd
from kvcd.cluster import ClusterClient  # noqa: F401  (the merge the client uses)
from kvcd.cluster.merge import merge_attention

REPO = Path(__file__).resolve().parents[1]


def start_daemon(budget_mib: int):
    binary = os.environ.get("KVCD_BINARY") or str(REPO / os.environ.get("KVCD_BUILD_DIR", "build")
                                                  / "server" / "kvcd")
    fd, cfg = tempfile.mkstemp(suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(f"listen: 127.0.0.1:0\nmetrics_listen: \"\"\nbackend: cpu\n"
                f"memory_budget: {budget_mib}MiB\nworker_threads: 2\ncompute_threads: 1\n")
    p = subprocess.Popen([binary, "serve", "--config", cfg], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    for line in p.stdout:
        if line.startswith("kvcd ready"):
            fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, fields["grpc"], cfg
    raise RuntimeError("kvcd exited before it was ready")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--history", default="1024,8192,32768")
    ap.add_argument("--own", type=int, default=256)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    hists = [int(x) for x in args.history.split(",")]
    profile = kvcd.make_profile(None, {
        "name": "across", "num_layers": args.layers, "num_q_heads": 8, "num_kv_heads": 2,
        "head_dim": 128, "page_size": 16, "recent_tokens": 16, "history_format": "bf16",
        "memory_bytes": 1 << 30})
    procs = []
    try:
        pa, addr_a, ca = start_daemon(1200)
        procs.append((pa, ca))
        pb_, addr_b, cb = start_daemon(1200)
        procs.append((pb_, cb))
        a, b = kvcd.Client(addr_a, timeout=120), kvcd.Client(addr_b, timeout=120)
        for c in (a, b):
            c.register_model(profile)
        rng = np.random.default_rng(0)
        pool = ThreadPoolExecutor(max_workers=1)
        print("| history tokens | move once (ms, MiB) | across per step (ms) | pulled per step "
              "(ms) | steps to pay back | max abs diff |")
        print("|---|---|---|---|---|---|")
        for n in hists:
            toks = rng.integers(3, 30000, size=n + args.own).astype(np.int32)
            shape = (args.layers, n + args.own, 2, 128)
            k = rng.standard_normal(shape).astype(np.float32)
            v = rng.standard_normal(shape).astype(np.float32)
            salt = f"h{n}"
            a.put("across", toks[:n], k[:, :n], v[:, :n], cache_salt=salt)
            hist = a.open_sequence("across", toks[:n], cache_salt=salt)
            own = b.open_sequence("across", toks[n:], k=k[:, n:], v=v[:, n:],
                                  cache_salt=salt + "-own")
            qs = rng.standard_normal((args.steps, args.layers, 1, 8, 128)).astype(np.float32)
            across, outs = [], []
            for s in range(args.steps):
                t0 = time.perf_counter()
                step = []
                for layer in range(args.layers):
                    fa = pool.submit(hist.attention_decode, layer, qs[s, layer])
                    ob, lb = own.attention_decode(layer, qs[s, layer])
                    oa, la = fa.result()
                    step.append(merge_attention(oa, la, ob, lb)[0])
                across.append(time.perf_counter() - t0)
                outs.append(step)
            # Pull: the history's pages as stored, A -> B.
            t0 = time.perf_counter()
            pages = hist.fetch_pages()
            b.push_pages("across", toks[:n], pages, cache_salt=salt)
            move = time.perf_counter() - t0
            moved = sum(len(p.data) for p in pages.pages)
            whole = b.open_sequence("across", toks, k=k, v=v, cache_salt=salt)
            assert whole.matched_tokens == n - n % 16, whole.matched_tokens
            pulled, diff = [], 0.0
            for s in range(args.steps):
                t0 = time.perf_counter()
                for layer in range(args.layers):
                    o, _ = whole.attention_decode(layer, qs[s, layer])
                    diff = max(diff, float(np.abs(o - outs[s][layer]).max()))
                pulled.append(time.perf_counter() - t0)
            for seq in (hist, own, whole):
                seq.close()
            ac, pu = 1e3 * float(np.median(across)), 1e3 * float(np.median(pulled))
            payback = f"{1e3 * move / (ac - pu):.0f}" if ac > pu else "never"
            print(f"| {n:,} | {1e3 * move:.1f} ({moved / 2**20:.1f}) | {ac:.2f} | {pu:.2f} "
                  f"| {payback} | {diff:.1e} |")
            assert diff < 1e-3, f"across and pulled answers differ by {diff}"
        return 0
    finally:
        for p, cfg in procs:
            p.send_signal(signal.SIGTERM)
            p.wait(30)
            os.remove(cfg)


if __name__ == "__main__":
    sys.exit(main())
