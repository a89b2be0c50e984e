"""Llama-family models in JAX for the FSQ tools: loading, the forward pass, greedy text.

Two file kinds, one model:
- a llama2.c checkpoint (e.g. stories260K.bin), read by client/python/examples/llama2c.py:
  RoPE on interleaved pairs, theta 10000, RMSNorm eps 1e-5, tied classifier, no q/k norm;
- a Hugging Face-layout safetensors file as tools/gguf_to_safetensors.py writes it (e.g.
  SmolLM2-135M; metadata kvcd.model = "llama", kvcd.dim, ... kvcd.rope_pairing,
  kvcd.tied_embeddings, kvcd.qk_norm), the same file examples/llama_model.cc reads:
  GQA, RoPE pairing half or interleaved, optional per-head q/k RMSNorm (Qwen3) applied
  before RoPE, tied or separate classifier.

The forward pass runs a whole sequence at once (causal attention) and can replace the
history part of every layer's K/V by the FSQ codec's rebuild (tools/fsq_finetune/fsq.py).
Weights are stacked per layer: emb [V, C], rms_att / rms_ffn [L, C], wq [L, Hq·d, C],
wk / wv [L, Hkv·d, C], wo [L, C, Hq·d], w1 (gate) / w3 (up) [L, F, C], w2 (down) [L, C, F],
rms_final [C], optional lm_head [V, C], q_norm / k_norm [L, d].
"""
import os
import sys
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python", "examples"))

import llama2c  # noqa: E402  (the shared llama2.c reader)


@dataclass(frozen=True)
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    pairing: str = "interleaved"  # or "half"
    tied: bool = True
    qk_norm: bool = False

    @property
    def kv_dim(self):
        return self.n_kv_heads * self.head_dim

    @property
    def q_dim(self):
        return self.n_heads * self.head_dim


def load_llama2c(path):
    """A llama2.c checkpoint: (Config, weights as jnp arrays)."""
    c2, w = llama2c.read_checkpoint(path)
    c = Config(c2.dim, c2.hidden_dim, c2.n_layers, c2.n_heads, c2.n_kv_heads, c2.head_dim,
               c2.vocab_size, c2.seq_len)
    return c, {k: jnp.asarray(v) for k, v in w.items()}


def _meta_int(meta, path, key):
    v = meta.get("kvcd." + key)
    try:
        n = int(v)
    except (TypeError, ValueError):
        n = 0
    if n <= 0:
        raise ValueError(f"{path}: metadata kvcd.{key}: expected a positive integer, got {v!r}")
    return n


def _meta_flag(meta, path, key):
    v = meta.get("kvcd." + key)
    if v not in ("0", "1"):
        raise ValueError(f"{path}: metadata kvcd.{key}: expected \"0\" or \"1\", got {v!r}")
    return v == "1"


