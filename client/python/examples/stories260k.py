#!/usr/bin/env python3
"""stories260K with its attention served by kvcd (the Python twin of kvcd_stories).

Runs a llama2.c checkpoint's own layers in numpy (embedding, RMSNorm, QKV projections,
RoPE, SwiGLU FFN, classifier) and, for attention, does what a decode worker does with
kvcd: ``put`` the prompt's K/V, ``open_sequence`` (which appends the uncached tail), then
per step and per layer a fused append + attention on one ``DecodeSession``, using the
returned output in the residual stream. The same model with local FP32 attention is the
reference. With BF16 history, greedy decoding from BOS for 100 steps reproduces the data
README's check value ("Once upon a time, there was a little girl named Lily. ...").

    python examples/stories260k.py --target HOST:PORT \\
        --checkpoint ../shared/data/stories260K/stories260K.bin \\
        --tokenizer ../shared/data/stories260K/tok512.bin

Prints the reference text, the served text, the KL divergence between the two next-token
distributions (teacher-forced on the reference tokens, as kvcd_stories does), the first
step whose greedy token differs, and whether the served text equals the reference.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np

import kvcd

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama2c  # noqa: E402  (the shared llama2.c checkpoint and tokenizer reader)

Config = llama2c.Config


# attend(layer, pos, q [n_heads, hd], k [n_kv_heads, hd], v [n_kv_heads, hd]) -> o [n_heads, hd]
AttentionFn = Callable[[int, int, np.ndarray, np.ndarray, np.ndarray], np.ndarray]


class Model:
    """A llama2.c legacy checkpoint (examples/llama2c.py reads it), run in float32."""

    def __init__(self, path: str) -> None:
        self.c, w = llama2c.read_checkpoint(path)
        c, d = self.c, self.c.dim
        self.emb, self.rms_att, self.rms_ffn, self.rms_final = (
            w["emb"], w["rms_att"], w["rms_ffn"], w["rms_final"])
        self.wq, self.wk, self.wv, self.wo = w["wq"], w["wk"], w["wv"], w["wo"]
        self.w1, self.w2, self.w3 = w["w1"], w["w2"], w["w3"]
        hd = c.head_dim
        # RoPE on adjacent pairs (2i, 2i+1) of each head, angle pos * 10000^(-(2i mod hd)/hd)
        self._freq = np.power(np.float32(10000.0),
                              -(np.arange(0, d, 2) % hd).astype(np.float32) / np.float32(hd))

    @staticmethod
    def _rmsnorm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
        ss = float(np.dot(x.astype(np.float64), x.astype(np.float64))) / x.size
        return (w * (x * np.float32(1.0 / np.sqrt(np.float32(ss) + np.float32(1e-5))))).astype(
            np.float32)

    def _rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        n = x.size
        a = np.float32(pos) * self._freq[: n // 2]
        c, s = np.cos(a), np.sin(a)
        x0, x1 = x[0::2], x[1::2]
        out = np.empty_like(x)
        out[0::2] = x0 * c - x1 * s
        out[1::2] = x0 * s + x1 * c
        return out

    def forward(self, token: int, pos: int, attend: AttentionFn) -> np.ndarray:
        """One step of ``token`` at ``pos``; returns the next-token logits [vocab]."""
        c = self.c
        x = self.emb[token].copy()
        for l in range(c.n_layers):
            xb = self._rmsnorm(x, self.rms_att[l])
            q = self._rope(self.wq[l] @ xb, pos)
            k = self._rope(self.wk[l] @ xb, pos)
            v = self.wv[l] @ xb
            o = attend(l, pos, q.reshape(c.n_heads, c.head_dim),
                       k.reshape(c.n_kv_heads, c.head_dim), v.reshape(c.n_kv_heads, c.head_dim))
            x = x + self.wo[l] @ np.asarray(o, np.float32).reshape(c.dim)
            xb = self._rmsnorm(x, self.rms_ffn[l])
            h1 = self.w1[l] @ xb
            h3 = self.w3[l] @ xb
            x = x + self.w2[l] @ (h1 / (np.float32(1) + np.exp(-h1)) * h3)  # SwiGLU
        return self.emb @ self._rmsnorm(x, self.rms_final)  # shared classifier


class LocalAttention:
    """FP32 attention over a local KV cache: the reference, and the prefill worker's K/V."""

    def __init__(self, c: Config) -> None:
        self.c = c
        self.k: List[List[np.ndarray]] = [[] for _ in range(c.n_layers)]
        self.v: List[List[np.ndarray]] = [[] for _ in range(c.n_layers)]

    def __call__(self, layer, pos, q, k, v):
        if len(self.k[layer]) != pos:
            raise ValueError("positions must arrive in order")
        self.k[layer].append(k)
        self.v[layer].append(v)
        K = np.stack(self.k[layer])  # [n, Hkv, hd]
        V = np.stack(self.v[layer])
        g = self.c.n_heads // self.c.n_kv_heads
        Kq = np.repeat(K, g, axis=1)  # query head h reads KV head h // g
        Vq = np.repeat(V, g, axis=1)
        s = np.einsum("hd,nhd->hn", q, Kq) / np.float32(np.sqrt(self.c.head_dim))
        p = np.exp(s - s.max(axis=1, keepdims=True))
        return np.einsum("hn,nhd->hd", p, Vq) / p.sum(axis=1, keepdims=True)

    def kv(self, begin: int, end: int) -> Tuple[np.ndarray, np.ndarray]:
        """K/V of positions [begin, end) as [n_layers, n, n_kv_heads, head_dim]."""
        return (np.stack([np.stack(self.k[l][begin:end]) for l in range(self.c.n_layers)]),
                np.stack([np.stack(self.v[l][begin:end]) for l in range(self.c.n_layers)]))


