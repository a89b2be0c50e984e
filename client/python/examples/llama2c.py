"""llama2.c model files in numpy: the legacy checkpoint (e.g. stories260K.bin) and its
tokenizer (tok512.bin). The one reader of these files on the Python side, used by
examples/stories260k.py and tools/fsq_finetune (numpy only, no kvcd import).

Checkpoint: a header of 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len; a negative vocab_size means an unshared classifier, not
supported), then F32 weights in the order of ``SHAPES``. The model: RMSNorm eps 1e-5,
RoPE on adjacent pairs (2i, 2i+1) of each head with frequency 10000^(-2i/head_dim),
SwiGLU feed-forward, the classifier shared with the embedding.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Tuple

import numpy as np


@dataclass(frozen=True)
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def shapes(c: Config) -> List[Tuple[str, Tuple[int, ...]]]:
    """The weight arrays of a checkpoint, in file order."""
    L, d, kv, hid = c.n_layers, c.dim, c.kv_dim, c.hidden_dim
    return [("emb", (c.vocab_size, d)), ("rms_att", (L, d)), ("wq", (L, d, d)),
            ("wk", (L, kv, d)), ("wv", (L, kv, d)), ("wo", (L, d, d)), ("rms_ffn", (L, d)),
            ("w1", (L, hid, d)), ("w2", (L, d, hid)), ("w3", (L, hid, d)),
            ("rms_final", (d,))]


def read_checkpoint(path: str) -> Tuple[Config, Dict[str, np.ndarray]]:
    """Returns (Config, weights by the names of ``shapes``: read-only F32 views)."""
    raw = Path(path).read_bytes()
    if len(raw) < 28:
        raise ValueError(f"{path}: shorter than the 28-byte llama2.c header")
    h = struct.unpack("<7i", raw[:28])
    if h[5] < 0:
        raise ValueError(f"{path}: unshared classifier weights are not supported")
    dim, hid, n_layers, n_heads, n_kv, vocab, seq = h
    if min(h) <= 0 or dim % n_heads or n_heads % n_kv or (dim // n_heads) % 2:
        raise ValueError(f"{path}: implausible llama2.c header {list(h)} (expected positive "
                         "sizes, dim a multiple of n_heads, n_heads of n_kv_heads, even head_dim)")
    c = Config(*h)
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    w, at = {}, 0
    for name, shape in shapes(c):
        n = int(np.prod(shape))
        if at + n > data.size:
            raise ValueError(f"{path}: truncated weights at {name} (expected {list(shape)})")
        w[name] = data[at:at + n].reshape(shape)
        at += n
    return c, w


class Tokenizer:
    """tok512.bin: int32 max_token_length, then per token float32 score, int32 length, bytes.
    Encoding: BOS, a dummy-prefix space, code points (byte fallback +3), then merges of the
    best-scoring adjacent pair (llama2.c)."""

    def __init__(self, path: str, vocab_size: int) -> None:
        raw = Path(path).read_bytes()
        off = 4
        self.vocab: List[bytes] = []
        self.scores: List[float] = []
        for _ in range(vocab_size):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            self.vocab.append(raw[off:off + n])
            self.scores.append(score)
            off += n
        self.index = {t: i for i, t in reversed(list(enumerate(self.vocab)))}

    def encode(self, text: str) -> List[int]:
        if not text:
            return [1]
        ids: List[int] = []
        for ch in " " + text:
            b = ch.encode()
            if b in self.index:
                ids.append(self.index[b])
            else:
                ids.extend(x + 3 for x in b)  # byte fallback
        while True:
            best, best_id, best_at = -1e10, -1, -1
            for i in range(len(ids) - 1):
                j = self.index.get(self.vocab[ids[i]] + self.vocab[ids[i + 1]])
                if j is not None and self.scores[j] > best:
                    best, best_id, best_at = self.scores[j], j, i
            if best_at < 0:
                break
            ids[best_at:best_at + 2] = [best_id]
        return [1] + ids

    def piece(self, prev: int, token: int) -> bytes:
        p = self.vocab[token]
        if prev == 1 and p.startswith(b" "):
            p = p[1:]
        if len(p) == 6 and p.startswith(b"<0x") and p.endswith(b">"):
            return bytes([int(p[3:5], 16)])
        return p