def load_safetensors(path):
    """A Hugging Face-layout llama-family safetensors file (tools/gguf_to_safetensors.py):
    (Config, weights as jnp arrays). Checks the metadata and every tensor's shape."""
    from safetensors import safe_open

    with safe_open(path, framework="numpy") as f:
        meta = dict(f.metadata() or {})
        if meta.get("kvcd.model") != "llama":
            raise ValueError(f"{path}: metadata kvcd.model: expected \"llama\" (a file written "
                             "by tools/gguf_to_safetensors.py)")
        ints = {k: _meta_int(meta, path, k) for k in ("dim", "hidden_dim", "n_layers", "n_heads",
                                                      "n_kv_heads", "head_dim", "vocab_size",
                                                      "max_seq_len")}
        pairing = meta.get("kvcd.rope_pairing")
        if pairing not in ("half", "interleaved"):
            raise ValueError(f"{path}: metadata kvcd.rope_pairing: expected \"half\" or "
                             f"\"interleaved\", got {pairing!r}")
        try:
            theta, eps = float(meta["kvcd.rope_theta"]), float(meta["kvcd.rms_eps"])
        except (KeyError, ValueError):
            raise ValueError(f"{path}: metadata kvcd.rope_theta / kvcd.rms_eps: expected numbers")
        c = Config(ints["dim"], ints["hidden_dim"], ints["n_layers"], ints["n_heads"],
                   ints["n_kv_heads"], ints["head_dim"], ints["vocab_size"], ints["max_seq_len"],
                   theta, eps, pairing, _meta_flag(meta, path, "tied_embeddings"),
                   _meta_flag(meta, path, "qk_norm"))
        if c.head_dim % 2 or c.n_heads % c.n_kv_heads:
            raise ValueError(f"{path}: expected an even head_dim and n_heads a multiple of "
                             f"n_kv_heads, got head_dim {c.head_dim}, {c.n_heads} / "
                             f"{c.n_kv_heads} heads")
        names = set(f.keys())

        def read(name, shape):
            if name not in names:
                raise ValueError(f"{path}: tensor {name} missing (expected {list(shape)})")
            a = f.get_tensor(name)
            if tuple(a.shape) != tuple(shape):
                raise ValueError(f"{path}: tensor {name}: expected shape {list(shape)}, got "
                                 f"{list(a.shape)}")
            return np.asarray(a, np.float32)

        d, qd, kv, hid, hd = c.dim, c.q_dim, c.kv_dim, c.hidden_dim, c.head_dim
        per_layer = [("rms_att", "input_layernorm.weight", (d,)),
                     ("wq", "self_attn.q_proj.weight", (qd, d)),
                     ("wk", "self_attn.k_proj.weight", (kv, d)),
                     ("wv", "self_attn.v_proj.weight", (kv, d)),
                     ("wo", "self_attn.o_proj.weight", (d, qd)),
                     ("rms_ffn", "post_attention_layernorm.weight", (d,)),
                     ("w1", "mlp.gate_proj.weight", (hid, d)),
                     ("w3", "mlp.up_proj.weight", (hid, d)),
                     ("w2", "mlp.down_proj.weight", (d, hid))]
        if c.qk_norm:
            per_layer += [("q_norm", "self_attn.q_norm.weight", (hd,)),
                          ("k_norm", "self_attn.k_norm.weight", (hd,))]
        w = {"emb": read("model.embed_tokens.weight", (c.vocab_size, d)),
             "rms_final": read("model.norm.weight", (d,))}
        if not c.tied:
            w["lm_head"] = read("lm_head.weight", (c.vocab_size, d))
        for key, name, shape in per_layer:
            w[key] = np.stack([read(f"model.layers.{l}.{name}", shape) for l in range(c.n_layers)])
    return c, {k: jnp.asarray(v) for k, v in w.items()}


def load(path):
    """A model file of either kind (by its content: safetensors files start with an 8-byte
    header length followed by '{')."""
    with open(path, "rb") as f:
        head = f.read(9)
    if len(head) == 9 and head[8:9] == b"{":
        return load_safetensors(path)
    return load_llama2c(path)


def rms_norm(x, w, eps):
    return w * (x * (1.0 / jnp.sqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)))


