"""The model of tools/fsq_finetune/model.py for accelerators: batched sequences, one
`lax.scan` over the layers (one compiled layer body, whatever the depth), rematerialized
in the backward pass, and FSQ codec parameters stacked per layer and padded to one latent
width, so that codecs of several widths train in one compiled step.

Same math as model.forward (the unit tests compare them): the teacher is the model with
exact K/V; a student's history K/V (positions >= sink and older than the recent window)
are rebuilt from the FSQ codes of its own normalized residuals (fsq.fsq_code).

Padding. A codec of width G < Gmax is stored with encoder rows, encoder biases and decoder
columns G..Gmax-1 set to 0: those coordinates encode u = 0, whose code is exactly 0
(h·tanh(atanh(δ/h)) − δ rounds to 0), and their zero decoder columns add nothing, so the
padded codec computes exactly the unpadded one. The trainer keeps the padding at 0
(`latent_mask`).

Also: sampling continuations with a K/V cache (the model's own text for training).
"""
import jax
import jax.numpy as jnp
import numpy as np

import fsq
import model

CODEC = ("encoder", "encoder_bias", "decoder_k", "decoder_v", "bias_k", "bias_v")


# --- codecs -------------------------------------------------------------------------------


def stack_codec(layers, gmax):
    """Per-layer codec dicts (fsq.read_codec) -> dict of arrays stacked over layers [L, ...],
    the latent width padded with zeros to gmax."""
    g = layers[0]["encoder"].shape[0]
    if g > gmax:
        raise ValueError(f"latent width {g} > the padded width {gmax}")
    pad = gmax - g
    out = {}
    for name in CODEC + (("key_norm",) if "key_norm" in layers[0] else ()):
        a = np.stack([np.asarray(layer[name], np.float32) for layer in layers])
        if name in ("encoder", "encoder_bias"):
            a = np.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        elif name in ("decoder_k", "decoder_v"):
            a = np.pad(a, [(0, 0), (0, 0), (0, pad)])
        out[name] = a
    return out


def unstack_codec(stacked, g):
    """The inverse of stack_codec: per-layer dicts of numpy F32 arrays of latent width g."""
    s = {k: np.asarray(v, np.float32) for k, v in stacked.items()}
    L = s["encoder"].shape[0]
    layers = []
    for l in range(L):
        layer = {}
        for name, a in s.items():
            a = a[l]
            if name in ("encoder", "encoder_bias"):
                a = a[:g]
            elif name in ("decoder_k", "decoder_v"):
                a = a[:, :g]
            layer[name] = np.ascontiguousarray(a)
        layers.append(layer)
    return layers


def latent_mask(stacked, g):
    """1 where a parameter belongs to the first g latent coordinates (or has no latent
    axis), 0 on the padding: multiplies the updates so the padding stays 0."""
    gmax = stacked["encoder"].shape[1]
    keep = (np.arange(gmax) < g).astype(np.float32)
    out = {}
    for name, a in stacked.items():
        if name == "encoder":
            m = np.broadcast_to(keep[None, :, None], a.shape)
        elif name == "encoder_bias":
            m = np.broadcast_to(keep[None, :], a.shape)
        elif name in ("decoder_k", "decoder_v"):
            m = np.broadcast_to(keep[None, None, :], a.shape)
        else:
            m = np.ones(a.shape, np.float32)
        out[name] = np.ascontiguousarray(m, np.float32)
    return out


# --- the forward pass ---------------------------------------------------------------------


def layer_weights(w):
    """The per-layer weights of model.load, stacked over the first axis (for lax.scan)."""
    keys = ("rms_att", "wq", "wk", "wv", "wo", "rms_ffn", "w1", "w3", "w2", "q_norm", "k_norm")
    return {k: w[k] for k in keys if k in w}


def _rope(c, x, cos, sin):
    """x [B, T, heads, d]; cos / sin [T, d/2]."""
    hd = c.head_dim
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    if c.pairing == "half":
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)


