#!/usr/bin/env python3
"""Fine-tune a kvcd FSQ codec file on a real model's text, the backbone frozen.

  finetune.py train --model MODEL [--tokenizer TOK] --codec INIT.st --out TUNED.st \\
      --train SPEC [--train SPEC ...] [--val SPEC ...] [--positions 512] [--steps 300] \\
      [--lr 5e-4] [--decay 0] [--batch 0] [--seed 0] [--eval-every 10] [--patience 0] \\
      [--decoder-steps 0] [--sink 4] [--recent 8]
  finetune.py eval --model MODEL [--tokenizer TOK] --codec CODEC.st --eval SPEC [...] \\
      [--positions 512] [--sink 4] [--recent 8] [--json OUT]
  finetune.py tokens --model MODEL [--tokenizer TOK] --eval SPEC [...] --out TOKENS.txt
  finetune.py dump --model MODEL [--tokenizer TOK] --eval SPEC [...] --out DUMP.st \\
      --weights WEIGHTS.st [--positions 512]

MODEL: a llama2.c checkpoint (stories260K.bin; --tokenizer tok512.bin) or a Hugging
Face-layout llama-family safetensors file written by tools/gguf_to_safetensors.py
(SmolLM2: GQA, RoPE half or interleaved, optional q/k RMSNorm; tools/fsq_finetune/model.py).

SPEC names token sequences:
  prompt:TEXT   the FP32 model's greedy continuation of TEXT to --positions tokens
                (llama2.c tokenizer; several prompt: specs are generated in one batch);
  text:FILE     each non-empty line of FILE, encoded with the llama2.c tokenizer;
  tokens:FILE   each line of FILE is whitespace-separated token ids (kvcd-llama --encode
                writes them for Hugging Face-tokenized models).
Sequences longer than --positions are cut into chunks of --positions tokens.

Teacher: the FP32 model with exact K/V. Student: the same model whose history K/V
(positions >= sink and older than the recent window, for every query) are rebuilt from
the codec's 4-bit codes of the student's own normalized residuals, as kvcd stores them
(the windows stay exact here; kvcd keeps them in BF16). Loss: KL(teacher || student) of
the next-token distributions, mean over the positions that have a history. Trained:
every layer's encoder E, e, decoders W_k, W_v, biases b_k, b_v and key-norm weights
(Adam, straight-through rounding). Against overfitting: --decay pulls every parameter
toward its initial value (decoupled, p -= lr·decay·(p − p0) per step); --val sequences
(never trained on) are scored every --eval-every steps and the parameters with the lowest
validation KL are written (the initialization included, so a run never writes a codec
that is worse on the validation text than its input); --patience stops after that many
evaluations without improvement; --decoder-steps trains only W_k, W_v, b_k, b_v (and the
key norm) for the first steps, the encoder after. --batch > 0 draws that many training
sequences per step (numpy seed --seed); 0 uses all of them every step (deterministic).
The result is written in the same codec format (docs/fsq.md).

'eval' reports, teacher-forced on each sequence, the mean and max KL against the FP32
model and the first position whose greedy (argmax) token differs, and the mean over all.
'tokens' writes the sequences of the --eval specs as a tokens: file (one line each: the
greedy continuations are generated once). 'dump' writes an activation dump with residuals (layers.<l>.q/k/v/x, common/activation_dump.h)
and the K/V projection weights (layers.<l>.wk/wv[/k_norm]) for `kvcd-calibrate fsq`.
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
import model  # noqa: E402

DECODER = ("decoder_k", "decoder_v", "bias_k", "bias_v", "key_norm")


def kl_rows(teacher_logits, student_logits):
    lp = jax.nn.log_softmax(teacher_logits, axis=-1)
    lq = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


# --- data ---------------------------------------------------------------------------------


def chunks(ids, positions):
    return [np.asarray(ids[i:i + positions], np.int32) for i in range(0, len(ids), positions)]


def sequences(specs, c, w, tok, positions):
    """Token sequences (list of int32 arrays, each at most `positions` long) of `specs`."""
    out, prompts = [], []
    for spec in specs:
        kind, _, arg = spec.partition(":")
        if kind == "prompt":
            if tok is None:
                raise ValueError(f"{spec!r}: prompt: needs --tokenizer (llama2.c models)")
            prompts.append(tok.encode(arg))
            out.append(len(prompts) - 1)
        elif kind == "text":
            if tok is None:
                raise ValueError(f"{spec!r}: text: needs --tokenizer (llama2.c models); for "
                                 "other models pass tokens: from kvcd-llama --encode")
            for line in open(arg, encoding="utf-8").read().splitlines():
                if line.strip():
                    out.extend(chunks(tok.encode(line.strip()), positions))
        elif kind == "tokens":
            for line in open(arg, encoding="utf-8").read().splitlines():
                ids = [int(v) for v in line.split()]
                if any(i < 0 or i >= c.vocab_size for i in ids):
                    raise ValueError(f"{arg}: token id out of range [0, {c.vocab_size})")
                if ids:
                    out.extend(chunks(ids, positions))
        else:
            raise ValueError(f"{spec!r}: expected prompt:TEXT, text:FILE or tokens:FILE")
    if prompts:
        gen = model.greedy(c, w, prompts, positions)
        out = [gen[s] if isinstance(s, int) else s for s in out]
    return out


class Batch:
    """Sequences padded to one length: tokens [B, T], loss mask [B, T] (positions with a
    history, inside the sequence), teacher logits [B, T, V]."""

    def __init__(self, c, w, seqs, sink, recent):
        T = max(len(s) for s in seqs)
        self.tokens = np.zeros((len(seqs), T), np.int32)
        self.mask = np.zeros((len(seqs), T), np.float32)
        for i, s in enumerate(seqs):
            self.tokens[i, :len(s)] = s
            self.mask[i, sink + recent:len(s)] = 1
        if self.mask.sum() == 0:
            raise ValueError(f"no sequence is longer than the sink and recent windows ({sink} + "
                             f"{recent} tokens)")
        teach = jax.jit(jax.vmap(lambda w, t: model.forward(c, w, t), in_axes=(None, 0)))
        self.teacher = np.concatenate([np.asarray(teach(w, jnp.asarray(self.tokens[i:i + 8])))
                                       for i in range(0, len(seqs), 8)])

    def take(self, idx):
        return (jnp.asarray(self.tokens[idx]), jnp.asarray(self.mask[idx]),
                jnp.asarray(self.teacher[idx]))


# --- training -----------------------------------------------------------------------------


def to_params(layers):
    return [{k: jnp.asarray(v) for k, v in layer.items()} for layer in layers]


def make_loss(c, sink, recent):
    """(params, weights, tokens [B, T], mask [B, T], teacher [B, T, V]) -> masked mean KL.
    Weights, tokens and teacher logits are arguments, not constants of the traced function
    (XLA would fold the whole teacher forward pass at compile time)."""

    def loss(params, w, tokens, mask, teacher):
        hist = fsq.make_history(c, params)
        student = jax.vmap(lambda t: model.forward(c, w, t, hist, sink, recent))(tokens)
        kl = kl_rows(teacher, student)
        return jnp.sum(kl * mask) / jnp.sum(mask)

    return loss


def train(c, w, train_seqs, layers, steps, lr, sink, recent, val_seqs=(), decay=0.0,
          batch=0, seed=0, eval_every=10, patience=0, decoder_steps=0, log=print):
    """Adam on the codec parameters. Returns (best layers as numpy, history dict): the
    parameters with the lowest validation KL (of the evaluations every `eval_every` steps,
    the initialization included), or the lowest training loss without validation data.
    history: train (loss per step, before its update), val [(step, KL)], best_step."""
    data = Batch(c, w, train_seqs, sink, recent)
    val = Batch(c, w, val_seqs, sink, recent) if len(val_seqs) else None
    loss_fn = make_loss(c, sink, recent)
    grad_fn = jax.jit(jax.value_and_grad(loss_fn))
    val_fn = jax.jit(loss_fn)
    params = to_params(layers)
    init = params
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    b1, b2, eps = 0.9, 0.999, 1e-8

    @jax.jit
    def update(params, m, v, g, t, gate):
        # gate: per-parameter 0/1 (frozen encoder during the decoder-only phase).
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)
        params = jax.tree_util.tree_map(
            lambda p, a, b, p0, on: p - on * lr * ((a / (1 - b1 ** t)) / (jnp.sqrt(b / (1 - b2 ** t)) + eps)
                                                   + decay * (p - p0)),
            params, m, v, init, gate)
        return params, m, v

    def gates(decoder_only):
        return [{k: jnp.float32(0.0 if decoder_only and k not in DECODER else 1.0) for k in p}
                for p in params]

    rng = np.random.default_rng(seed)
    n = data.tokens.shape[0]
    hist = {"train": [], "val": [], "best_step": 0}
    best, best_params, since = None, params, 0
    for step in range(steps + 1):
        if val is not None and (step % eval_every == 0 or step == steps):
            vl = float(val_fn(params, w, *val.take(np.arange(val.tokens.shape[0]))))
            hist["val"].append((step, vl))
            if best is None or vl < best:
                best, best_params, since, hist["best_step"] = vl, params, 0, step
            else:
                since += 1
            if log:
                log(f"step {step:4d}  validation KL {vl:.5f}")
            if patience and since >= patience:
                break
        if step == steps:
            break
        idx = np.arange(n) if batch <= 0 or batch >= n else np.sort(rng.choice(n, batch, replace=False))
        loss, g = grad_fn(params, w, *data.take(idx))
        loss = float(loss)
        if not np.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss} at step {step}")
        hist["train"].append(loss)
        if val is None and (best is None or loss < best):
            best, best_params, hist["best_step"] = loss, params, step
        if log and step % 10 == 0:
            log(f"step {step:4d}  train KL {loss:.5f}")
        params, m, v = update(params, m, v, g, float(step + 1), gates(step < decoder_steps))
    return [{k: np.asarray(a, np.float32) for k, a in p.items()} for p in best_params], hist


def evaluate(c, w, seqs, layers, sink, recent):
    """Teacher-forced KL(FP32 || FSQ history) per sequence and over all (positions with a
    history)."""
    fwd = jax.jit(lambda w, t, p: (model.forward(c, w, t),
                                   model.forward(c, w, t, fsq.make_history(c, p), sink, recent)))
    params = to_params(layers)
    first = sink + recent
    rows, all_kl = [], []
    for s in seqs:
        if len(s) <= first:
            continue
        teacher, student = fwd(w, jnp.asarray(s), params)
        kl = np.asarray(kl_rows(teacher, student))
        differs = np.nonzero(np.argmax(np.asarray(teacher), -1) != np.argmax(np.asarray(student), -1))[0]
        rows.append({"positions": int(len(s)), "kl_mean": float(kl[first:].mean()),
                     "kl_max": float(kl[first:].max()),
                     "first_differs": int(differs[0]) if differs.size else None})
        all_kl.append(kl[first:])
    cat = np.concatenate(all_kl)
    return {"kl_mean": float(cat.mean()), "kl_max": float(cat.max()), "sequences": rows}


# --- activation dump for kvcd-calibrate fsq -----------------------------------------------


def write_dump(c, w, seqs, out, weights_out, source):
    from safetensors.numpy import save_file

    fwd = jax.jit(lambda w, t: model.forward(c, w, t, residuals=True)[1])
    acts = [fwd(w, jnp.asarray(s)) for s in seqs]
    tensors = {}
    for l in range(c.n_layers):
        for j, name in enumerate("xqkv"):
            tensors[f"layers.{l}.{name}"] = np.ascontiguousarray(
                np.concatenate([np.asarray(a[l][j], np.float32) for a in acts]))
    n = sum(len(s) for s in seqs)
    save_file(tensors, out, metadata={
        "kvcd.dump": "1", "num_layers": str(c.n_layers), "num_q_heads": str(c.n_heads),
        "num_kv_heads": str(c.n_kv_heads), "head_dim": str(c.head_dim), "tokens": str(n),
        "residual_width": str(c.dim), "source": source})
    proj = {}
    for l in range(c.n_layers):
        proj[f"layers.{l}.wk"] = np.ascontiguousarray(np.asarray(w["wk"][l], np.float32))
        proj[f"layers.{l}.wv"] = np.ascontiguousarray(np.asarray(w["wv"][l], np.float32))
        if c.qk_norm:
            proj[f"layers.{l}.k_norm"] = np.ascontiguousarray(np.asarray(w["k_norm"][l], np.float32))
    save_file(proj, weights_out, metadata={"source": source})
    return n


# --- command line -------------------------------------------------------------------------


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["train", "eval", "dump", "tokens"])
    ap.add_argument("--model", "--checkpoint", dest="model", required=True)
    ap.add_argument("--tokenizer")
    ap.add_argument("--codec")
    ap.add_argument("--out")
    ap.add_argument("--weights")
    ap.add_argument("--train", action="append", default=[])
    ap.add_argument("--val", action="append", default=[])
    ap.add_argument("--eval", action="append", default=[])
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--decay", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--patience", type=int, default=0)
    ap.add_argument("--decoder-steps", type=int, default=0)
    ap.add_argument("--sink", type=int, default=4)
    ap.add_argument("--recent", type=int, default=8)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    c, w = model.load(args.model)
    tok = None
    if args.tokenizer:
        sys.path.insert(0, os.path.join(model.ROOT, "client", "python", "examples"))
        tok = model.llama2c.Tokenizer(args.tokenizer, c.vocab_size)
    positions = min(args.positions, c.seq_len)

    def seqs(specs, what):
        if not specs:
            sys.exit(f"finetune: {args.mode} needs at least one {what} SPEC")
        return sequences(specs, c, w, tok, positions)

    if args.mode == "tokens":
        if not args.out:
            sys.exit("finetune: tokens needs --out")
        with open(args.out, "w") as f:
            for s in seqs(args.eval, "--eval"):
                f.write(" ".join(str(int(t)) for t in s) + "\n")
        print(f"wrote {args.out}")
        return 0
    if args.mode == "dump":
        if not args.out or not args.weights:
            sys.exit("finetune: dump needs --out and --weights")
        n = write_dump(c, w, seqs(args.eval, "--eval"), args.out, args.weights,
                       f"tools/fsq_finetune dump of {args.model} over {args.eval}")
        print(f"wrote {args.out} ({n} tokens) and {args.weights}")
        return 0
    if not args.codec:
        sys.exit("finetune: --codec is required")
    meta, layers = fsq.read_codec(args.codec)
    fsq.check_codec_matches(meta, c, args.codec)
    if args.mode == "eval":
        r = evaluate(c, w, seqs(args.eval, "--eval"), layers, args.sink, args.recent)
        r["codec"] = args.codec
        r["eval"] = args.eval
        print(json.dumps({k: v for k, v in r.items() if k != "sequences"}))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=2)
        return 0
    if not args.out:
        sys.exit("finetune: train needs --out")
    t0 = time.time()
    train_seqs = seqs(args.train, "--train")
    val_seqs = sequences(args.val, c, w, tok, positions) if args.val else []
    print(f"{len(train_seqs)} training sequences ({sum(map(len, train_seqs))} tokens), "
          f"{len(val_seqs)} validation ({sum(map(len, val_seqs))} tokens); "
          f"data {time.time() - t0:.1f} s")
    tuned, hist = train(c, w, train_seqs, layers, args.steps, args.lr, args.sink, args.recent,
                        val_seqs, args.decay, args.batch, args.seed, args.eval_every,
                        args.patience, args.decoder_steps)
    source = (f"tools/fsq_finetune: Adam lr {args.lr}, decay {args.decay}, {args.steps} steps "
              f"(best {hist['best_step']}), decoder-only {args.decoder_steps}, batch "
              f"{args.batch}, seed {args.seed}, KL to the FP32 model on {args.train}, "
              f"validation {args.val}, sink {args.sink} recent {args.recent}, from {args.codec}")
    fsq.write_codec(args.out, meta, tuned, source)
    v = hist["val"]
    vtxt = (f"; validation KL {v[0][1]:.5f} -> {min(x[1] for x in v):.5f} (step "
            f"{hist['best_step']})" if v else "")
    print(f"train KL {hist['train'][0]:.5f} -> {hist['train'][-1]:.5f}{vtxt} in "
          f"{time.time() - t0:.1f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
