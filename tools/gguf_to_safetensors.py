#!/usr/bin/env python3
"""Convert a llama-architecture GGUF file into the kvcd-llama worker's inputs.

  gguf_to_safetensors.py MODEL.gguf OUT_DIR [--keep-gguf-rows]

writes OUT_DIR/model.safetensors (every tensor dequantized to F32, Hugging Face names,
the model geometry in the metadata under "kvcd.*") and OUT_DIR/tokenizer.txt (byte-level
BPE vocabulary as raw bytes, merges, special tokens, Unicode letter/number classes and the
chat format), both read by examples/llama_model.cc and bpe_tokenizer.cc.

RoPE layout. llama.cpp's converter permutes the rows of attn_q / attn_k of every head
from the Hugging Face order (rotation pairs (i, i + d/2), "half") into adjacent pairs
(2i, 2i + 1), "interleaved", for its pairwise RoPE. By default the permutation is undone
(Hugging Face layout, metadata kvcd.rope_pairing = "half") so that dumped q/k match what
the Hugging Face model produces; --keep-gguf-rows keeps llama.cpp's rows and records
"interleaved". The worker implements both; the two files give the same model.

Needs numpy and the PyPI `gguf` package (scripts/fetch-smollm2.sh installs them in a venv).
"""
import argparse
import json
import os
import re
import struct
import sys
import unicodedata

import numpy as np

FORMAT = "kvcd-bpe-tokenizer 1"


