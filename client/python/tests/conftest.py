"""Fixtures: the real kvcd binary on a loopback port.

The binary is ``$KVCD_BINARY`` or ``<repo>/${KVCD_BUILD_DIR:-build}/server/kvcd``. A daemon
is started from a temporary YAML config with ``listen: 127.0.0.1:0``; readiness is its
``kvcd ready grpc=HOST:PORT ...`` stdout line (read line by line, no sleeps), and it is
stopped by pid with SIGTERM.
"""
from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional

import pytest

REPO = Path(__file__).resolve().parents[3]
SHARED_DATA = REPO.parent / "shared" / "data"


def kvcd_binary() -> Path:
    if os.environ.get("KVCD_BINARY"):
        return Path(os.environ["KVCD_BINARY"])
    build = Path(os.environ.get("KVCD_BUILD_DIR", "build"))
    if not build.is_absolute():
        build = REPO / build
    return build / "server" / "kvcd"


class Daemon:
    """A kvcd process; ``grpc``/``metrics``/``health`` are the ready line's addresses."""

    def __init__(self, yaml: str, ready_timeout: float = 60.0) -> None:
        binary = kvcd_binary()
        if not binary.is_file():
            raise RuntimeError(f"no kvcd binary at {binary}: build it (scripts/build.sh kvcd) "
                               f"or set KVCD_BINARY")
        fd, self.config = tempfile.mkstemp(prefix="kvcd-pytest-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(yaml)
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([str(binary), "serve", "--config", self.config],
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.fields: Dict[str, str] = {}
        ready = threading.Event()

        def read_ready() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if line.startswith("kvcd ready"):
                    self.fields = dict(kv.split("=", 1) for kv in line.split()[2:] if "=" in kv)
                    ready.set()
            ready.set()  # EOF: exited

        self._reader = threading.Thread(target=read_ready, daemon=True)
        self._reader.start()
        if not ready.wait(ready_timeout) or "grpc" not in self.fields:
            self.stop()
            self.stderr.seek(0)
            raise RuntimeError("kvcd did not become ready:\n" + self.stderr.read().decode())
        self.grpc = self.fields["grpc"]
        self.metrics = self.fields.get("metrics", "off")
        self.health = self.fields.get("health", self.grpc)

    def signal_term(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        """SIGTERM and wait; returns the exit status."""
        self.signal_term()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            rc = self.proc.wait()
        if os.path.exists(self.config):
            os.remove(self.config)
        return rc

    def log(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")


CONFIG = """
listen: 127.0.0.1:0
metrics_listen: ""
memory_budget: 256MiB
lease: {default_ms: 5000, max_ms: 60000}
drain_timeout_ms: 300
models:
  - builtin: tiny
    memory: 1MiB
  - builtin: tiny
    name: cramped
    memory: 4096
  - builtin: qwen3-8b
    memory: 64MiB
  - builtin: tiny
    name: tiny-int2
    history_format: int2-oscar
    codec: identity
    memory: 1MiB
  - builtin: tiny
    name: tiny-int2-h
    history_format: int2-oscar
    codec: hadamard
    memory: 1MiB
"""


@pytest.fixture(scope="session")
def daemon():
    d = Daemon(CONFIG)
    yield d
    assert d.stop() == 0, d.log()


@pytest.fixture
def client(daemon):
    import kvcd

    with kvcd.Client(daemon.grpc, timeout=20) as c:
        yield c


@pytest.fixture
def fresh_daemon():
    """A daemon of its own (tests that drain or stop it)."""
    d = Daemon(CONFIG)
    yield d
    d.stop()


# ---------------------------------------------------------------------------------------
# Helpers shared by the tests
# ---------------------------------------------------------------------------------------

def random_kv(profile, n, seed):
    """K/V [L, n, H, D] float32 with values that survive BF16 well (|x| ~ 1)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shape = (profile.num_layers, n, profile.num_kv_heads, profile.head_dim)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


def random_tokens(n, seed):
    import numpy as np

    return np.random.default_rng(seed + 1000).integers(3, 30000, size=n).astype(np.int32)


def bf16_round(x):
    from kvcd.tensors import bf16_bits_to_float, float_to_bf16_bits

    return bf16_bits_to_float(float_to_bf16_bits(x)).reshape(x.shape)


def reference_attention(q, k, v, scale=None):
    """float64 attention of one sequence: q [Hq, D], k/v [n, Hkv, D] -> o [Hq, D], lse [Hq]."""
    import numpy as np

    hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    o = np.zeros((hq, d))
    lse = np.zeros(hq)
    for h in range(hq):
        s = (k[:, h // g, :].astype(np.float64) @ q[h].astype(np.float64)) * scale
        m = s.max()
        p = np.exp(s - m)
        o[h] = (p[:, None] * v[:, h // g, :]).sum(0) / p.sum()
        lse[h] = m + np.log(p.sum())
    return o, lse


def wait_until(predicate, timeout=20.0, poll=0.02):
    """Polls ``predicate`` until it is true (True) or ``timeout`` s pass (False): waiting
    for a state change of the daemon (a lease reaped), bounded in time."""
    import time

    deadline = time.monotonic() + timeout
    stop = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            return False
        stop.wait(poll)
    return True


def fsq_codec_blob(num_layers, c, g, num_kv_heads, head_dim, seed, key_norm=False):
    """A small random but well-formed FSQ codec file (docs/fsq.md), as safetensors bytes."""
    import json
    import struct

    import numpy as np

    rng = np.random.default_rng(seed)
    kv = num_kv_heads * head_dim
    tensors = {}
    for layer in range(num_layers):
        pre = f"layers.{layer}."
        tensors[pre + "encoder"] = rng.standard_normal((g, c)) * (2.0 / np.sqrt(c))
        tensors[pre + "encoder_bias"] = rng.standard_normal(g) * 0.1
        tensors[pre + "decoder_k"] = rng.standard_normal((kv, g)) / np.sqrt(g)
        tensors[pre + "decoder_v"] = rng.standard_normal((kv, g)) / np.sqrt(g)
        tensors[pre + "bias_k"] = rng.standard_normal(kv) * 0.1
        tensors[pre + "bias_v"] = rng.standard_normal(kv) * 0.1
        if key_norm:
            tensors[pre + "key_norm"] = 1.0 + 0.1 * rng.standard_normal(head_dim)
    header = {"__metadata__": {
        "kvcd.codec": "fsq", "version": "1", "num_layers": str(num_layers),
        "residual_width": str(c), "latent_width": str(g), "num_kv_heads": str(num_kv_heads),
        "head_dim": str(head_dim), "key_norm": "rms" if key_norm else "none"}}
    data = b""
    for name, t in tensors.items():
        raw = np.ascontiguousarray(t, dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data
