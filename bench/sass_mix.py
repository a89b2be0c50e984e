#!/usr/bin/env python3
"""Counts a CUDA kernel's SASS instructions without a GPU: for predictions by count.

Compiles one kernels/cuda source for sm_90a at -O3 into a cubin, disassembles it with
nvdisasm and prints, for each kernel whose mangled name contains --kernel: its instruction
count, its loops (backward branches) by size, and the opcode mix of the largest loop (the
tile loop of a decode kernel) or of loop --loop, and with --lines the source lines that loop's
instructions come from (-lineinfo; inlined helpers by their own lines). These are static counts: a branch's
untaken side counts, an inner loop counts once. A prediction still needs the trip counts
and the taken paths (bench/results/2026-12-05-h200-fsq-keys.md, session 26, shows one).

The CUDA toolkit here has no nvdisasm; without --nvdisasm (or KVCD_NVDISASM) the script
fetches NVIDIA's nvdisasm wheel from PyPI once into ~/.cache/kvcd/nvdisasm-<version>.

  bench/sass_mix.py kernels/cuda/fsq_decode_attention_i8_2cta.cu \\
      --kernel FsqDecodeKernelILi128ELi16ELi1ELb1ELb1ELi128E
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
import zipfile

NVDISASM_WHEEL = "nvidia-cuda-nvdisasm==13.5.37"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def nvdisasm_path(given):
    if given:
        return given
    cache = os.path.expanduser("~/.cache/kvcd/nvdisasm-" + NVDISASM_WHEEL.split("==")[1])
    for dirpath, _, files in os.walk(cache):
        if "nvdisasm" in files:
            return os.path.join(dirpath, "nvdisasm")
    os.makedirs(cache, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", cache,
                    NVDISASM_WHEEL], check=True)
    wheel = [f for f in os.listdir(cache) if f.endswith(".whl")][0]
    zipfile.ZipFile(os.path.join(cache, wheel)).extractall(cache)
    for dirpath, _, files in os.walk(cache):
        if "nvdisasm" in files:
            path = os.path.join(dirpath, "nvdisasm")
            os.chmod(path, 0o755)
            return path
    raise SystemExit(f"no nvdisasm in {wheel}")


def kernels_of(sass):
    """{mangled name: [(opcode, text)]} and each kernel's label -> instruction index."""
    out, name, labels, pending, where = {}, None, {}, [], ("?", 0)
    for line in sass.splitlines():
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            where = (m.group(1), int(m.group(2)))
            continue
        m = re.match(r"(_Z\S+):$", line.strip())
        if m and not line.startswith("\t."):
            name = m.group(1)
            out[name], labels[name], pending = [], {}, []
            continue
        if name is None:
            continue
        m = re.match(r"(\.L_x_\d+):", line.strip())
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            body = re.sub(r"^@!?U?P[T0-9]+\s+", "", m.group(1).strip())
            for p in pending:
                labels[name][p] = len(out[name])
            pending = []
            out[name].append((body.split()[0].split(".")[0], body, where))
    return out, labels


def loops_of(ins, labels):
    found = set()
    for i, (op, body, _) in enumerate(ins):
        if op == "BRA":
            m = re.search(r"(\.L_x_\d+)", body)
            if m and labels.get(m.group(1), i + 1) <= i:
                found.add((labels[m.group(1)], i))
    return sorted(found, key=lambda se: se[0] - se[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="a .cu file under kernels/cuda")
    ap.add_argument("--kernel", required=True, help="a substring of the kernels' mangled names")
    ap.add_argument("--loop", type=int, default=0, help="which loop's mix, by size (0: largest)")
    ap.add_argument("--lines", type=int, default=0, help="print the loop's N busiest source lines")
    ap.add_argument("--nvdisasm", default=os.environ.get("KVCD_NVDISASM"))
    ap.add_argument("--nvcc", default="/usr/local/cuda/bin/nvcc")
    a = ap.parse_args()
    nvd = nvdisasm_path(a.nvdisasm)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        subprocess.run([a.nvcc, "-I", os.path.join(ROOT, "kernels", "include"), "-O3", "-DNDEBUG",
                        "-arch=sm_90a", "-std=c++17", "-lineinfo", "-cubin", "-o", cubin, a.source],
                       check=True)
        sass = subprocess.run([nvd, "-c", "-g", cubin], check=True, capture_output=True,
                              text=True).stdout
    kernels, labels = kernels_of(sass)
    chosen = [k for k in kernels if a.kernel in k]
    if not chosen:
        raise SystemExit(f"no kernel matches {a.kernel!r}; kernels: " + " ".join(kernels))
    for k in chosen:
        ins = kernels[k]
        loops = loops_of(ins, labels[k])
        print(f"{k}\n  {len(ins)} instructions; loops (first..last instruction: size):")
        for s, e in loops[:8]:
            print(f"    {s}..{e}: {e - s + 1}")
        if len(loops) > a.loop:
            s, e = loops[a.loop]
            mix = collections.Counter(op for op, _, _ in ins[s:e + 1])
            print(f"  loop {s}..{e} by opcode:")
            for op, n in mix.most_common(24):
                print(f"    {op:<10} {n:5d} {100.0 * n / (e - s + 1):5.1f}%")
            if a.lines:
                by_line = collections.Counter(w for _, _, w in ins[s:e + 1])
                print(f"  loop {s}..{e} by source line:")
                for (path, ln), n in by_line.most_common(a.lines):
                    text = ""
                    if os.path.exists(path):
                        with open(path) as f:
                            src = f.read().splitlines()
                        text = src[ln - 1].strip()[:60] if 0 < ln <= len(src) else ""
                    print(f"    {n:5d}  {os.path.basename(path)}:{ln}  {text}")


if __name__ == "__main__":
    main()