def gguf_rows_to_hf(w, n_head):
    """Undo llama.cpp's permute(): rows [head][d/2][2] -> [head][2][d/2]."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_rows_to_gguf(w, n_head):
    """llama.cpp's permute(): rows [head][2][d/2] -> [head][d/2][2]."""
    rows = w.shape[0]
    d = rows // n_head
    return w.reshape(n_head, 2, d // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_decoder():
    """GPT-2 byte-level alphabet: printable character -> byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def category_ranges(prefix):
    """Inclusive code point ranges whose Unicode general category starts with `prefix`."""
    out, start = [], None
    for cp in range(0x110000 + 1):
        inside = cp < 0x110000 and unicodedata.category(chr(cp)).startswith(prefix)
        if inside and start is None:
            start = cp
        elif not inside and start is not None:
            out.append((start, cp - 1))
            start = None
    return out


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def write_tokenizer(reader, path):
    model = field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        sys.exit(f"tokenizer model '{model}' is not byte-level BPE (gpt2)")
    pre = field(reader, "tokenizer.ggml.pre", "default")
    tokens = field(reader, "tokenizer.ggml.tokens")
    types = field(reader, "tokenizer.ggml.token_type")
    merges = field(reader, "tokenizer.ggml.merges")
    dec = byte_decoder()
    index = {t: i for i, t in enumerate(tokens)}
    lines = [FORMAT, f"pre {pre}", f"add_bos {int(bool(field(reader, 'tokenizer.ggml.add_bos_token', False)))}"]
    for key in ("bos", "eos", "unknown"):
        lines.append(f"{key} {int(field(reader, f'tokenizer.ggml.{key}_token_id', -1))}")
    lines.append(f"tokens {len(tokens)}")
    for t, ty in zip(tokens, types):
        if ty == 1:  # normal: byte-level characters -> raw bytes
            try:
                raw = bytes(dec[ch] for ch in t)
            except KeyError:
                sys.exit(f"token {t!r} is outside the byte-level alphabet")
            lines.append(f"n {raw.hex()}")
        else:  # control / user-defined: matched literally in text, never merged into
            lines.append(f"s {t.encode('utf-8').hex()}")
    lines.append(f"merges {len(merges)}")
    for m in merges:
        a, b = m.split(" ")
        lines.append(f"{index[a]} {index[b]} {index[a + b]}")
    for name, prefix in (("letters", "L"), ("numbers", "N")):
        ranges = category_ranges(prefix)
        lines.append(f"{name} {len(ranges)}")
        lines.extend(f"{lo:x} {hi:x}" for lo, hi in ranges)
    template = field(reader, "tokenizer.chat_template", "") or ""
    chatml = "'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>'"
    if chatml in template:
        m = re.search(r"<\|im_start\|>system\n(.*?)<\|im_end\|>", template, re.S)
        lines.append("chat chatml")
        lines.append(f"default_system {(m.group(1) if m else '').encode('utf-8').hex()}")
    else:
        lines.append("chat none")
    lines.append(f"chat_template {template.encode('utf-8').hex()}")
    lines.append("end")
    with open(path, "w", encoding="ascii") as f:
        f.write("\n".join(lines) + "\n")


HF_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", name)
    if m is None or m.group(2) not in HF_NAMES:
        sys.exit(f"unexpected tensor {name}")
    return f"model.layers.{m.group(1)}.{HF_NAMES[m.group(2)]}.weight"


def write_safetensors(path, tensors, metadata):
    header, offset = {"__metadata__": metadata}, 0
    for name, a in tensors:
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, a in tensors:
            f.write(np.ascontiguousarray(a, dtype="<f4").tobytes())
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("out_dir")
    ap.add_argument("--keep-gguf-rows", action="store_true",
                    help="keep llama.cpp's q/k row order (interleaved RoPE pairs)")
    args = ap.parse_args()
    import gguf  # noqa: E402  (only the conversion needs it, not the unit test)
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(args.gguf)
    arch = field(reader, "general.architecture")
    if arch not in ("llama", "qwen3"):
        sys.exit(f"architecture '{arch}' is not llama-family")
    n_head = int(field(reader, f"{arch}.attention.head_count"))
    n_kv = int(field(reader, f"{arch}.attention.head_count_kv", n_head))
    dim = int(field(reader, f"{arch}.embedding_length"))
    head_dim = int(field(reader, f"{arch}.attention.key_length", dim // n_head))
    names = {t.name for t in reader.tensors}
    tensors = []
    for t in reader.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape([int(x) for x in reversed(t.shape)])  # GGUF ne0 is the fastest axis
        if arch == "llama" and not args.keep_gguf_rows:
            if t.name.endswith("attn_q.weight"):
                a = gguf_rows_to_hf(a, n_head)
            elif t.name.endswith("attn_k.weight"):
                a = gguf_rows_to_hf(a, n_kv)
        tensors.append((hf_name(t.name), a))
    # llama.cpp writes Qwen-style (NeoX) models unpermuted: their rows are already "half".
    pairing = "interleaved" if (arch == "llama" and args.keep_gguf_rows) else "half"
    vocab = len(field(reader, "tokenizer.ggml.tokens"))
    metadata = {
        "kvcd.model": "llama",
        "kvcd.dim": str(dim),
        "kvcd.hidden_dim": str(int(field(reader, f"{arch}.feed_forward_length"))),
        "kvcd.n_layers": str(int(field(reader, f"{arch}.block_count"))),
        "kvcd.n_heads": str(n_head),
        "kvcd.n_kv_heads": str(n_kv),
        "kvcd.head_dim": str(head_dim),
        "kvcd.vocab_size": str(vocab),
        "kvcd.max_seq_len": str(int(field(reader, f"{arch}.context_length"))),
        "kvcd.rope_theta": repr(float(field(reader, f"{arch}.rope.freq_base", 10000.0))),
        "kvcd.rms_eps": repr(float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon"))),
        "kvcd.rope_pairing": pairing,
        "kvcd.tied_embeddings": "0" if "output.weight" in names else "1",
        "kvcd.qk_norm": "1" if any(n.endswith("attn_q_norm.weight") for n in names) else "0",
        "kvcd.source": os.path.basename(args.gguf),
    }
    os.makedirs(args.out_dir, exist_ok=True)
    write_safetensors(os.path.join(args.out_dir, "model.safetensors"), tensors, metadata)
    write_tokenizer(reader, os.path.join(args.out_dir, "tokenizer.txt"))
    print(f"wrote {args.out_dir}: {len(tensors)} tensors, rope pairing {pairing}")


if __name__ == "__main__":
    main()
