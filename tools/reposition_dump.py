#!/usr/bin/env python3
"""Moves the tokens of an activation dump to other positions: post-RoPE queries and keys
rotated by the RoPE angle of (new position - old position), values unchanged.

A codec fitted on post-RoPE keys learns their distribution at the positions of its
calibration text. RoPE turns each pair of a key's dimensions by position x frequency, so a
dump of 512 tokens shows the slow pairs only part of their turn: at positions 4k or 8k
those pairs point in directions the calibration never saw (and gave few bits). Placing
every token, in ``--copies`` copies, at positions drawn uniformly from ``[0,
--max-position)`` gives the codec the keys' spread over the positions the engine serves,
from the same text, at the cost of NumPy arithmetic rather than a long forward pass.

The output is the input as it was (the calibration skips its first rows, the BF16 sink),
then ``--copies`` copies of its tokens from ``--skip-first`` on, each at new positions.

  python3 tools/reposition_dump.py --in calib.dump.safetensors --out calib-8k.dump.safetensors \
      --rope-theta 100000 --max-position 8192 [--copies 4] [--skip-first 64] [--pairing half]

The input must hold one prompt (token t at position t) from the first position, as
``tools/dump_activations.py`` and ``kvcd-llama --dump`` write for a one-line text.
``--pairing half`` (Llama / Hugging Face: dimension i with i + d/2) or ``interleaved``
(i with i + 1). NumPy only (the safetensors format is read and written here).
"""
import argparse
import json
import struct
import sys

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": None}


def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    meta = header.pop("__metadata__", {})
    tensors = {}
    for name, h in header.items():
        b0, b1 = h["data_offsets"]
        raw = np.frombuffer(data[b0:b1], dtype=np.uint8)
        if h["dtype"] == "BF16":
            x = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif h["dtype"] in _DTYPES:
            x = raw.view(_DTYPES[h["dtype"]]).astype(np.float32)
        else:
            sys.exit(f"{path}: tensor {name} has dtype {h['dtype']}, expected F32, F16 or BF16")
        tensors[name] = x.reshape(h["shape"])
    return meta, tensors


def write(path, meta, tensors):
    header, blobs, at = {"__metadata__": meta}, [], 0
    for name, x in tensors.items():
        b = np.ascontiguousarray(x, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(x.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def rotate(x, delta, theta, pairing):
    """x [n, heads, d] post-RoPE rows turned on by delta [n] positions."""
    d = x.shape[-1]
    freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    ang = delta.astype(np.float64)[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    if pairing == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
    else:
        a, b = x[..., 0::2], x[..., 1::2]
    ra, rb = a * cos - b * sin, b * cos + a * sin
    out = np.empty_like(x)
    if pairing == "half":
        out[..., : d // 2], out[..., d // 2:] = ra, rb
    else:
        out[..., 0::2], out[..., 1::2] = ra, rb
    return out.astype(np.float32)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--in", dest="src", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rope-theta", type=float, required=True)
    ap.add_argument("--max-position", type=int, required=True)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--pairing", choices=("half", "interleaved"), default="half")
    ap.add_argument("--skip-first", type=int, default=64,
                    help="tokens left out of the moved copies (the sink: kvcd stores it BF16)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.copies < 1 or a.max_position < 1 or a.rope_theta <= 1:
        sys.exit("--copies and --max-position must be >= 1 and --rope-theta > 1")
    meta, t = read(a.src)
    if meta.get("kvcd.dump") != "1":
        sys.exit(f"{a.src}: not a kvcd activation dump (metadata kvcd.dump != \"1\")")
    n, layers = int(meta["tokens"]), int(meta["num_layers"])
    skip = min(max(a.skip_first, 0), n)
    rng = np.random.default_rng(a.seed)
    pos = np.arange(skip, n)
    new = [rng.integers(0, a.max_position, size=n - skip) for _ in range(a.copies)]
    out = {}
    for name, x in t.items():
        if not name.startswith("layers."):
            continue
        kind = name.rsplit(".", 1)[1]
        if kind in ("q", "k"):
            moved = [rotate(x[skip:], p - pos, a.rope_theta, a.pairing) for p in new]
        else:
            moved = [x[skip:]] * a.copies
        out[name] = np.concatenate([x] + moved)
    for l in range(layers):
        for kind in ("q", "k", "v"):
            if f"layers.{l}.{kind}" not in out:
                sys.exit(f"{a.src}: layers.{l}.{kind} is missing")
    total = n + a.copies * (n - skip)
    meta = dict(meta, tokens=str(total),
                source=f"{meta.get('source', a.src)}, {a.copies} copies at positions drawn "
                       f"from [0, {a.max_position}) (RoPE theta {a.rope_theta:g}, {a.pairing})")
    write(a.out, meta, out)
    print(f"wrote {a.out}: {layers} layers x {total} tokens ({a.copies} moved copies of "
          f"{n - skip} at positions < {a.max_position})")


if __name__ == "__main__":
    main()
