#!/usr/bin/env python3
"""Writes tests/data/block_hash_vectors.json: test vectors of kvcd's block identity v1.

An implementation of docs/cluster.md "Block identity (version 1)" independent of the C++
one (common/block_hash.cc): Python's hashlib and struct only. The C++ unit test and the
Python client's test both check their hashes against the file this writes.

    python3 tools/block_hash_vectors.py > tests/data/block_hash_vectors.json
"""
import hashlib
import json
import random
import struct
import sys

DOMAIN = b"kvcd-block-v1\x00"
INT32_MAX = 2**31 - 1


def field(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def chain(model: str, salt: str, fmt: str, page_size: int, tokens):
    """Hex hashes of every full page of tokens, page 0 first."""
    head = DOMAIN + field(model) + field(salt) + field(fmt)
    parent = bytes(32)
    out = []
    for start in range(0, len(tokens) - page_size + 1, page_size):
        page = tokens[start:start + page_size]
        body = struct.pack("<I", page_size) + b"".join(
            struct.pack("<I", t & 0xFFFFFFFF) for t in page)
        parent = hashlib.sha256(head + parent + body).digest()
        out.append(parent.hex())
    return out


def event_id(hex_hash: str) -> int:
    return struct.unpack(">q", bytes.fromhex(hex_hash)[:8])[0]


def main():
    rng = random.Random(20261205)
    cases = [
        # (name, model, salt, format, page_size, tokens)
        ("empty salt, bf16, page 4", "tiny", "", "bf16", 4, list(range(10))),
        ("tenant salt, int2-oscar", "qwen3-8b", "tenant-a", "int2-oscar", 16,
         [rng.randrange(0, 151936) for _ in range(48)]),
        ("same tokens, other tenant", "qwen3-8b", "tenant-b", "int2-oscar", 16, None),
        ("same tokens, other format", "qwen3-8b", "tenant-a", "int2-transform", 16, None),
        ("fsq, page 64", "llama-3.1-8b", "acme", "fsq", 64,
         [rng.randrange(0, 128256) for _ in range(200)]),
        ("token ids near INT32_MAX", "tiny", "s", "bf16", 2,
         [INT32_MAX, INT32_MAX - 1, 0, 1, INT32_MAX - 2, 2147483000]),
        ("negative token ids (u32 of two's complement)", "tiny", "", "bf16", 2, [-1, -2147483648]),
        ("page size 1", "m", "", "bf16", 1, [5, 6, 7]),
        ("fewer tokens than a page", "m", "", "bf16", 8, [1, 2, 3]),
        ("unicode model and salt", "modèle-ü", "ténant", "bf16", 3, [1, 2, 3, 4, 5, 6]),
        ("page size 1024", "big", "x", "bf16", 1024, [rng.randrange(0, 50000) for _ in range(2048)]),
    ]
    vectors = []
    prev_tokens = None
    for name, model, salt, fmt, page_size, tokens in cases:
        if tokens is None:
            tokens = prev_tokens
        prev_tokens = tokens
        hashes = chain(model, salt, fmt, page_size, tokens)
        vectors.append({
            "name": name, "model": model, "salt": salt, "format": fmt, "page_size": page_size,
            "tokens": tokens, "hashes": hashes, "event_ids": [event_id(h) for h in hashes],
        })
    doc = {
        "version": 1,
        "comment": "Block identity v1 (docs/cluster.md). Written by tools/block_hash_vectors.py "
                   "(hashlib); tokens are int32, hashed as u32le of their two's complement.",
        "vectors": vectors,
    }
    json.dump(doc, sys.stdout, indent=1, ensure_ascii=False)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
