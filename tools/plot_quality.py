#!/usr/bin/env python3
"""Quality against actual compression ratio, from kvcd-eval --json or kvcd-llama --json files.

  plot_quality.py OUT.png EVAL.json [EVAL2.json ...] [--metric kl_mean|out_rel_err|...]
      [--x compression_ratio|compression_ratio_history] [--labels A,B,...] [--title TEXT]

One point per codec of every file (x: compression_ratio against dense BF16 K/V, windows
included, or with --x compression_ratio_history (kvcd-llama) the history's alone; log
scale; y: the metric, log scale), labelled with the codec's name (a codec file's path
shortened to its file name); the marker is the format family (bf16, int2, fsq), the
colour the input file (--labels names them in the legend). Run it with the FSQ tools'
environment: $(scripts/fsq-venv.sh)/bin/python tools/plot_quality.py.
"""
import os
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("inputs", nargs="+")
    ap.add_argument("--metric", default="out_rel_err",
                    choices=["kl_mean", "kl_max", "kl_p99", "out_rel_err", "logit_rel_err"])
    ap.add_argument("--x", default="compression_ratio",
                    choices=["compression_ratio", "compression_ratio_history"])
    ap.add_argument("--labels", default="")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    labels = args.labels.split(",") if args.labels else []
    if labels and len(labels) != len(args.inputs):
        raise SystemExit(f"plot_quality: {len(labels)} --labels for {len(args.inputs)} inputs")
    fig, ax = plt.subplots(figsize=(8, 5))
    points = 0
    for n, path in enumerate(args.inputs):
        with open(path) as f:
            data = json.load(f)
        colour = f"C{n % 10}"
        for i, c in enumerate(data["codecs"]):
            x, y = c[args.x], max(c[args.metric], 1e-12)
            name = c["name"]
            if "=" in name:  # a codec file: its name, not its folder
                kind, _, file = name.partition("=")
                name = f"{kind}={os.path.basename(file)}"
            family = name.split("-")[0].split(":")[0].split("=")[0]
            marker = {"bf16": "s", "int2": "o", "kivi2": "^", "fsq": "D"}.get(family, "x")
            ax.scatter([x], [y], marker=marker, s=40, color=colour,
                       label=labels[n] if labels and i == 0 else None)
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 3), fontsize=7,
                        color=colour)
            points += 1
    if points == 0:
        raise SystemExit("plot_quality: no codecs in the inputs")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio vs dense BF16 K/V (windows included)"
                  if args.x == "compression_ratio" else
                  "compression ratio of the history vs dense BF16 K/V")
    if labels:
        ax.legend(fontsize=8)
    ax.set_ylabel(args.metric)
    ax.set_title(args.title or f"{args.metric} against compression")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}: {points} points")


if __name__ == "__main__":
    main()