Tokenizer = llama2c.Tokenizer


@dataclass
class Run:
    tokens: List[int]
    logits: List[np.ndarray]
    text: str
    seconds: float


def run_reference(model: Model, tok: Tokenizer, prompt: List[int], steps: int) -> Run:
    """Greedy generation with local FP32 attention (positions 0 .. steps-1)."""
    attn = LocalAttention(model.c)
    out, logits, text = [], [], b""
    token = prompt[0]
    t0 = time.perf_counter()
    for pos in range(steps):
        lg = model.forward(token, pos, attn)
        nxt = prompt[pos + 1] if pos + 1 < len(prompt) else int(np.argmax(lg))
        text += tok.piece(token, nxt)
        logits.append(lg)
        out.append(nxt)
        token = nxt
    return Run(out, logits, text.decode(errors="replace"), time.perf_counter() - t0)


def register(client: kvcd.Client, c: Config, name: str, history: str = "bf16") -> None:
    """The model geometry on kvcd: page 4, sink 4, recent 8 (as kvcd_stories), so most of
    a 100-token run lives in the history."""
    client.register_model(name=name, num_layers=c.n_layers, num_q_heads=c.n_heads,
                          num_kv_heads=c.n_kv_heads, head_dim=c.head_dim, page_size=4,
                          sink_tokens=4, recent_tokens=8, history_format=history,
                          rope={"theta": 10000}, memory_bytes=4 << 20, bf16_fraction=0.5,
                          codec="" if history == "bf16" else "hadamard")


