"""BF16 decode attention through torch SDPA (cuDNN and flash backends): the baseline the
INT2 kernel is measured against, same geometry and sizes, same device, same run.

Qwen3-8B layer: 32 query heads, 8 KV heads (GQA), head_dim 128, one query token.
Prints one line per (backend, context, batch): median microseconds of one call and per call
back to back (see bench()), and the achieved bandwidth counting the K/V bytes read.
"""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128


def bench(backend, n, batch):
    """Median microseconds of one call between two events ("single", launch gaps included)
    and per call over 40 calls back to back cycling over up to 4 K/V sets ("b2b", what a
    decode step over layers sees; the same two timings as cuda_int2_bench)."""
    bytes_per_set = 2 * batch * HKV * n * D * 2
    sets = max(1, min(4, 1_000_000_000 // bytes_per_set))
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    kv = [(torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16),
           torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel([backend]):
        for _ in range(3):
            sdpa(q, kv[0][0], kv[0][1], enable_gqa=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            sdpa(q, kv[0][0], kv[0][1], enable_gqa=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        b2b = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for c in range(40):
                k, v = kv[c % sets]
                sdpa(q, k, v, enable_gqa=True)
            b.record()
            b.synchronize()
            b2b.append(a.elapsed_time(b) / 40)
    times.sort()
    b2b.sort()
    return times[len(times) // 2] * 1e3, b2b[len(b2b) // 2] * 1e3, bytes_per_set / 1e6


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["cudnn", "flash"],
                        choices=["cudnn", "flash"])
    parser.add_argument("--contexts", nargs="+", type=int, default=[32768, 100000])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64])
    args = parser.parse_args()
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'backend':>8} {'context':>8} {'batch':>6} {'single us':>10} {'b2b us':>10} "
          f"{'MB read':>10} {'TB/s b2b':>9}")
    for name in args.backends:
        backend = backends[name]
        for n in args.contexts:
            for batch in args.batches:
                try:
                    us, us_b2b, mb = bench(backend, n, batch)
                    print(f"{name:>8} {n:>8} {batch:>6} {us:>10.1f} {us_b2b:>10.1f} {mb:>10.1f} "
                          f"{mb / us_b2b:>9.2f}")
                except RuntimeError as e:  # a backend may refuse a shape
                    print(f"{name:>8} {n:>8} {batch:>6} unavailable: {str(e).splitlines()[0][:80]}")
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
