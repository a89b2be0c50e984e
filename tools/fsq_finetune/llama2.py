"""A llama2.c-format model (e.g. stories260K) in JAX: checkpoint, tokenizer, forward pass.

The same model as client/examples/llama2.cc (legacy llama2.c checkpoint: a header of 7
int32 — dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len — then F32
weights; shared classifier; RMSNorm eps 1e-5; RoPE on adjacent pairs (2i, 2i+1) of each
head with frequency 10000^(-2i/head_dim); SwiGLU feed-forward). The forward pass runs a
whole sequence at once (causal attention) and can replace the history part of every
layer's K/V by the FSQ codec's rebuild (tools/fsq_finetune/fsq.py).
"""
from dataclasses import dataclass

import jax.numpy as jnp
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
    def head_dim(self):
        return self.dim // self.n_heads

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_dim


def load_checkpoint(path):
    """Returns (Config, dict of F32 weight arrays)."""
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:28], dtype=np.int32)
    dim, hid, n_layers, n_heads, n_kv, vocab, seq = (int(v) for v in header)
    if vocab < 0:
        raise ValueError(f"{path}: unshared classifier weights are not supported")
    if min(dim, hid, n_layers, n_heads, n_kv, vocab, seq) <= 0 or dim % n_heads or n_heads % n_kv:
        raise ValueError(f"{path}: implausible llama2.c header {header.tolist()}")
    c = Config(dim, hid, n_layers, n_heads, n_kv, vocab, seq)
    data = np.frombuffer(raw[28:], dtype=np.float32)
    L, kv = n_layers, c.kv_dim
    shapes = [("emb", (vocab, dim)), ("rms_att", (L, dim)), ("wq", (L, dim, dim)),
              ("wk", (L, kv, dim)), ("wv", (L, kv, dim)), ("wo", (L, dim, dim)),
              ("rms_ffn", (L, dim)), ("w1", (L, hid, dim)), ("w2", (L, dim, hid)),
              ("w3", (L, hid, dim)), ("rms_final", (dim,))]
    w, at = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        if at + n > data.size:
            raise ValueError(f"{path}: truncated weights ({name})")
        w[name] = jnp.asarray(data[at:at + n].reshape(shape))
        at += n
    return c, w


class Tokenizer:
    """llama2.c tokenizer (tok512.bin): BOS, a dummy-prefix space, code points (byte
    fallback +3), then merges of the best-scoring adjacent pair."""

    def __init__(self, path, vocab_size):
        raw = open(path, "rb").read()
        at = 4
        self.vocab, self.scores = [], []
        for _ in range(vocab_size):
            score, n = np.frombuffer(raw[at:at + 4], np.float32)[0], np.frombuffer(raw[at + 4:at + 8], np.int32)[0]
            at += 8
            self.vocab.append(raw[at:at + n])
            self.scores.append(float(score))
            at += n
        self.index = {}
        for i, v in enumerate(self.vocab):
            self.index.setdefault(v, i)

    def encode(self, text):
        tokens = [1]
        if not text:
            return tokens
        t = []
        for ch in " " + text:
            b = ch.encode("utf-8")
            if b in self.index:
                t.append(self.index[b])
            else:
                t.extend(x + 3 for x in b)
        while True:
            best, best_id, best_at = -1e10, -1, -1
            for i in range(len(t) - 1):
                j = self.index.get(self.vocab[t[i]] + self.vocab[t[i + 1]])
                if j is not None and self.scores[j] > best:
                    best, best_id, best_at = self.scores[j], j, i
            if best_at < 0:
                break
            t[best_at:best_at + 2] = [best_id]
        return tokens + t


def rms_norm(x, w, eps=1e-5):
    return w * (x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)))


