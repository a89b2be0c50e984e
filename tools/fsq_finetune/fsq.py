"""The FSQ codec (docs/fsq.md): codec file I/O and the differentiable rebuild of K/V.

Codec file: safetensors, metadata kvcd.codec = "fsq", version = "1", num_layers,
residual_width, latent_width, num_kv_heads, head_dim, key_norm (none | rms), source;
per layer F32 tensors encoder [G, C], encoder_bias [G], decoder_k / decoder_v [Hkv*d, G],
bias_k / bias_v [Hkv*d], key_norm [d] (iff key_norm = rms).
"""
import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file
from safetensors import safe_open

H, DELTA = 7.5075, 0.5
TENSORS = ("encoder", "encoder_bias", "decoder_k", "decoder_v", "bias_k", "bias_v")


def read_codec(path):
    """Returns (metadata dict, list of per-layer dicts of numpy F32 arrays); checks shapes."""
    with safe_open(path, framework="numpy") as f:
        meta = dict(f.metadata() or {})
    if meta.get("kvcd.codec") != "fsq" or meta.get("version") != "1":
        raise ValueError(f"{path}: not an FSQ codec file (kvcd.codec = fsq, version = 1)")
    t = load_file(path)
    L, C, G = int(meta["num_layers"]), int(meta["residual_width"]), int(meta["latent_width"])
    kv = int(meta["num_kv_heads"]) * int(meta["head_dim"])
    shapes = {"encoder": (G, C), "encoder_bias": (G,), "decoder_k": (kv, G),
              "decoder_v": (kv, G), "bias_k": (kv,), "bias_v": (kv,)}
    if meta.get("key_norm") != "none":
        raise ValueError(f"{path}: key_norm {meta.get('key_norm')!r}: this tool supports models "
                         "without a key norm (llama2.c)")
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
    tensors = {}
    for l, layer in enumerate(layers):
        for name in TENSORS:
            tensors[f"layers.{l}.{name}"] = np.ascontiguousarray(np.asarray(layer[name], np.float32))
    m = {k: meta[k] for k in ("num_layers", "residual_width", "latent_width", "num_kv_heads",
                              "head_dim")}
    m.update({"kvcd.codec": "fsq", "version": "1", "key_norm": "none", "source": source})
    save_file(tensors, path, metadata=m)


def fsq_code(u):
    """z = clamp(round_half_even(h tanh(u + atanh(δ/h)) − δ), −8, 7), with a straight-through
    gradient (d z / d ũ = 1)."""
    ut = H * jnp.tanh(u + np.arctanh(DELTA / H)) - DELTA
    z = jnp.clip(jnp.round(ut), -8.0, 7.0)
    return ut + jax.lax.stop_gradient(z - ut)


def make_history(layers, head_dim):
    """The forward pass's history function for codec parameters `layers` (per-layer dicts
    of arrays): every token's code from its residual, K rebuilt and rotated to its position."""
    from llama2 import rope

    def history(l, xb, pos):
        p = layers[l]
        z = fsq_code(xb @ p["encoder"].T + p["encoder_bias"])
        k = rope(z @ p["decoder_k"].T + p["bias_k"], head_dim, pos)
        v = z @ p["decoder_v"].T + p["bias_v"]
        return k, v

    return history