def _norm(x, w, eps):
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def _block(c, lw, x, cos, sin, codec, hist, causal):
    """One layer on x [B, T, C]. codec: None or this layer's (padded) codec parameters."""
    B, T, _ = x.shape
    hd, kvh, g = c.head_dim, c.n_kv_heads, c.n_heads // c.n_kv_heads
    xb = _norm(x, lw["rms_att"], c.rms_eps)
    q = (xb @ lw["wq"].T).reshape(B, T, c.n_heads, hd)
    k = (xb @ lw["wk"].T).reshape(B, T, kvh, hd)
    v = (xb @ lw["wv"].T).reshape(B, T, kvh, hd)
    if c.qk_norm:
        q, k = _norm(q, lw["q_norm"], c.rms_eps), _norm(k, lw["k_norm"], c.rms_eps)
    q = _rope(c, q, cos, sin).reshape(B, T, kvh, g, hd)
    k = _rope(c, k, cos, sin)
    scale = 1.0 / np.sqrt(float(hd))
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k) * scale
    if codec is not None:
        z = fsq.fsq_code(xb @ codec["encoder"].T + codec["encoder_bias"])
        kh = (z @ codec["decoder_k"].T + codec["bias_k"]).reshape(B, T, kvh, hd)
        if "key_norm" in codec:
            kh = _norm(kh, codec["key_norm"], c.rms_eps)
        kh = _rope(c, kh, cos, sin)
        vh = (z @ codec["decoder_v"].T + codec["bias_v"]).reshape(B, T, kvh, hd)
        sh = jnp.einsum("btkgd,bskd->bkgts", q, kh) * scale
        scores = jnp.where(hist, sh, scores)
    scores = jnp.where(causal, scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    if codec is None:
        o = jnp.einsum("bkgts,bskd->btkgd", p, v)
    else:
        ph = jnp.where(hist, p, 0.0)
        o = jnp.einsum("bkgts,bskd->btkgd", p - ph, v) + jnp.einsum("bkgts,bskd->btkgd", ph, vh)
    x = x + o.reshape(B, T, c.q_dim) @ lw["wo"].T
    xb = _norm(x, lw["rms_ffn"], c.rms_eps)
    h1 = xb @ lw["w1"].T
    return x + (jax.nn.silu(h1) * (xb @ lw["w3"].T)) @ lw["w2"].T


def forward(c, w, tokens, codec=None, sink=4, recent=8, remat=False):
    """Logits [B, T, V] of tokens [B, T] (each row from position 0), teacher-forced.
    codec: None (exact attention) or stacked codec parameters [L, ...] (stack_codec)."""
    T = tokens.shape[1]
    cos, sin = (jnp.asarray(t) for t in model.rope_tables(c, T))
    pos = jnp.arange(T)
    causal = pos[None, :] <= pos[:, None]
    hist = (pos[None, :] >= sink) & (pos[:, None] - pos[None, :] >= recent) & causal

    def body(x, per_layer):
        lw, cl = per_layer
        return _block(c, lw, x, cos, sin, cl, hist, causal), None

    if remat:
        body = jax.checkpoint(body)
    x, _ = jax.lax.scan(body, w["emb"][tokens], (layer_weights(w), codec))
    return _norm(x, w["rms_final"], c.rms_eps) @ w.get("lm_head", w["emb"]).T


# --- sampling with a K/V cache ------------------------------------------------------------


def sample(c, w, prompt, steps, key, temperature=1.0):
    """Continuations of prompt [B, P] (int32, all rows the same length) to `steps`
    positions, sampled at `temperature` (0: greedy) from the FP32 model with exact
    attention, one token at a time with a K/V cache. Returns [B, steps] int32."""
    B, P = prompt.shape
    hd, kvh, g = c.head_dim, c.n_kv_heads, c.n_heads // c.n_kv_heads
    cos_all, sin_all = (jnp.asarray(t) for t in model.rope_tables(c, steps))
    lw_all = layer_weights(w)
    cache_k = jnp.zeros((c.n_layers, B, steps, kvh, hd), jnp.float32)
    cache_v = jnp.zeros_like(cache_k)
    out = jnp.zeros((B, steps), jnp.int32).at[:, :P].set(prompt)
    scale = 1.0 / np.sqrt(float(hd))

    def step(carry, t):
        out, ck, cv, key = carry
        tok = out[:, t]
        cos, sin = cos_all[t][None], sin_all[t][None]
        valid = jnp.arange(steps) <= t

        def layer(x, per_layer):
            lw, k_l, v_l = per_layer
            xb = _norm(x, lw["rms_att"], c.rms_eps)
            q = (xb @ lw["wq"].T).reshape(B, 1, c.n_heads, hd)
            k = (xb @ lw["wk"].T).reshape(B, 1, kvh, hd)
            v = (xb @ lw["wv"].T).reshape(B, 1, kvh, hd)
            if c.qk_norm:
                q, k = _norm(q, lw["q_norm"], c.rms_eps), _norm(k, lw["k_norm"], c.rms_eps)
            q = _rope(c, q, cos, sin).reshape(B, kvh, g, hd)
            k = _rope(c, k, cos, sin)
            k_l = jax.lax.dynamic_update_slice(k_l, k, (0, t, 0, 0))
            v_l = jax.lax.dynamic_update_slice(v_l, v, (0, t, 0, 0))
            s = jnp.einsum("bkgd,bskd->bkgs", q, k_l) * scale
            s = jnp.where(valid, s, -jnp.inf)
            o = jnp.einsum("bkgs,bskd->bkgd", jax.nn.softmax(s, axis=-1), v_l)
            x = x + o.reshape(B, c.q_dim) @ lw["wo"].T
            xf = _norm(x, lw["rms_ffn"], c.rms_eps)
            h1 = xf @ lw["w1"].T
            x = x + (jax.nn.silu(h1) * (xf @ lw["w3"].T)) @ lw["w2"].T
            return x, (k_l, v_l)

        x, (ck, cv) = jax.lax.scan(layer, w["emb"][tok], (lw_all, ck, cv))
        logits = _norm(x, w["rms_final"], c.rms_eps) @ w.get("lm_head", w["emb"]).T
        key, sub = jax.random.split(key)
        if temperature > 0:
            nxt = jax.random.categorical(sub, logits / temperature, axis=-1).astype(jnp.int32)
        else:
            nxt = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        nxt = jnp.where(t + 1 < P, out[:, t + 1], nxt)  # inside the prompt: keep its token
        return (out.at[:, t + 1].set(nxt), ck, cv, key), None

    (out, _, _, _), _ = jax.lax.scan(step, (out, cache_k, cache_v, key), jnp.arange(steps - 1))
    return out