def rope(x, head_dim, positions):
    """x [T, heads*head_dim]: pairs (2i, 2i+1) of each head rotated by pos * 10000^(-2i/hd)."""
    T = x.shape[0]
    xr = x.reshape(T, -1, head_dim // 2, 2)
    freq = 10000.0 ** (-jnp.arange(0, head_dim, 2, dtype=x.dtype) / head_dim)
    ang = positions[:, None].astype(x.dtype) * freq[None, :]
    c, s = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    a, b = xr[..., 0], xr[..., 1]
    return jnp.stack([a * c - b * s, a * s + b * c], axis=-1).reshape(x.shape)


def forward(c, w, tokens, history=None, sink=4, recent=8):
    """Logits [T, vocab] of a token sequence (positions 0..T-1), teacher-forced.

    history: None (exact attention, the FP32 reference) or a function
    (layer, xb [T, C], positions) -> (k [T, kv_dim] post-RoPE, v [T, kv_dim]) giving every
    token's K/V rebuilt from its FSQ code. A query at position t then sees key s through
    that rebuild iff s is in the history, sink <= s < t + 1 - recent, and the exact K/V
    elsewhere (the sink and recent windows), as the daemon stores them.
    """
    T = tokens.shape[0]
    hd, g = c.head_dim, c.n_heads // c.n_kv_heads
    pos = jnp.arange(T)
    causal = pos[None, :] <= pos[:, None]
    hist = (pos[None, :] >= sink) & (pos[:, None] - pos[None, :] >= recent) & causal
    x = w["emb"][tokens]
    for l in range(c.n_layers):
        xb = rms_norm(x, w["rms_att"][l])
        q = rope(xb @ w["wq"][l].T, hd, pos).reshape(T, c.n_heads, hd)
        k = rope(xb @ w["wk"][l].T, hd, pos).reshape(T, c.n_kv_heads, hd)
        v = (xb @ w["wv"][l].T).reshape(T, c.n_kv_heads, hd)
        k = jnp.repeat(k, g, axis=1)
        v = jnp.repeat(v, g, axis=1)
        scores = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(float(hd))
        if history is not None:
            kh, vh = history(l, xb, pos)
            kh = jnp.repeat(kh.reshape(T, c.n_kv_heads, hd), g, axis=1)
            vh = jnp.repeat(vh.reshape(T, c.n_kv_heads, hd), g, axis=1)
            sh = jnp.einsum("thd,shd->hts", q, kh) / jnp.sqrt(float(hd))
            scores = jnp.where(hist[None], sh, scores)
        scores = jnp.where(causal[None], scores, -jnp.inf)
        p = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
        p = p / jnp.sum(p, axis=-1, keepdims=True)
        if history is None:
            o = jnp.einsum("hts,shd->thd", p, v)
        else:
            ph = jnp.where(hist[None], p, 0.0)
            o = jnp.einsum("hts,shd->thd", p - ph, v) + jnp.einsum("hts,shd->thd", ph, vh)
        x = x + o.reshape(T, c.dim) @ w["wo"][l].T
        xb = rms_norm(x, w["rms_ffn"][l])
        h1 = xb @ w["w1"][l].T
        h = h1 * (1.0 / (1.0 + jnp.exp(-h1))) * (xb @ w["w3"][l].T)
        x = x + h @ w["w2"][l].T
    return rms_norm(x, w["rms_final"]) @ w["emb"].T


def greedy(c, w, prompt, steps):
    """The FP32 model's greedy continuation of `prompt` (BOS first) to `steps` positions:
    returns the token fed at each position 0..steps-1 (prompt, then argmaxes)."""
    import jax
    fwd = jax.jit(lambda w, t: forward(c, w, t))
    tokens = list(prompt)
    while len(tokens) < steps:
        padded = np.zeros(steps, np.int32)
        padded[:len(tokens)] = tokens
        logits = np.asarray(fwd(w, jnp.asarray(padded)))
        tokens.append(int(np.argmax(logits[len(tokens) - 1])))
    return np.asarray(tokens[:steps], np.int32)
