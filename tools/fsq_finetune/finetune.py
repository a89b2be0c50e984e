#!/usr/bin/env python3
"""Fine-tune a kvcd FSQ codec file on a real model's text, the backbone frozen.

  finetune.py train --checkpoint stories260K.bin --tokenizer tok512.bin \\
      --codec INIT.safetensors --out TUNED.safetensors (--prompt TEXT | --text FILE) \\
      [--positions 512] [--steps 200] [--lr 1e-3] [--sink 4] [--recent 8]
  finetune.py eval --checkpoint ... --tokenizer ... --codec CODEC.safetensors \\
      (--prompt TEXT | --text FILE) [--positions 512] [--sink 4] [--recent 8] [--json OUT]

The training text is --text (a file, encoded with the model's tokenizer) or the FP32
model's own greedy continuation of --prompt, --positions tokens long. Teacher: the FP32
model with exact K/V. Student: the same model whose history K/V (positions >= sink and
older than the recent window, for every query) are rebuilt from the codec's 4-bit codes
of the student's own normalized residuals, as kvcd stores them (the windows stay exact
here; kvcd keeps them in BF16). Loss: KL(teacher || student) of the next-token
distributions, mean over the positions that have a history. Trained: every layer's
encoder E, e, decoders W_k, W_v and biases b_k, b_v (Adam, straight-through rounding).
The result is written in the same codec format (docs/fsq.md).

'eval' reports, teacher-forced on the text, the mean and max KL against the FP32 model
and the first position whose greedy (argmax) token differs.

llama2.c checkpoints only (the forward pass is tools/fsq_finetune/llama2.py, checked
against the C++ worker's logits by the tests).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import fsq  # noqa: E402
import llama2  # noqa: E402


def kl_rows(teacher_logits, student_logits):
    lp = jax.nn.log_softmax(teacher_logits, axis=-1)
    lq = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def text_tokens(args, c, w, tok):
    n = min(args.positions, c.seq_len)
    if args.text:
        ids = tok.encode(open(args.text, encoding="utf-8").read())[:n]
        return np.asarray(ids, np.int32)
    return llama2.greedy(c, w, tok.encode(args.prompt), n)


def to_params(layers):
    return [{k: jnp.asarray(v) for k, v in layer.items()} for layer in layers]


def train(c, w, tokens, layers, steps, lr, sink, recent, log=print):
    """Adam on the codec parameters; returns (trained layers as numpy, losses per step)."""
    tokens = jnp.asarray(tokens)
    teacher = jax.jit(lambda w, t: llama2.forward(c, w, t))(w, tokens)
    first = sink + recent

    # Weights, tokens and teacher logits are arguments, not constants of the traced function
    # (XLA would fold the whole teacher forward pass at compile time).
    def loss_fn(params, w, tokens, teacher):
        student = llama2.forward(c, w, tokens, fsq.make_history(params, c.head_dim), sink, recent)
        return jnp.mean(kl_rows(teacher[first:], student[first:]))

    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    params = to_params(layers)
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    b1, b2, eps = 0.9, 0.999, 1e-8

    @jax.jit
    def update(params, m, v, g, t):
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
        mh = jax.tree_util.tree_map(lambda a: a / (1 - b1 ** t), m)
        vh = jax.tree_util.tree_map(lambda a: a / (1 - b2 ** t), v)
        params = jax.tree_util.tree_map(lambda p, a, b: p - lr * a / (jnp.sqrt(b) + eps), params, mh, vh)
        return params, m, v

    losses = []
    best, best_params = None, params
    for step in range(steps + 1):
        loss, g = grad_fn(params, w, tokens, teacher)
        loss = float(loss)
        losses.append(loss)
        if best is None or loss < best:
            best, best_params = loss, params
        if log and (step % 10 == 0 or step == steps):
            log(f"step {step:4d}  KL {loss:.5f}")
        if step == steps:
            break
        params, m, v = update(params, m, v, g, float(step + 1))
    # The lowest-loss parameters seen (the last step's loss is evaluated, not applied).
    return [{k: np.asarray(a, np.float32) for k, a in p.items()} for p in best_params], losses


def evaluate(c, w, tokens, layers, sink, recent):
    tokens = jnp.asarray(tokens)
    teacher = jax.jit(lambda w, t: llama2.forward(c, w, t))(w, tokens)
    student = jax.jit(lambda w, t, p: llama2.forward(c, w, t, fsq.make_history(p, c.head_dim), sink,
                                                      recent))(w, tokens, to_params(layers))
    kl = np.asarray(kl_rows(teacher, student))
    differs = np.nonzero(np.argmax(np.asarray(teacher), -1) != np.argmax(np.asarray(student), -1))[0]
    first = sink + recent
    return {"positions": int(tokens.shape[0]), "kl_mean": float(kl[first:].mean()),
            "kl_max": float(kl.max()), "first_differs": int(differs[0]) if differs.size else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["train", "eval"])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--codec", required=True)
    ap.add_argument("--out")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--text")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    c, w = llama2.load_checkpoint(args.checkpoint)
    tok = llama2.Tokenizer(args.tokenizer, c.vocab_size)
    meta, layers = fsq.read_codec(args.codec)
    if (int(meta["num_layers"]), int(meta["residual_width"]), int(meta["num_kv_heads"]),
            int(meta["head_dim"])) != (c.n_layers, c.dim, c.n_kv_heads, c.head_dim):
        sys.exit(f"finetune: codec {args.codec} does not match the model geometry")
    tokens = text_tokens(args, c, w, tok)
    if tokens.size <= args.sink + args.recent:
        sys.exit("finetune: the text is not longer than the sink and recent windows")
    if args.mode == "eval":
        r = evaluate(c, w, tokens, layers, args.sink, args.recent)
        r["codec"] = args.codec
        print(json.dumps(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    if not args.out:
        sys.exit("finetune: train needs --out")
    t0 = time.time()
    tuned, losses = train(c, w, tokens, layers, args.steps, args.lr, args.sink, args.recent)
    what = f"--text {args.text}" if args.text else f"greedy from {args.prompt!r}"
    source = (f"tools/fsq_finetune: {args.steps} Adam steps (lr {args.lr}) of KL to the FP32 model "
              f"on {tokens.size} tokens ({what}), sink {args.sink} recent {args.recent}, from "
              f"{args.codec}")
    fsq.write_codec(args.out, meta, tuned, source)
    print(f"KL {losses[0]:.5f} -> best {min(losses):.5f} in {time.time() - t0:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