def rope_tables(c, T):
    """cos, sin [T, d/2] of angle p·theta^(−2i/d), computed in float64 (as the C++ worker)."""
    i = np.arange(c.head_dim // 2, dtype=np.float64)
    ang = np.arange(T, dtype=np.float64)[:, None] * c.rope_theta ** (-2.0 * i / c.head_dim)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope(c, x, tables):
    """x [T, heads·d] rotated per position: pairs (i, i + d/2) ("half") or (2i, 2i+1)
    ("interleaved") of each head, (a, b) -> (a cos − b sin, a sin + b cos)."""
    T, hd = x.shape[0], c.head_dim
    cos, sin = (jnp.asarray(t)[:, None, :] for t in tables)
    xr = x.reshape(T, -1, hd)
    if c.pairing == "half":
        a, b = xr[..., :hd // 2], xr[..., hd // 2:]
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    a, b = xr[..., 0::2], xr[..., 1::2]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


def head_norm(c, x, w):
    """Per-head RMSNorm of x [T, heads·d] with weights w [d] (Qwen3's q_norm / k_norm)."""
    T = x.shape[0]
    return rms_norm(x.reshape(T, -1, c.head_dim), w, c.rms_eps).reshape(x.shape)


def forward(c, w, tokens, history=None, sink=4, recent=8, residuals=False):
    """Logits [T, vocab] of a token sequence (positions 0..T-1), teacher-forced.

    history: None (exact attention, the FP32 reference) or a function
    (layer, xb [T, C], tables) -> (k [T, Hkv·d] post-RoPE, v [T, Hkv·d]) giving every
    token's K/V rebuilt from its FSQ code. A query at position t then sees key s through
    that rebuild iff s is in the history, sink <= s < t + 1 - recent, and the exact K/V
    elsewhere (the sink and recent windows), as the daemon stores them.
    residuals: also return per layer (xb, q, k, v): the normalized residual [T, C] and the
    post-RoPE projections [T, heads, d] (for activation dumps).
    """
    T = tokens.shape[0]
    hd, g = c.head_dim, c.n_heads // c.n_kv_heads
    tables = rope_tables(c, T)
    pos = jnp.arange(T)
    causal = pos[None, :] <= pos[:, None]
    hist = (pos[None, :] >= sink) & (pos[:, None] - pos[None, :] >= recent) & causal
    x = w["emb"][tokens]
    acts = []
    for l in range(c.n_layers):
        xb = rms_norm(x, w["rms_att"][l], c.rms_eps)
        q, k = xb @ w["wq"][l].T, xb @ w["wk"][l].T
        if c.qk_norm:
            q, k = head_norm(c, q, w["q_norm"][l]), head_norm(c, k, w["k_norm"][l])
        q = rope(c, q, tables).reshape(T, c.n_heads, hd)
        k = rope(c, k, tables).reshape(T, c.n_kv_heads, hd)
        v = (xb @ w["wv"][l].T).reshape(T, c.n_kv_heads, hd)
        if residuals:
            acts.append((xb, q, k, v))
        k = jnp.repeat(k, g, axis=1)
        v = jnp.repeat(v, g, axis=1)
        scores = jnp.einsum("thd,shd->hts", q, k) / jnp.sqrt(float(hd))
        if history is not None:
            kh, vh = history(l, xb, tables)
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
        x = x + o.reshape(T, c.q_dim) @ w["wo"][l].T
        xb = rms_norm(x, w["rms_ffn"][l], c.rms_eps)
        h1 = xb @ w["w1"][l].T
        h = h1 * (1.0 / (1.0 + jnp.exp(-h1))) * (xb @ w["w3"][l].T)
        x = x + h @ w["w2"][l].T
    logits = rms_norm(x, w["rms_final"], c.rms_eps) @ w.get("lm_head", w["emb"]).T
    return (logits, acts) if residuals else logits


def greedy(c, w, prompts, steps):
    """The FP32 model's greedy continuations of `prompts` (token lists) to `steps` positions,
    all prompts in one batch: returns [len(prompts), steps] int32, the token fed at each
    position (the prompt, then the argmaxes)."""
    # The weights are an argument, not a constant of the traced function (XLA would fold them).
    fwd = jax.jit(jax.vmap(lambda w, t: forward(c, w, t), in_axes=(None, 0)))
    n = len(prompts)
    out = np.zeros((n, steps), np.int32)
    lens = np.asarray([len(p) for p in prompts])
    if lens.min() < 1 or lens.max() > steps:
        raise ValueError(f"prompt lengths {lens.tolist()}: expected 1..{steps} tokens")
    for i, p in enumerate(prompts):
        out[i, :len(p)] = p
    for t in range(int(lens.min()), steps):
        logits = np.asarray(fwd(w, jnp.asarray(out))[:, t - 1])
        grow = lens <= t
        out[grow, t] = np.argmax(logits[grow], -1)
    return out
