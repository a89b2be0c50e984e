#!/usr/bin/env python3
"""Write a kvcd activation dump (post-RoPE q, k, v per layer) from a Hugging Face causal LM.

User-side helper for kvcd-calibrate / kvcd-eval: it needs PyTorch, transformers and
safetensors (none of which the kvcd build or tests use). Works with Llama-, Mistral- and
Qwen-family models whose modeling module applies RoPE through `apply_rotary_pos_emb`.

  python3 tools/dump_activations.py --model Qwen/Qwen3-8B --out qwen3-8b.dump.safetensors \
      --prompts prompts.txt [--max-tokens 2048] [--dtype bfloat16]

prompts.txt holds one prompt per line; their tokens are concatenated in the dump. Layout
(docs/calibration.md): layers.<l>.q [n, Hq, d], layers.<l>.k / .v [n, Hkv, d] (F32),
metadata kvcd.dump = "1", num_layers, num_q_heads, num_kv_heads, head_dim, tokens, source.
"""
import argparse
import importlib

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prompts", required=True, help="text file, one prompt per line")
    ap.add_argument("--max-tokens", type=int, default=2048, help="per prompt")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=getattr(torch, args.dtype),
                                                 device_map="auto")
    cfg = model.config
    n_layers, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", hq)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq

    # Post-RoPE q/k: wrap the modeling module's apply_rotary_pos_emb (called once per layer,
    # in layer order). Values: a forward hook on every v_proj.
    modeling = importlib.import_module(type(model).__module__)
    original = modeling.apply_rotary_pos_emb
    qk = []

    def capture(q, k, *a, **kw):
        q2, k2 = original(q, k, *a, **kw)
        qk.append((q2.detach(), k2.detach()))  # [batch, heads, n, d]
        return q2, k2

    modeling.apply_rotary_pos_emb = capture
    vs = []
    layers = model.model.layers
    for layer in layers:
        layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: vs.append(o.detach()))

    per_layer = {l: {"q": [], "k": [], "v": []} for l in range(n_layers)}
    with open(args.prompts) as f:
        prompts = [line.strip() for line in f if line.strip()]
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids[:, : args.max_tokens].to(model.device)
        qk.clear()
        vs.clear()
        with torch.no_grad():
            model(ids)
        for l in range(n_layers):
            q, k = qk[l]
            n = q.shape[2]
            per_layer[l]["q"].append(q[0].transpose(0, 1).float().cpu())  # [n, Hq, d]
            per_layer[l]["k"].append(k[0].transpose(0, 1).float().cpu())
            per_layer[l]["v"].append(vs[l][0].view(n, hkv, d).float().cpu())
    tensors = {}
    for l in range(n_layers):
        for name in ("q", "k", "v"):
            tensors[f"layers.{l}.{name}"] = torch.cat(per_layer[l][name]).contiguous()
    tokens = tensors["layers.0.q"].shape[0]
    meta = {"kvcd.dump": "1", "num_layers": str(n_layers), "num_q_heads": str(hq),
            "num_kv_heads": str(hkv), "head_dim": str(d), "tokens": str(tokens),
            "source": f"{args.model} on {len(prompts)} prompts ({args.prompts})"}
    save_file(tensors, args.out, metadata=meta)
    print(f"wrote {args.out}: {n_layers} layers x {tokens} tokens, {hq} q / {hkv} kv heads, head_dim {d}")


if __name__ == "__main__":
    main()
