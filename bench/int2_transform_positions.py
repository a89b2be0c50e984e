"""How much of a post-RoPE key an int2-transform codec cannot hold, by position: per window
of positions of an activation dump (post-RoPE keys at positions 0..n-1, one prompt), the
share of the keys' deviation from the codec's mean that falls in directions given 0 bits
(lost outright), and the 99th percentile of |y / sigma| in the coded directions (how far
past the calibrated spread a row reaches: its FP16 gain grows with it and every direction's
step coarsens), averaged over layers and KV heads.

    python3 bench/int2_transform_positions.py --dump eval.dump.safetensors \\
        --codec NAME=codec.safetensors [--codec ...] [--windows 64-512,1536-2048,3584-4096]

NumPy only (tools/reposition_dump.py reads the safetensors files).
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import reposition_dump as rp  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dump", required=True)
    ap.add_argument("--codec", action="append", required=True, help="NAME=PATH (version 3)")
    ap.add_argument("--windows", default="64-512,1536-2048,3584-4096")
    a = ap.parse_args()
    meta, dump = rp.read(a.dump)
    layers, hkv = int(meta["num_layers"]), int(meta["num_kv_heads"])
    wins = [tuple(int(x) for x in w.split("-")) for w in a.windows.split(",")]
    print("| codec | " + " | ".join(f"positions {s}-{e - 1}: lost, p99 abs(z)" for s, e in wins)
          + " |")
    print("|---|" + "---:|" * len(wins))
    for item in a.codec:
        name, _, path = item.partition("=")
        _, c = rp.read(path)
        cells = []
        for s, e in wins:
            lost, z99 = [], []
            for l in range(layers):
                k = dump[f"layers.{l}.k"][s:e]
                for h in range(hkv):
                    enc, dec = c[f"layers.{l}.k_encode"][h], c[f"layers.{l}.k_decode"][h]
                    mean, sigma = c[f"layers.{l}.k_mean"][h], c[f"layers.{l}.k_sigma"][h]
                    zero = c[f"layers.{l}.k_bits"][h] == 0
                    x = k[:, h].astype(np.float64) - mean
                    y = x @ enc.T
                    gone = y[:, zero] @ dec[:, zero].T
                    lost.append((gone ** 2).sum() / (x ** 2).sum())
                    z99.append(np.percentile(np.abs(y[:, ~zero] / sigma[~zero]), 99))
            cells.append(f"{np.mean(lost):.3f}, {np.mean(z99):.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
