"""The in-process baseline of cuda_job_bench: the same workload (a system prompt plus one
history per session with the trace's prompt lengths, Qwen3-8B: 36 layers, 32 query / 8 KV
heads, head_dim 128) decoded by torch SDPA on cuDNN from BF16 caches under the same memory
budget. No prefix cache in process: every sequence holds its own copy of the system prompt.

Each sequence's cache is its own pair of tensors per layer at its exact length (no padding);
sessions are taken in trace order while the caches fit the budget. One decode step = per
layer one cuDNN SDPA call per sequence (GQA, one query token), captured as one CUDA graph so
that host launches do not bind (plain launches if capture fails: said in the output). The
first sequence's output is checked against a float32 reference (relative L2 < 2e-2).

Prints the table row (the columns of cuda_job_bench) and writes --out (JSON) if given.
"""
import argparse
import json
import math

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

LAYERS, HQ, HKV, D = 36, 32, 8, 128
TOKEN_BYTES = LAYERS * 2 * HKV * D * 2  # K and V, BF16, every layer


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--budget_gb", type=float, default=60.0)
    p.add_argument("--system_tokens", type=int, default=2048)
    p.add_argument("--max_context", type=int, default=131072)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default="")
    a = p.parse_args()
    with open(a.trace) as f:
        lengths = [json.loads(line)["input_length"] for line in f if line.strip()]
    held, used = [], 0
    for n in lengths:
        total = a.system_tokens + min(max(n, 256), a.max_context - a.system_tokens)
        if used + total * TOKEN_BYTES > a.budget_gb * 1e9:
            break
        held.append(total)
        used += total * TOKEN_BYTES
    caches = [[(torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16),
                torch.randn(1, HKV, n, D, device="cuda", dtype=torch.bfloat16)) for n in held]
              for _ in range(LAYERS)]
    qs = [torch.randn(1, HQ, 1, D, device="cuda", dtype=torch.bfloat16) for _ in held]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backend, name = SDPBackend.CUDNN_ATTENTION, "cudnn"

    def step():
        with sdpa_kernel([backend]):
            for layer in caches:
                for q, (k, v) in zip(qs, layer):
                    sdpa(q, k, v, enable_gqa=True)

    # Correctness of one call against float32 (the flash kernel if cuDNN refuses the shapes:
    # said in the output).
    k, v = caches[0][0]
    try:
        with sdpa_kernel([backend]):
            out = sdpa(qs[0], k, v, enable_gqa=True).float()
    except RuntimeError as e:
        print(f"cuDNN refused ({str(e).splitlines()[0][:100]}): the flash kernel instead")
        backend, name = SDPBackend.FLASH_ATTENTION, "flash (cuDNN refused)"
        with sdpa_kernel([backend]):
            out = sdpa(qs[0], k, v, enable_gqa=True).float()
    kk = k[0].float().repeat_interleave(HQ // HKV, dim=0)
    vv = v[0].float().repeat_interleave(HQ // HKV, dim=0)
    ref = torch.softmax(qs[0][0].float() @ kk.transpose(-1, -2) / math.sqrt(D), dim=-1) @ vv
    err = ((out[0] - ref).norm() / ref.norm()).item()
    del kk, vv, ref
    if not err < 2e-2:
        print(f"{name} SDPA error {err:.2e} against the float32 reference")
        raise SystemExit(1)
    step()
    torch.cuda.synchronize()
    run, how = step, "plain launches"
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        g.replay()
        torch.cuda.synchronize()
        run, how = g.replay, "one CUDA graph"
    except RuntimeError as e:
        print(f"graph capture failed ({str(e).splitlines()[0][:100]}): plain launches")
        torch.cuda.synchronize()
    ms = []
    for _ in range(a.steps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        ms.append(e0.elapsed_time(e1))
    ms.sort()
    step_ms, spread = ms[len(ms) // 2], ms[-1] - ms[0]
    gb = used / 1e9
    r = dict(backend=f"{name}, one call per sequence, {how}", rel_err=err, held=len(held),
             tokens=sum(held), pool_gb=gb, step_ms=step_ms, spread_ms=spread,
             tok_s=len(held) * 1e3 / step_ms, read_gb=gb)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN "
          f"{torch.backends.cudnn.version()}; {r['backend']}; rel err {err:.1e}")
    print(f"| BF16 in process ({name}) | per sequence | {r['held']} | {r['tokens']} | {gb:.1f} | "
          f"{step_ms:.2f} ({spread:.2f}) | {r['tok_s']:.0f} | {gb:.1f} | {gb / step_ms:.2f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
