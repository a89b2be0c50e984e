"""The FSQ codec (docs/fsq.md): codec file I/O and the differentiable rebuild of K/V.

Codec file: safetensors, metadata kvcd.codec = "fsq", version = "1", num_layers,
residual_width, latent_width, num_kv_heads, head_dim, key_norm (none | rms), source;
per layer F32 tensors encoder [G, C], encoder_bias [G], decoder_k / decoder_v [Hkv*d, G],
bias_k / bias_v [Hkv*d], key_norm [d] (iff key_norm = rms).
"""
import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

H, DELTA = 7.5075, 0.5
TENSORS = ("encoder", "encoder_bias", "decoder_k", "decoder_v", "bias_k", "bias_v")
META = ("num_layers", "residual_width", "latent_width", "num_kv_heads", "head_dim")


def read_codec(path):
    """Returns (metadata dict, list of per-layer dicts of numpy F32 arrays); checks the
    metadata, every tensor's presence, shape, dtype and finiteness, naming the first wrong."""
    with safe_open(path, framework="numpy") as f:
        meta = dict(f.metadata() or {})
    if meta.get("kvcd.codec") != "fsq" or meta.get("version") != "1":
        raise ValueError(f"{path}: not an FSQ codec file (kvcd.codec = fsq, version = 1)")
    for k in META:
        if not meta.get(k, "").isdigit() or int(meta[k]) <= 0:
            raise ValueError(f"{path}: metadata {k}: expected a positive integer, got "
                             f"{meta.get(k)!r}")
    if meta.get("key_norm") not in ("none", "rms"):
        raise ValueError(f"{path}: metadata key_norm: expected none or rms, got "
                         f"{meta.get('key_norm')!r}")
    t = load_file(path)
    L, C, G = int(meta["num_layers"]), int(meta["residual_width"]), int(meta["latent_width"])
    d = int(meta["head_dim"])
    kv = int(meta["num_kv_heads"]) * d
    shapes = {"encoder": (G, C), "encoder_bias": (G,), "decoder_k": (kv, G),
              "decoder_v": (kv, G), "bias_k": (kv,), "bias_v": (kv,)}
    if meta["key_norm"] == "rms":
        shapes["key_norm"] = (d,)
    layers = []
    for l in range(L):
        layer = {}
        for name, shape in shapes.items():
            a = t.get(f"layers.{l}.{name}")
            if a is None or a.shape != shape or a.dtype != np.float32:
                raise ValueError(f"{path}: tensor layers.{l}.{name} missing or not F32 {list(shape)}")
            if not np.all(np.isfinite(a)):
                raise ValueError(f"{path}: tensor layers.{l}.{name} has a NaN or Inf")
            layer[name] = a
        layers.append(layer)
    return meta, layers


def write_codec(path, meta, layers, source):
    """Writes `layers` (per-layer dicts; key_norm present iff the codec has a key norm)."""
    rms = "key_norm" in layers[0]
    tensors = {}
    for l, layer in enumerate(layers):
        for name in TENSORS + (("key_norm",) if rms else ()):
            a = np.ascontiguousarray(np.asarray(layer[name], np.float32))
            if not np.all(np.isfinite(a)):
                raise ValueError(f"layers.{l}.{name} has a NaN or Inf: not writing {path}")
            tensors[f"layers.{l}.{name}"] = a
    m = {k: str(meta[k]) for k in META}
    m.update({"kvcd.codec": "fsq", "version": "1", "key_norm": "rms" if rms else "none",
              "source": source})
    save_file(tensors, path, metadata=m)


def check_codec_matches(meta, c, path):
    """The codec's geometry and key norm against the model's (model.Config)."""
    want = {"num_layers": c.n_layers, "residual_width": c.dim, "num_kv_heads": c.n_kv_heads,
            "head_dim": c.head_dim}
    for k, v in want.items():
        if int(meta[k]) != v:
            raise ValueError(f"{path}: metadata {k} = {meta[k]}, the model has {v}")
    norm = "rms" if c.qk_norm else "none"
    if meta["key_norm"] != norm:
        raise ValueError(f"{path}: key_norm = {meta['key_norm']}, the model's is {norm}")


def fsq_code(u):
    """z = clamp(round_half_even(h tanh(u + atanh(δ/h)) − δ), −8, 7), with a straight-through
    gradient (d z / d ũ = 1)."""
    ut = H * jnp.tanh(u + np.arctanh(DELTA / H)) - DELTA
    z = jnp.clip(jnp.round(ut), -8.0, 7.0)
    return ut + jax.lax.stop_gradient(z - ut)


def make_history(c, layers):
    """The forward pass's history function for codec parameters `layers` (per-layer dicts
    of arrays) of model config `c`: every token's code from its residual, K rebuilt
    (k = RoPE(N_k(W_k z + b_k))) and V (W_v z + b_v)."""
    import model

    def history(l, xb, tables):
        p = layers[l]
        z = fsq_code(xb @ p["encoder"].T + p["encoder_bias"])
        k = z @ p["decoder_k"].T + p["bias_k"]
        if "key_norm" in p:
            k = model.head_norm(c, k, p["key_norm"])
        k = model.rope(c, k, tables)
        v = z @ p["decoder_v"].T + p["bias_v"]
        return k, v

    return history
