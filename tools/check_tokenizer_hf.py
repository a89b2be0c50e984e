#!/usr/bin/env python3
"""Cross-check kvcd-llama's byte-level BPE tokenizer against the Hugging Face `tokenizers`
library configured as SmolLM2's tokenizer (BPE from the GGUF vocabulary and merges, unknown
<|endoftext|>, pre-tokenizer Digits(individual_digits) + ByteLevel(regex), the GGUF's
control tokens as special tokens).

  check_tokenizer_hf.py --gguf MODEL.gguf --model DIR --kvcd-llama build/examples/kvcd-llama \
      CASES.txt [MORE.txt ...]

Every line of the files is one case (the two characters \\n stand for a newline). Prints the
cases that differ and exits 1 if any does. Needs numpy, gguf and tokenizers (pip).
"""
import argparse
import subprocess
import sys
import tempfile

import gguf
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers


def hf_tokenizer(path):
    r = gguf.GGUFReader(path)
    toks = r.fields["tokenizer.ggml.tokens"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(m.split(" ")) for m in r.fields["tokenizer.ggml.merges"].contents()]
    unk = toks[int(r.fields["tokenizer.ggml.unknown_token_id"].contents())]
    tk = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(toks)}, merges=merges, unk_token=unk))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tk.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(toks, types) if ty == 3])
    return tk


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--model", required=True, help="kvcd-llama model dir (tokenizer.txt)")
    ap.add_argument("--kvcd-llama", required=True)
    ap.add_argument("cases", nargs="+")
    args = ap.parse_args()
    lines = []
    for path in args.cases:
        with open(path, encoding="utf-8") as f:
            lines += f.read().splitlines()
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt") as tmp:
        tmp.write("\n".join(lines) + "\n")
        tmp.flush()
        out = subprocess.run([args.kvcd_llama, "--model", args.model, "--encode", tmp.name],
                             check=True, capture_output=True, text=True).stdout.splitlines()
    tk = hf_tokenizer(args.gguf)
    bad = tokens = 0
    for line, mine in zip(lines, out):
        ids = tk.encode(line.replace("\\n", "\n")).ids
        tokens += len(ids)
        if ids != [int(x) for x in mine.split()]:
            bad += 1
            print(f"differs: {line[:70]!r}\n  hf   {ids[:30]}\n  kvcd {mine.split()[:30]}")
    print(f"{len(lines) - bad} of {len(lines)} lines equal ({tokens} tokens)")
    sys.exit(1 if bad or len(out) != len(lines) else 0)


if __name__ == "__main__":
    main()
