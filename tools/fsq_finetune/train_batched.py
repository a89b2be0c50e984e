#!/usr/bin/env python3
"""Train FSQ codec files of several latent widths at once, on an accelerator (or the CPU),
with batches of many sequences, a validation split that selects the parameters, a time
budget, checkpoints and a progress line.

  train_batched.py --model MODEL.safetensors --codec INIT.st [--codec INIT2.st ...]
      --train TRAIN.npy [--train ...] --val VAL.npy --out-dir DIR
      [--batch 32] [--sink 16] [--recent 32] [--lr 2e-3] [--warmup 20] [--seconds 240]
      [--max-steps 0] [--eval-every 25] [--eval-seconds 0] [--val-seqs 64] [--samples 0
      --prompt-len 32 --temperature 1.0 --sample-val 0.1] [--precision tensorfloat32]
      [--val-precision highest] [--deadline 0] [--seed 0]

MODEL: a llama-family file model.load reads (SmolLM2: tools/gguf_to_safetensors.py).
TRAIN / VAL: uint16 or int32 token arrays [n, T] (tools/fsq_finetune/corpus.py).

What is trained: every layer's encoder E, e, decoders W_k, W_v and biases b_k, b_v (and a
key-norm weight if the codec has one) of each codec; the model is frozen. The codecs are
stacked and padded to the largest width (stacked.py) and trained side by side in one
compiled step on the same batch, sharing the teacher's forward pass.

Loss, per codec: KL(teacher || student) of the next-token distributions, mean over the
positions that have a history (>= sink + recent), with the teacher the FP32 model with
exact K/V and the student the same model with its history K/V rebuilt from the codes, as
the daemon serves it (windows exact here, BF16 in kvcd). That is the figure the
evaluation measures; no reconstruction term (the initialization already minimizes the
K/V reconstruction error; what the model does not read need not be reconstructed).

Optimizer: Adam whose step is relative to each parameter's initial size (lr × the RMS of
its encoder row or decoder column, i.e. of its latent coordinate, in that layer, or of the
whole bias vector; floored at 5% of the mean), so one rate suits encoders, decoders and
biases whatever their scale (the PCA initialization scales coordinates by 1/σ); linear
warm-up over --warmup steps.
Validation every --eval-every steps and/or --eval-seconds of training on --val-seqs
sequences (never trained on) in --val-precision matmul precision: a codec whose validation KL is the lowest so far is written to
DIR/fsq-g<G>.st at once (the checkpoint; the initialization is the first candidate, so a
run never writes a codec worse on validation than its input); two evaluations in a row
without improvement roll that codec back to its best parameters and halve its rate.
Training stops at --seconds (or --max-steps), or when the next step and a validation
would end past --deadline seconds from the start. Training matmuls use --precision
(tensorfloat32 on the GPU: the teacher and student share the rounding, whose effect on
the KL, ~1e-4, is far below the differences selected on).

--samples N adds the model's own text: N continuations sampled at --temperature with a
K/V cache from prompts of --prompt-len tokens cut from the starts of training sequences;
a --sample-val fraction of them joins the validation split, the rest the training pool.

Writes DIR/fsq-g<G>.st per codec and DIR/train.json (settings, data sizes, per codec: the
validation KL of the initialization and of the selected step, the training KL curve).
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
import stacked  # noqa: E402


def kl_rows(lp, student_logits):
    """KL(p || q) per row from the teacher's log-probabilities and the student's logits."""
    lq = jax.nn.log_softmax(student_logits, axis=-1)
    return jnp.sum(jnp.exp(lp) * (lp - lq), axis=-1)


def make_fns(c, sink, recent):
    """(loss_and_grad, val_kl): both take the stacked codecs [K, L, ...] (K codecs)."""
    first = sink + recent

    def per_codec_loss(codec, w, tokens, lp):
        student = stacked.forward(c, w, tokens, codec, sink, recent, remat=True)
        return jnp.mean(kl_rows(lp[:, first:], student[:, first:]))

    def total(codecs, w, tokens):
        lp = jax.lax.stop_gradient(jax.nn.log_softmax(stacked.forward(c, w, tokens), axis=-1))
        losses = jax.vmap(per_codec_loss, in_axes=(0, None, None, None))(codecs, w, tokens, lp)
        return jnp.sum(losses), losses

    grad = jax.jit(jax.value_and_grad(total, has_aux=True))

    @jax.jit
    def val_kl(codecs, w, tokens):
        lp = jax.nn.log_softmax(stacked.forward(c, w, tokens), axis=-1)[:, first:]

        def one(codec):
            return jnp.sum(kl_rows(lp, stacked.forward(c, w, tokens, codec, sink, recent)[:, first:]))

        return jax.lax.map(one, codecs)

    return grad, val_kl


def out_of_memory(e):
    return "RESOURCE_EXHAUSTED" in str(e) or "out of memory" in str(e).lower()


def tree_stack(trees):
    return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *trees)


def train(c, w, inits, train_seqs, val_seqs, *, batch=32, sink=16, recent=32, lr=2e-3,
          warmup=20, seconds=240.0, max_steps=0, eval_every=25, precision="tensorfloat32",
          seed=0, deadline=None, grace=15.0, eval_seconds=0.0, val_precision="highest",
          on_best=None, log=print):
    """Trains the codecs `inits` (list of per-layer dict lists, fsq.read_codec) side by
    side. Returns (best per-layer lists, report dict). on_best(i, layers, step, val_kl) is
    called whenever codec i reaches a new lowest validation KL (the initialization first).
    Validates every eval_every steps and/or every eval_seconds of training. Stops after
    max_steps (if > 0), `seconds` of training counted from the end of the first step (which
    compiles), or when the next step and a validation would end past `deadline`
    (time.time()), whichever comes first; the last validation runs only if it ends before
    deadline + grace."""
    log = log or (lambda s: None)
    widths = [layer[0]["encoder"].shape[0] for layer in inits]
    gmax = max(widths)
    K = len(inits)
    st = [stacked.stack_codec(layers, gmax) for layers in inits]
    mask = tree_stack([jax.tree_util.tree_map(jnp.asarray, stacked.latent_mask(s, g))
                       for s, g in zip(st, widths)])
    params = tree_stack([jax.tree_util.tree_map(jnp.asarray, s) for s in st])

    def scale_of(name, p0):
        # [K, L, ...]: per codec and layer, the RMS of an encoder row / decoder column (one
        # latent coordinate: the PCA initialization scales them very differently) or of a
        # whole bias / norm vector; floored at 5% of the mean over layers and coordinates.
        ax = {"encoder": (3,), "decoder_k": (2,), "decoder_v": (2,)}.get(
            name, tuple(range(2, p0.ndim)))
        rms = jnp.sqrt(jnp.mean(p0 * p0, axis=ax, keepdims=True))
        live = rms > 0  # the padding has RMS 0 (and no updates)
        mean = jnp.sum(jnp.where(live, rms, 0.0), axis=tuple(range(1, rms.ndim)), keepdims=True) / \
            jnp.maximum(jnp.sum(live, axis=tuple(range(1, rms.ndim)), keepdims=True), 1)
        return jnp.maximum(rms, jnp.maximum(0.05 * mean, 1e-6))

    scale = {k: scale_of(k, p) for k, p in params.items()}
    grad_fn, val_fn = make_fns(c, sink, recent)
    m = jax.tree_util.tree_map(jnp.zeros_like, params)
    v = jax.tree_util.tree_map(jnp.zeros_like, params)
    b1, b2, eps = 0.9, 0.999, 1e-8

    @jax.jit
    def update(params, m, v, g, t, rate):
        # rate [K]: per codec (warm-up and halvings folded in).
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * b * b, v, g)

        def upd(p, a, b, s, mk):
            r = rate.reshape((K,) + (1,) * (p.ndim - 1))
            step = (a / (1 - b1 ** t)) / (jnp.sqrt(b / (1 - b2 ** t)) + eps)
            return p - r * s * step * mk

        return jax.tree_util.tree_map(upd, params, m, v, scale, mask), m, v

    train_seqs = np.asarray(train_seqs, np.int32)
    val_seqs = np.asarray(val_seqs, np.int32)
    # Whole batches only (a last, smaller batch would compile the validation again).
    val_seqs = val_seqs[:len(val_seqs) // min(batch, len(val_seqs)) * min(batch, len(val_seqs))]
    if train_seqs.shape[1] <= sink + recent:
        raise ValueError(f"sequences of {train_seqs.shape[1]} tokens: need more than the sink "
                         f"and recent windows ({sink} + {recent})")

    vb = [batch]

    def validate(p):
        while True:
            try:
                tot = np.zeros(K)
                with jax.default_matmul_precision(val_precision):
                    for i in range(0, len(val_seqs), vb[0]):
                        tot += np.asarray(val_fn(p, w, jnp.asarray(val_seqs[i:i + vb[0]])))
                return tot / (len(val_seqs) * (val_seqs.shape[1] - sink - recent))
            except Exception as e:  # noqa: BLE001 (XLA's error types vary by version)
                if not out_of_memory(e) or vb[0] == 1:
                    raise
                vb[0] //= 2
                log(f"validation out of memory: batches of {vb[0]} sequences")

    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(len(train_seqs)), 0
    rate = np.full(K, lr)
    report = {"widths": widths, "batch": batch, "sink": sink, "recent": recent, "lr": lr,
              "warmup": warmup, "precision": precision, "val_precision": val_precision, "train_sequences": len(train_seqs),
              "val_sequences": len(val_seqs), "positions": int(train_seqs.shape[1]),
              "train": [], "val": [], "halvings": [[] for _ in range(K)]}
    t0 = time.time()
    state = {"best": None, "best_params": params, "best_step": [0] * K, "bad": [0] * K,
             "params": params}

    def select(step, final=False):
        """Validation of the current parameters; new bests written; rollback + halving."""
        tv = time.time()
        vk = validate(state["params"])
        report["val"].append((step, vk.tolist()))
        if state["best"] is None:
            state["best"] = vk.copy()
            improved = list(range(K))
        else:
            improved = [i for i in range(K) if vk[i] < state["best"][i]]
        for i in range(K):
            if i in improved:
                state["best"][i], state["best_step"][i], state["bad"][i] = vk[i], step, 0
                state["best_params"] = jax.tree_util.tree_map(
                    lambda b, p: b.at[i].set(p[i]), state["best_params"], state["params"])
                if on_best:
                    on_best(i, stacked.unstack_codec(
                        jax.tree_util.tree_map(lambda a: a[i], state["params"]), widths[i]),
                        step, float(vk[i]))
            elif not final:
                state["bad"][i] += 1
                if state["bad"][i] >= 2:  # roll back to the best and halve the rate
                    state["params"] = jax.tree_util.tree_map(
                        lambda p, b: p.at[i].set(b[i]), state["params"], state["best_params"])
                    rate[i] *= 0.5
                    state["bad"][i] = 0
                    report["halvings"][i].append(step)
        log(f"step {step:4d}  {time.time() - t0:6.1f} s  validation KL{' (final)' if final else ''} "
            + "  ".join(f"G={g}: {x:.5f}{'*' if i in improved else ''}"
                        for i, (g, x) in enumerate(zip(widths, vk)))
            + f"  ({time.time() - tv:.1f} s)")
        return time.time() - tv

    t_val0 = select(0)  # includes compiling
    t_val = None  # an in-loop (compiled) validation's time
    step, tokens_seen, t_train, t_step, last_val = 0, 0, time.time(), 0.0, time.time()
    while True:
        now = time.time()
        if ((max_steps and step >= max_steps) or (seconds and step and now - t_train >= seconds)
                or (deadline and step and now + t_step + (t_val or 0.0) >= deadline)):
            break
        if pos + batch > len(order):
            order, pos = rng.permutation(len(train_seqs)), 0
        idx = np.sort(order[pos:pos + batch])
        pos += batch
        tokens = jnp.asarray(train_seqs[idx])
        ts = time.time()
        try:
            with jax.default_matmul_precision(precision):
                (_, losses), g = grad_fn(state["params"], w, tokens)
        except Exception as e:  # noqa: BLE001
            if step > 0 or not out_of_memory(e) or batch == 1:
                raise
            batch //= 2
            report["batch"] = batch
            log(f"out of memory in the first step: batches of {batch} sequences")
            continue
        losses = np.asarray(losses)
        if not np.all(np.isfinite(losses)):
            raise FloatingPointError(f"training loss {losses.tolist()} at step {step}")
        warm = min(1.0, (step + 1) / max(warmup, 1))
        state["params"], m, v = update(state["params"], m, v, g, float(step + 1),
                                       jnp.asarray(rate * warm, jnp.float32))
        step += 1
        t_step = time.time() - ts
        if step == 1:
            t_train = last_val = time.time()  # the training time counts from the compiled step
            log(f"step    1  {t_train - t0:6.1f} s  first step (compiled) train KL "
                + "  ".join(f"G={g}: {x:.5f}" for g, x in zip(widths, losses)))
        tokens_seen += int(np.prod(tokens.shape))
        report["train"].append((step, losses.tolist()))
        if step % 5 == 0:
            el = time.time() - t_train
            rate_s = (tokens_seen - tokens.shape[0] * tokens.shape[1]) / max(el, 1e-9)
            log(f"step {step:4d}  {time.time() - t0:6.1f} s  {rate_s:8.0f} tok/s  "
                "train KL " + "  ".join(f"G={g}: {x:.5f}" for g, x in zip(widths, losses)))
        if (eval_every and step % eval_every == 0) or (
                eval_seconds and time.time() - last_val >= eval_seconds):
            t_val = select(step)
            last_val = time.time()
    if report["val"][-1][0] != step:
        # A last validation if there is time for it (else the steps since the last one are
        # dropped: the best parameters so far stand).
        est = t_val if t_val is not None else t_val0
        if not deadline or time.time() + est <= deadline + grace:
            select(step, final=True)
        else:
            log(f"no time for a last validation ({est:.0f} s): steps after "
                f"{report['val'][-1][0]} not selected")
    best, best_params, best_step = state["best"], state["best_params"], state["best_step"]
    report.update({"steps": step, "tokens_per_codec": tokens_seen,
                   "train_seconds": time.time() - t_train,
                   "codecs": [{"G": g, "val_kl_init": report["val"][0][1][i],
                               "val_kl_best": float(best[i]), "best_step": best_step[i]}
                              for i, g in enumerate(widths)]})
    out = [stacked.unstack_codec(jax.tree_util.tree_map(lambda a: a[i], best_params), widths[i])
           for i in range(K)]
    return out, report


def sample_texts(c, w, train_seqs, n, prompt_len, temperature, seed):
    """n continuations, as long as the training sequences, of prompts cut from the starts of
    n training sequences drawn at random, sampled from the FP32 model (K/V cache)."""
    rng = np.random.default_rng(seed + 1)
    T = train_seqs.shape[1]
    pick = rng.choice(len(train_seqs), n, replace=n > len(train_seqs))
    prompts = train_seqs[pick, :prompt_len]
    fn = jax.jit(lambda w, p, k: stacked.sample(c, w, p, T, k, temperature))
    key = jax.random.PRNGKey(seed)
    gen = []
    for i in range(0, n, 256):
        key, sub = jax.random.split(key)
        with jax.default_matmul_precision("highest"):
            gen.append(np.asarray(fn(w, jnp.asarray(prompts[i:i + 256]), sub)))
    return np.concatenate(gen)


def load_tokens(paths, vocab):
    arrs = [np.load(p) for p in paths]
    T = {a.shape[1] for a in arrs}
    if len(T) != 1:
        raise ValueError(f"{paths}: sequences of different lengths {sorted(T)}")
    a = np.concatenate(arrs).astype(np.int32)
    if a.size and (a.min() < 0 or a.max() >= vocab):
        raise ValueError(f"{paths}: token id out of range [0, {vocab})")
    return a


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--codec", action="append", required=True)
    ap.add_argument("--train", action="append", required=True)
    ap.add_argument("--val", action="append", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--sink", type=int, default=16)
    ap.add_argument("--recent", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seconds", type=float, default=240.0)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-seconds", type=float, default=0.0)
    ap.add_argument("--val-seqs", type=int, default=64)
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sample-val", type=float, default=0.1)
    ap.add_argument("--precision", default="tensorfloat32",
                    choices=["bfloat16", "tensorfloat32", "float32", "highest"])
    ap.add_argument("--val-precision", default="highest",
                    choices=["bfloat16", "tensorfloat32", "float32", "highest"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=0,
                    help="seconds from the start after which no training step begins")
    args = ap.parse_args(argv)
    t0 = time.time()
    os.makedirs(args.out_dir, exist_ok=True)
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    c, w = model.load(args.model)
    inits, metas = [], []
    for p in args.codec:
        meta, layers = fsq.read_codec(p)
        fsq.check_codec_matches(meta, c, p)
        inits.append(layers)
        metas.append(meta)
    train_seqs = load_tokens(args.train, c.vocab_size)
    val_seqs = load_tokens(args.val, c.vocab_size)
    # Validation: a fixed spread over the split (every k-th sequence), at most --val-seqs.
    if len(val_seqs) > args.val_seqs:
        val_seqs = val_seqs[np.linspace(0, len(val_seqs) - 1, args.val_seqs).astype(int)]
    data = {"train_corpus_sequences": len(train_seqs), "val_corpus_sequences": len(val_seqs),
            "samples": 0}
    print(f"model and data in {time.time() - t0:.1f} s: {len(train_seqs)} training, "
          f"{len(val_seqs)} validation sequences of {train_seqs.shape[1]}", flush=True)
    if args.samples > 0:
        ts = time.time()
        try:
            gen = sample_texts(c, w, train_seqs, args.samples, args.prompt_len,
                               args.temperature, args.seed)
        except Exception as e:  # noqa: BLE001 (the run goes on with the corpora alone)
            gen = None
            data["samples_error"] = str(e)[:2000]
            print(f"sampling failed, training on the corpora alone: {str(e)[:2000]}", flush=True)
        if gen is not None:
            nval = int(round(args.sample_val * len(gen)))
            val_seqs = np.concatenate([val_seqs, gen[:nval]])
            train_seqs = np.concatenate([train_seqs, gen[nval:]])
            np.save(os.path.join(args.out_dir, "samples.npy"), gen.astype(np.uint16))
            data.update({"samples": len(gen), "samples_val": nval,
                         "sample_seconds": time.time() - ts, "temperature": args.temperature,
                         "prompt_len": args.prompt_len})
            print(f"sampled {len(gen)} continuations of {gen.shape[1]} tokens in "
                  f"{time.time() - ts:.1f} s ({nval} to validation)", flush=True)

    widths = [layers[0]["encoder"].shape[0] for layers in inits]
    written = {}

    def on_best(i, layers, step, vkl):
        path = os.path.join(args.out_dir, f"fsq-g{widths[i]}.st")
        src = (f"tools/fsq_finetune/train_batched.py: step {step} (validation KL {vkl:.5f}), "
               f"Adam relative lr {args.lr}, batch {args.batch} x {train_seqs.shape[1]}, sink "
               f"{args.sink} recent {args.recent}, from {os.path.basename(args.codec[i])}")
        fsq.write_codec(path, metas[i], layers, src)
        written[widths[i]] = path

    best, report = train(c, w, inits, train_seqs, val_seqs, batch=args.batch, sink=args.sink,
                         recent=args.recent, lr=args.lr, warmup=args.warmup,
                         seconds=args.seconds, max_steps=args.max_steps,
                         eval_every=args.eval_every, precision=args.precision, seed=args.seed,
                         deadline=t0 + args.deadline if args.deadline > 0 else None,
                         eval_seconds=args.eval_seconds, val_precision=args.val_precision,
                         on_best=on_best, log=lambda s: print(s, flush=True))
    report["data"] = data
    report["jax"] = jax.__version__
    report["device"] = str(jax.devices()[0])
    report["wall_seconds"] = time.time() - t0
    report["files"] = written
    with open(os.path.join(args.out_dir, "train.json"), "w") as f:
        json.dump(report, f, indent=1)
    for r in report["codecs"]:
        print(f"G={r['G']}: validation KL {r['val_kl_init']:.5f} -> {r['val_kl_best']:.5f} "
              f"(step {r['best_step']}); {written[r['G']]}", flush=True)
    print(f"{report['steps']} steps, {report['tokens_per_codec']} tokens per codec, "
          f"{report['wall_seconds']:.1f} s wall", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
