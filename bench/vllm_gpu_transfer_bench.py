"""The vLLM connector's block transfers on a GPU: CUDA IPC against inline bytes.

Drives kvcd.vllm.worker.WorkerTransfers (the connector's worker side, no vLLM needed) with
torch CUDA tensors laid out as vLLM 0.32's GPU KV cache (per layer the physical
[num_blocks, block_size, num_kv_heads, 2 * head_dim], BF16, handed over as the permuted
view) against a running CUDA daemon, Qwen3-8B's geometry by default (36 layers, 8 KV heads,
head_dim 128, block 16). Per prefix length and transport:

- save: ``save()`` of the whole prefix (the blocks copied out on the calling stream, then
  ``Put`` on the save thread) until ``flush()`` returns: the time until kvcd holds it;
- load: ``load()`` of the whole prefix into other blocks, then ``torch.cuda.synchronize()``:
  the time until the engine's blocks hold it.

Every save stores under its own cache salt (a new prefix each time); every load reads the
first save's prefix. The loaded blocks are checked equal to the saved ones. bytes/s counts
the BF16 K/V bytes (4 * layers * tokens * kv_heads * head_dim).

    python3 bench/vllm_gpu_transfer_bench.py --target 127.0.0.1:PORT --out results.json
"""
import argparse
import json
import statistics
import sys
import time

import torch

from kvcd.vllm import config as vconfig
from kvcd.vllm.specs import LoadSpec, SaveSpec
from kvcd.vllm.store import Geometry, Store
from kvcd.vllm.transfer import IpcTransport
from kvcd.vllm.worker import WorkerTransfers


class Counts(dict):
    def __call__(self, **kw):
        for key, value in kw.items():
            self[key] = self.get(key, 0) + value


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--lengths", default="1024,4096,16384")
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--memory-gib", type=int, default=20)
    ap.add_argument("--ipc-save-gib", type=float, default=3.0)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    L, H, D, bs = a.layers, a.kv_heads, a.head_dim, a.block
    geo = Geometry(num_layers=L, num_q_heads=a.q_heads, num_kv_heads=H, head_dim=D,
                   block_size=bs)
    nb = max(lengths) // bs
    # Two caches of the longest prefix: blocks saved from the first, loaded into the second.
    src_phys = [torch.randn(nb, bs, H, 2 * D, device="cuda").to(torch.bfloat16)
                for _ in range(L)]
    dst_phys = [torch.zeros(nb, bs, H, 2 * D, dtype=torch.bfloat16, device="cuda")
                for _ in range(L)]
    src = [p.permute(0, 2, 1, 3) for p in src_phys]
    dst = [p.permute(0, 2, 1, 3) for p in dst_phys]
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(3, 150000, (max(lengths) + 1,), generator=gen).tolist()
    rng_blocks = torch.randperm(nb, generator=gen).tolist()
    rows = []
    print(f"device {torch.cuda.get_device_name()}, geometry L={L} H={H} D={D} block={bs}, "
          f"{4 * L * H * D} K/V bytes per token", flush=True)
    for transport in ("inline", "cuda_ipc"):
        cfg = vconfig.parse({"target": a.target, "model": "bench-qwen3-8b",
                             "memory_bytes": a.memory_gib << 30, "transport": transport,
                             "timeout_s": 120.0,
                             "ipc_save_bytes": int(a.ipc_save_gib * (1 << 30)),
                             "max_pending_save_bytes": 8 << 30},
                            served_model="bench", block_size=bs)
        counts = Counts()
        w = WorkerTransfers(Store(cfg, geo, timeout=120.0), counts)
        for n in lengths:
            blocks = rng_blocks[:n // bs]
            w.set_layers(src)
            tr = w.transport()
            if transport == "cuda_ipc":
                assert isinstance(tr, IpcTransport), tr
            saves, loads = [], []
            for r in range(a.reps):
                spec = SaveSpec("s", f"{transport}-{n}-{r}", tokens[:n], 0, blocks)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                w.save(spec)
                assert w.flush(600)
                saves.append(time.perf_counter() - t0)
            assert counts.get("failed_saves", 0) == 0 and counts.get("dropped_saves", 0) == 0
            w.set_layers(dst)
            target = list(reversed(blocks))
            for r in range(a.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                w.load(LoadSpec("l", f"{transport}-{n}-0", tokens[:n], 0, target))
                torch.cuda.synchronize()
                loads.append(time.perf_counter() - t0)
                assert not w.take_failed_blocks()
            for layer in (0, L - 1):
                assert torch.equal(dst_phys[layer][target], src_phys[layer][blocks])
            nbytes = 4 * L * n * H * D
            row = dict(transport=transport, tokens=n, bytes=nbytes,
                       save_s=statistics.median(saves), load_s=statistics.median(loads),
                       save_all=saves, load_all=loads)
            row["save_GBps"] = nbytes / row["save_s"] / 1e9
            row["load_GBps"] = nbytes / row["load_s"] / 1e9
            rows.append(row)
            print(f"{transport:8s} {n:6d} tokens {nbytes / 1e6:8.1f} MB: save "
                  f"{row['save_s'] * 1e3:8.1f} ms ({row['save_GBps']:6.2f} GB/s), load "
                  f"{row['load_s'] * 1e3:8.1f} ms ({row['load_GBps']:6.2f} GB/s)", flush=True)
        w.shutdown()
    print("\n| tokens | MB | save inline (ms) | save IPC (ms) | load inline (ms) | load IPC (ms) "
          "| IPC save GB/s | IPC load GB/s | load speed-up |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in lengths:
        i = next(r for r in rows if r["tokens"] == n and r["transport"] == "inline")
        c = next(r for r in rows if r["tokens"] == n and r["transport"] == "cuda_ipc")
        print(f"| {n} | {i['bytes'] / 1e6:.1f} | {i['save_s'] * 1e3:.1f} | {c['save_s'] * 1e3:.1f} "
              f"| {i['load_s'] * 1e3:.1f} | {c['load_s'] * 1e3:.1f} | {c['save_GBps']:.2f} "
              f"| {c['load_GBps']:.2f} | {i['load_s'] / c['load_s']:.1f}x |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