def run_served(client: kvcd.Client, model: Model, tok: Tokenizer, name: str,
               prompt: List[int], steps: int, teacher: Optional[List[int]] = None) -> Run:
    """The same generation with attention served by kvcd model ``name``. With ``teacher``
    (the reference's tokens) the step inputs follow those tokens instead of the greedy
    choice, so the next-token distributions can be compared step by step (KL)."""
    c = model.c
    prefill = len(prompt) - 1
    # Prefill worker: K/V of prompt[:-1] computed locally and cached in kvcd.
    pre = LocalAttention(c)
    for pos in range(prefill):
        model.forward(prompt[pos], pos, pre)
    k = v = None
    if prefill > 0:
        k, v = pre.kv(0, prefill)
        client.put(name, prompt[:prefill], k, v)  # a trailing partial page is not stored
    out, logits, text = [], [], b""
    for pos in range(prefill):
        text += tok.piece(prompt[pos], prompt[pos + 1])
    token = prompt[prefill]
    t0 = time.perf_counter()
    # open_sequence appends the K/V of the tokens the cache did not hold.
    with client.open_sequence(name, prompt[:prefill], k=k, v=v) as seq, \
            client.decode_session() as session:

        def attend(layer, pos, q, k1, v1):
            o, _ = session.attend(layer, seq, q[None], k_new=k1[None], v_new=v1[None],
                                  new_tokens=[token])
            return o[0]

        for pos in range(prefill, steps):
            lg = model.forward(token, pos, attend)
            nxt = prompt[pos + 1] if pos + 1 < len(prompt) else int(np.argmax(lg))
            if teacher is not None and pos < len(teacher):
                nxt = teacher[pos]
            text += tok.piece(token, nxt)
            logits.append(lg)
            out.append(nxt)
            token = nxt
    return Run(out, logits, text.decode(errors="replace"), time.perf_counter() - t0)


def kl_divergence(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """KL(softmax(p) || softmax(q)), natural log."""
    def log_softmax(x):
        x = x.astype(np.float64)
        m = x.max()
        return x - m - np.log(np.exp(x - m).sum())

    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return float((np.exp(lp) * (lp - lq)).sum())


def check_value(readme: str) -> str:
    """The "> " lines after "## Check value" in the data README, spaces collapsed."""
    lines, section = [], False
    for line in Path(readme).read_text().splitlines():
        if line.startswith("## "):
            section = line == "## Check value"
        elif section and line.startswith("> "):
            lines.append(line[2:])
    return collapse(" ".join(lines))


def collapse(s: str) -> str:
    return " ".join(s.split())


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="127.0.0.1:50051")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompt", default="")
    ap.add_argument("--history", default="bf16", choices=["bf16", "int2-oscar"],
                    help="history format; int2-oscar uses Hadamard rotations (no calibration)")
    ap.add_argument("--name", default=None, help="model name on kvcd (default stories260k-py-<history>)")
    args = ap.parse_args(argv)
    model = Model(args.checkpoint)
    tok = Tokenizer(args.tokenizer, model.c.vocab_size)
    c = model.c
    steps = min(args.steps, c.seq_len)
    prompt = tok.encode(args.prompt)
    print(f"model: dim {c.dim}, {c.n_layers} layers, {c.n_heads} q / {c.n_kv_heads} kv heads, "
          f"head_dim {c.head_dim}, vocab {c.vocab_size}")
    ref = run_reference(model, tok, prompt, steps)
    print(f"\n[reference, FP32 attention, {steps / ref.seconds:.1f} tokens/s]\n{ref.text}")
    name = args.name or f"stories260k-py-{args.history}"
    with kvcd.Client(args.target) as client:
        register(client, c, name, args.history)
        served = run_served(client, model, tok, name, prompt, steps)
        forced = run_served(client, model, tok, name, prompt, steps, teacher=ref.tokens)
    first = len(prompt) - 1
    kls = [kl_divergence(ref.logits[first + i], lg) for i, lg in enumerate(forced.logits)]
    differs = [first + i for i, lg in enumerate(forced.logits)
               if int(np.argmax(lg)) != int(np.argmax(ref.logits[first + i]))]
    print(f"\n[{args.history} history served by kvcd, "
          f"{len(served.logits) / served.seconds:.1f} tokens/s]\n{served.text}")
    same = collapse(served.text) == collapse(ref.text)
    print(f"\nteacher-forced on the reference tokens: KL(FP32 || served) max {max(kls):.3g}, "
          f"mean {np.mean(kls):.3g}; first greedy token that differs: "
          f"{differs[0] if differs else 'never'}")
    print(f"served text {'equals' if same else 'differs from'} the reference")
    return 0 if same or args.history != "bf16" else 1


if __name__ == "__main__":
    sys.exit(main())
