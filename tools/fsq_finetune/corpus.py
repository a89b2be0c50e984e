#!/usr/bin/env python3
"""Training and validation text for FSQ codecs from corpora already on this machine.

  corpus.py --kvcd-llama BIN --model DIR --out DIR [--sources python,man,doc,licenses]
      [--max-chars N] [--positions 512] [--val-every 20]

Sources (all offline, all under licences that allow this use; none is the evaluation text):
  python    the Python standard library's own sources (/usr/lib/python3.*/**/*.py, without
            the test suites, site/dist-packages and generated tables): code and docstrings,
            Python Software Foundation licence;
  man       English manual pages (/usr/share/man/man[1-8]), rendered to plain text by man(1)
            with unwrapped paragraphs; each page's own licence (GPL, BSD, ...);
  doc       README / *.txt / *.md files of installed Debian packages (/usr/share/doc, no
            changelogs or copyright files);
  licenses  the licence texts in /usr/share/common-licenses.

Each file is one document. A document goes to the validation split iff a hash of its path
is 0 modulo --val-every (so the split is stable and by document, never inside one). Each
split and source is tokenized with `kvcd-llama --model DIR --encode` (the tokenizer the
daemon evaluation uses; one document per line, newlines written as the two characters
\\n, which that option turns back into newlines: a literal backslash-n in a source file
becomes a newline too), the documents' tokens are joined with a blank line between them
and cut into sequences of exactly --positions tokens. Writes OUT/train.npy and
OUT/val.npy (uint16 [n, positions]) and OUT/corpus.json
(per source and split: files, characters, tokens, sequences).
"""
import argparse
import glob
import gzip
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np

SOURCES = ("python", "man", "doc", "licenses")


def python_files():
    skip = re.compile(r"/(test|tests|idle_test|site-packages|dist-packages|__pycache__)/")
    out = []
    for root in sorted(glob.glob("/usr/lib/python3.[0-9]*")):
        for p in sorted(glob.glob(root + "/**/*.py", recursive=True)):
            if skip.search(p) or "/encodings/" in p or os.path.getsize(p) < 2000:
                continue
            out.append(p)
    return out


def read_python(p):
    return open(p, encoding="utf-8", errors="replace").read()


def man_files():
    out = []
    for sec in range(1, 9):
        for p in sorted(glob.glob(f"/usr/share/man/man{sec}/*")):
            if os.path.isfile(p) and not os.path.islink(p) and os.path.getsize(p) > 1500:
                out.append(p)
    return out


def read_man(p):
    r = subprocess.run(["man", "-l", "-E", "UTF-8", "--nh", "--nj", p], capture_output=True,
                       env=dict(os.environ, MANWIDTH="4000", MAN_KEEP_FORMATTING="0"),
                       timeout=30)
    text = r.stdout.decode("utf-8", "replace")
    text = re.sub(r".\x08", "", text)  # overstrike bold / underline
    lines = [re.sub(r" {3,}", " ", ln).strip() for ln in text.splitlines()]
    if len(lines) > 2:
        lines = lines[1:-1]  # the page's header and footer lines
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def doc_files():
    out = []
    bad = re.compile(r"(changelog|copyright|news|history|changes|authors|thanks|todo)",
                     re.IGNORECASE)
    for p in sorted(glob.glob("/usr/share/doc/**/*", recursive=True)):
        name = os.path.basename(p)
        if not os.path.isfile(p) or os.path.islink(p) or bad.search(name):
            continue
        if re.search(r"(^readme|\.txt(\.gz)?$|\.md(\.gz)?$|\.rst(\.gz)?$)", name, re.IGNORECASE):
            if os.path.getsize(p) > 800:
                out.append(p)
    return out


def read_plain(p):
    data = gzip.open(p).read() if p.endswith(".gz") else open(p, "rb").read()
    return data.decode("utf-8", "replace")


