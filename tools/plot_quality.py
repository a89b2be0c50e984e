#!/usr/bin/env python3
"""Quality against actual compression ratio, from kvcd-eval --json files.

  plot_quality.py OUT.png EVAL.json [EVAL2.json ...] [--metric kl_mean|out_rel_err]
      [--title TEXT]

One point per codec of every file (x: compression_ratio against dense BF16 K/V, windows
included, log scale; y: the metric, log scale), labelled with the codec's name; points of
the same name in several files (e.g. initialized and fine-tuned) share a marker. Run it
with the FSQ tools' environment: $(scripts/fsq-venv.sh)/bin/python tools/plot_quality.py.
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--metric", default="out_rel_err", choices=["kl_mean", "kl_p99", "out_rel_err", "logit_rel_err"])
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    fig, ax = plt.subplots(figsize=(8, 5))
    points = 0
    for path in args.inputs:
        with open(path) as f:
            data = json.load(f)
        for c in data["codecs"]:
            x, y = c["compression_ratio"], max(c[args.metric], 1e-12)
            family = c["name"].split("-")[0]
            marker = {"bf16": "s", "int2": "o", "kivi2": "^", "fsq": "D"}.get(family, "x")
            ax.scatter([x], [y], marker=marker, s=40)
            ax.annotate(c["name"], (x, y), textcoords="offset points", xytext=(5, 3), fontsize=8)
            points += 1
    if points == 0:
        raise SystemExit("plot_quality: no codecs in the inputs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio vs dense BF16 K/V (windows included)")
    ax.set_ylabel(args.metric)
    ax.set_title(args.title or f"{args.metric} against compression")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: {points} points")


if __name__ == "__main__":
    main()
