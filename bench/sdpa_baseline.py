"""BF16 decode attention through torch SDPA (cuDNN and flash backends): the baseline the
INT2 kernel is measured against, same geometry and sizes, same device, same run.

Qwen3-8B layer: 32 query heads, 8 KV heads (GQA), head_dim 128, one query token.
Prints one line per (backend, context, batch): median microseconds over 50 runs and the
achieved bandwidth counting the K/V bytes read.
"""
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

HQ, HKV, D = 32, 8, 128


def bench(backend, n, batch):
    q = torch.randn(batch, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(batch, HKV, n, D, device="cuda", dtype=torch.bfloat16)
    with sdpa_kernel([backend]):
        for _ in range(3):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
    times.sort()
    us = times[len(times) // 2] * 1e3
    mb = 2 * batch * HKV * n * D * 2 / 1e6
    return us, mb


def main():
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'backend':>8} {'context':>8} {'batch':>6} {'us':>10} {'MB read':>10} {'TB/s':>7}")
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        for n in (32768, 100000):
            for batch in (1, 8, 64):
                try:
                    us, mb = bench(backend, n, batch)
                    print(f"{name:>8} {n:>8} {batch:>6} {us:>10.1f} {mb:>10.1f} {mb / us:>7.2f}")
                except RuntimeError as e:  # a backend may refuse a shape
                    print(f"{name:>8} {n:>8} {batch:>6} unavailable: {str(e).splitlines()[0][:80]}")
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
