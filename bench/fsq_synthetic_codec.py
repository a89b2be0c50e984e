#!/usr/bin/env python3
"""Writes a synthetic FSQ codec file (docs/fsq.md "Codec file", common/fsq_codec.h) with the
scales of FsqCodec::Synthetic (uniform instead of normal draws, same standard deviations),
for daemon runs on machines without the build tree's tools. Draws with numpy when it imports
(the device machines), else with the standard library (or with --stdlib): the two paths
draw different values of the same distribution (synthetic codecs: timing, not quality).
The standard-library path takes ~0.3 s per layer of Qwen3-8B's geometry (C 4096, G 256,
8 x 128) on one core here, ~11 s for 36 layers (230 MB).

  bench/fsq_synthetic_codec.py OUT --layers 4 --residual 4096 --latent 256 --kv-heads 8 \
      --head-dim 128 [--key-norm] [--seed 1] [--stdlib]
"""
import argparse
import array
import json
import math
import random
import struct


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--residual", type=int, required=True)
    ap.add_argument("--latent", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--head-dim", type=int, required=True)
    ap.add_argument("--key-norm", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--stdlib", action="store_true", help="draw without numpy even if it imports")
    a = ap.parse_args()
    g, c, kv = a.latent, a.residual, a.kv_heads * a.head_dim
    np = None
    if not a.stdlib:
        try:
            import numpy as np
        except ImportError:
            np = None
    if np is not None:
        gen = np.random.default_rng(a.seed)

        def fill(n, std, offset=0.0):
            half = std * math.sqrt(3.0)  # uniform on [-half, half] has this std
            return (offset + gen.uniform(-half, half, n)).astype("<f4")
    else:
        rng = random.Random(a.seed)

        def fill(n, std, offset=0.0):
            half = std * math.sqrt(3.0)
            return array.array("f", (offset + half * (2.0 * rng.random() - 1.0) for _ in range(n)))

    tensors = []
    for l in range(a.layers):
        p = f"layers.{l}."
        tensors += [(p + "encoder", [g, c], fill(g * c, 2.0 / math.sqrt(c))),
                    (p + "encoder_bias", [g], fill(g, 0.1)),
                    (p + "decoder_k", [kv, g], fill(kv * g, 1.0 / math.sqrt(g))),
                    (p + "decoder_v", [kv, g], fill(kv * g, 1.0 / math.sqrt(g))),
                    (p + "bias_k", [kv], fill(kv, 0.1)),
                    (p + "bias_v", [kv], fill(kv, 0.1))]
        if a.key_norm:
            tensors.append((p + "key_norm", [a.head_dim], fill(a.head_dim, 0.1, 1.0)))
    header = {"__metadata__": {
        "kvcd.codec": "fsq", "version": "1", "num_layers": str(a.layers),
        "residual_width": str(c), "latent_width": str(g), "num_kv_heads": str(a.kv_heads),
        "head_dim": str(a.head_dim), "key_norm": "rms" if a.key_norm else "none",
        "source": f"bench/fsq_synthetic_codec.py seed {a.seed}"
                  f" ({'numpy' if np is not None else 'stdlib'})"}}
    offset = 0
    for name, shape, data in tensors:
        n = len(data) * 4  # array.array and numpy: elements, float32 each
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(a.out, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, _, data in tensors:
            if data.itemsize != 4:
                raise SystemExit("float is not 4 bytes here")
            f.write(data.tobytes())  # little-endian on x86 (numpy: "<f4")


if __name__ == "__main__":
    main()
