#!/usr/bin/env python3
"""Writes a GGUF llama-family model in the Hugging Face layout vLLM loads from a directory
(config.json, model.safetensors, tokenizer files, generation config), with transformers'
own GGUF reader (dequantized weights, the tokenizer and chat template from the GGUF's
metadata; needs the `gguf` package).

    python tools/gguf_to_hf.py MODEL.gguf OUT_DIR [--dtype bfloat16]

scripts/vllm-model.sh runs it on SmolLM2-135M-Instruct for the vLLM connector tests.
"""
import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", help="the .gguf file")
    ap.add_argument("out", help="output directory")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    args = ap.parse_args()
    if not os.path.isfile(args.gguf):
        print(f"gguf_to_hf: {args.gguf} is not a file", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(os.path.abspath(args.gguf))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                 dtype=getattr(torch, args.dtype))
    from safetensors.torch import save_file

    # transformers refuses save_pretrained on a model read from a GGUF; its weights are
    # already dequantized, so write them and the config (without the GGUF marker) directly.
    tmp = args.out.rstrip("/") + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state = {k: v.detach().to(getattr(torch, args.dtype)).contiguous()
             for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    config.dtype = args.dtype
    config.save_pretrained(tmp)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if os.path.isdir(args.out):
        import shutil
        shutil.rmtree(args.out)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {model.config.model_type}, {model.config.num_hidden_layers} "
          f"layers, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