def license_files():
    return [p for p in sorted(glob.glob("/usr/share/common-licenses/*"))
            if os.path.isfile(p) and not os.path.islink(p)]


READERS = {"python": (python_files, read_python), "man": (man_files, read_man),
           "doc": (doc_files, read_plain), "licenses": (license_files, read_plain)}


def is_val(path, every):
    return int(hashlib.sha256(path.encode()).hexdigest()[:8], 16) % every == 0


def encode(kvcd_llama, model_dir, docs, tmp):
    """Token ids of each document (kvcd-llama --encode, one document per line)."""
    with open(tmp, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(d.replace("\r", "").replace("\n", "\\n") + "\n")
    r = subprocess.run([kvcd_llama, "--model", model_dir, "--encode", tmp], check=True,
                       capture_output=True, text=True)
    lines = r.stdout.splitlines()
    if len(lines) != len(docs):
        raise RuntimeError(f"kvcd-llama --encode gave {len(lines)} lines for {len(docs)} documents")
    return [[int(t) for t in ln.split()] for ln in lines]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvcd-llama", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--sources", default=",".join(SOURCES))
    ap.add_argument("--max-chars", type=int, default=3_000_000, help="per source")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--val-every", type=int, default=20)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    sep = None
    report = {"positions": args.positions, "val_every": args.val_every, "sources": {}}
    seqs = {"train": [], "val": []}
    for src in args.sources.split(","):
        if src not in READERS:
            sys.exit(f"corpus: unknown source {src!r}; expected one of {', '.join(SOURCES)}")
        files, read = READERS[src]
        paths = files()
        # A deterministic spread over the whole list (every k-th file), up to --max-chars.
        order = sorted(paths, key=lambda p: hashlib.sha256(p.encode()).hexdigest())
        split_docs = {"train": [], "val": []}
        chars = {"train": 0, "val": 0}
        for p in order:
            if chars["train"] + chars["val"] >= args.max_chars:
                break
            try:
                text = read(p).strip()
            except (OSError, subprocess.SubprocessError, EOFError) as e:
                print(f"corpus: skipped {p}: {e}", file=sys.stderr)
                continue
            if len(text) < 500:
                continue
            split = "val" if is_val(p, args.val_every) else "train"
            split_docs[split].append((p, text))
            chars[split] += len(text)
        report["sources"][src] = {}
        for split, docs in split_docs.items():
            if not docs:
                continue
            ids = encode(args.kvcd_llama, args.model, [t for _, t in docs],
                         os.path.join(args.out, f"{src}-{split}.lines"))
            os.remove(os.path.join(args.out, f"{src}-{split}.lines"))
            if sep is None:
                sep = encode(args.kvcd_llama, args.model, ["a\n\nb"],
                             os.path.join(args.out, "sep.lines"))[0][1:-1]
                os.remove(os.path.join(args.out, "sep.lines"))
            stream = []
            for d in ids:
                stream.extend(d)
                stream.extend(sep)
            n = len(stream) // args.positions
            arr = np.asarray(stream[:n * args.positions], np.uint16).reshape(n, args.positions)
            seqs[split].append(arr)
            report["sources"][src][split] = {
                "files": len(docs), "characters": chars[split], "tokens": len(stream),
                "sequences": n, "first_files": [p for p, _ in docs[:5]]}
            print(f"{src} {split}: {len(docs)} files, {chars[split]} characters, "
                  f"{len(stream)} tokens, {n} sequences", flush=True)
    for split in ("train", "val"):
        arr = np.concatenate(seqs[split]) if seqs[split] else np.zeros((0, args.positions), np.uint16)
        np.save(os.path.join(args.out, f"{split}.npy"), arr)
        report[split + "_sequences"] = int(arr.shape[0])
    report["separator_tokens"] = sep
    with open(os.path.join(args.out, "corpus.json"), "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}: {report['train_sequences']} training and "
          f"{report['val_sequences']} validation sequences of {args.positions} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
