"""tools/reposition_dump.py (the int2-transform codec's calibration over the positions the
engine serves): RoPE turns against a scalar reference, and a dump moved end to end."""
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

TOOLS = Path(__file__).resolve().parents[3] / "tools"
sys.path.insert(0, str(TOOLS))
import reposition_dump as rp  # noqa: E402


def rope_reference(x, pos, theta, pairing):
    """x [d] at position 0 turned to position pos, pair by pair (complex multiplication)."""
    d = len(x)
    out = list(x)
    for i in range(d // 2):
        a, b = (i, i + d // 2) if pairing == "half" else (2 * i, 2 * i + 1)
        z = complex(x[a], x[b]) * complex(math.cos(pos * theta ** (-2 * i / d)),
                                          math.sin(pos * theta ** (-2 * i / d)))
        out[a], out[b] = z.real, z.imag
    return np.array(out)


def test_rotate_matches_the_scalar_reference():
    rng = np.random.default_rng(1)
    for pairing in ("half", "interleaved"):
        k0 = rng.standard_normal((3, 2, 16))  # [tokens, heads, d] at position 0
        at = np.array([5, 700, 4000])
        post = np.stack([[rope_reference(k0[t, h], at[t], 1e4, pairing) for h in range(2)]
                         for t in range(3)]).astype(np.float32)
        moved = rp.rotate(post, np.array([100, -700, 3000]), 1e4, pairing)
        want = np.stack([[rope_reference(k0[t, h], p, 1e4, pairing) for h in range(2)]
                         for t, p in enumerate([105, 0, 7000])])
        np.testing.assert_allclose(moved, want, atol=2e-5)


def test_a_dump_moved_end_to_end(tmp_path):
    n, hq, hkv, d = 20, 4, 2, 8
    rng = np.random.default_rng(2)
    t = {}
    for l in range(2):
        t[f"layers.{l}.q"] = rng.standard_normal((n, hq, d)).astype(np.float32)
        t[f"layers.{l}.k"] = rng.standard_normal((n, hkv, d)).astype(np.float32)
        t[f"layers.{l}.v"] = rng.standard_normal((n, hkv, d)).astype(np.float32)
    meta = {"kvcd.dump": "1", "num_layers": "2", "num_q_heads": str(hq),
            "num_kv_heads": str(hkv), "head_dim": str(d), "tokens": str(n)}
    rp.write(tmp_path / "in.safetensors", meta, t)
    subprocess.run([sys.executable, str(TOOLS / "reposition_dump.py"), "--in",
                    str(tmp_path / "in.safetensors"), "--out", str(tmp_path / "out.safetensors"),
                    "--rope-theta", "10000", "--max-position", "4096", "--copies", "3",
                    "--skip-first", "4"], check=True)
    raw = (tmp_path / "out.safetensors").read_bytes()
    header = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
    assert header["__metadata__"]["tokens"] == str(n + 3 * (n - 4))
    meta2, out = rp.read(tmp_path / "out.safetensors")
    for l in range(2):
        for kind in ("q", "k", "v"):
            x, y = t[f"layers.{l}.{kind}"], out[f"layers.{l}.{kind}"]
            assert y.shape[0] == n + 3 * (n - 4)
            np.testing.assert_array_equal(y[:n], x)  # the dump as it was first
            copies = y[n:].reshape(3, n - 4, *x.shape[1:])
            if kind == "v":
                assert all(np.array_equal(c, x[4:]) for c in copies)
            else:  # turned: norms per pair kept, the rows themselves moved
                np.testing.assert_allclose(np.linalg.norm(copies, axis=-1),
                                           np.broadcast_to(np.linalg.norm(x[4:], axis=-1),
                                                           copies.shape[:-1]), rtol=1e-5)
                assert not np.allclose(copies[0], x[4:])
    assert "3 copies at positions drawn from [0, 4096)" in meta2["source"]
