"""tools/fsq_finetune/stacked.py and train_batched.py (the accelerator trainer) on the CPU:
the scanned, batched forward pass against model.forward (exact and with a padded FSQ
history), the K/V-cache greedy decoding against model.greedy, padding that leaves a codec
unchanged, and a CI-sized training run of two codecs side by side (stories260K, codecs
initialized by kvcd-calibrate fsq) that lowers the training loss and writes, per codec, a
selection whose held-out KL is no higher than the initialization's. Needs the C++ tools
built (scripts/build.sh kvcd_stories kvcd-calibrate) under $KVCD_BUILD_DIR (default
build/)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))

import finetune  # noqa: E402
import fsq  # noqa: E402
import model  # noqa: E402
import stacked  # noqa: E402
import train_batched  # noqa: E402

DATA = os.environ.get("KVCD_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))
CKPT = os.path.join(DATA, "stories260K", "stories260K.bin")
TOK = os.path.join(DATA, "stories260K", "tok512.bin")
BUILD = os.path.join(ROOT, os.environ.get("KVCD_BUILD_DIR", "build"))

pytestmark = pytest.mark.skipif(not os.path.exists(CKPT), reason=f"no stories260K under {DATA}")


def tool(*parts):
    path = os.path.join(BUILD, *parts)
    assert os.access(path, os.X_OK), f"{path} not built (scripts/build.sh {parts[-1]})"
    return path


@pytest.fixture(scope="module")
def stories():
    c, w = model.load_llama2c(CKPT)
    return c, w, model.llama2c.Tokenizer(TOK, c.vocab_size)


def random_codec(c, G, rng):
    f = np.float32
    return [{"encoder": (rng.standard_normal((G, c.dim)) * 0.3).astype(f),
             "encoder_bias": (rng.standard_normal(G) * 0.1).astype(f),
             "decoder_k": (rng.standard_normal((c.kv_dim, G)) * 0.1).astype(f),
             "decoder_v": (rng.standard_normal((c.kv_dim, G)) * 0.1).astype(f),
             "bias_k": (rng.standard_normal(c.kv_dim) * 0.1).astype(f),
             "bias_v": (rng.standard_normal(c.kv_dim) * 0.1).astype(f)} for _ in range(c.n_layers)]


def test_scanned_forward_matches_the_model(stories):
    c, w, _ = stories
    rng = np.random.default_rng(0)
    toks = rng.integers(0, c.vocab_size, (2, 40)).astype(np.int32)
    ref = np.stack([np.asarray(model.forward(c, w, jnp.asarray(t))) for t in toks])
    np.testing.assert_allclose(np.asarray(stacked.forward(c, w, jnp.asarray(toks))), ref,
                               atol=2e-4, rtol=0)
    layers = random_codec(c, 12, rng)
    hist = fsq.make_history(c, finetune.to_params(layers))
    ref = np.stack([np.asarray(model.forward(c, w, jnp.asarray(t), hist, 4, 8)) for t in toks])
    assert np.abs(ref - np.stack([np.asarray(model.forward(c, w, jnp.asarray(t))) for t in toks])).max() > 1e-2
    # Padded from 12 to 20 latent coordinates, with and without rematerialization.
    st = jax.tree_util.tree_map(jnp.asarray, stacked.stack_codec(layers, 20))
    for remat in (False, True):
        got = np.asarray(stacked.forward(c, w, jnp.asarray(toks), st, 4, 8, remat=remat))
        np.testing.assert_allclose(got, ref, atol=2e-4, rtol=0)
    back = stacked.unstack_codec(stacked.stack_codec(layers, 20), 12)
    for a, b in zip(back, layers):
        for k in a:
            np.testing.assert_array_equal(a[k], b[k])
    # Hugging Face's RoPE pairing (SmolLM2's) on the same weights, and a 3:1 GQA.
    import dataclasses

    for c2 in (dataclasses.replace(c, pairing="half"),):
        ref = np.stack([np.asarray(model.forward(c2, w, jnp.asarray(t), fsq.make_history(
            c2, finetune.to_params(layers)), 4, 8)) for t in toks])
        got = np.asarray(stacked.forward(c2, w, jnp.asarray(toks), st, 4, 8))
        np.testing.assert_allclose(got, ref, atol=2e-4, rtol=0)
    # The padding's code is exactly 0.
    z = np.asarray(fsq.fsq_code(jnp.zeros(8)))
    np.testing.assert_array_equal(z, np.zeros(8))


def test_kv_cache_greedy_matches_the_model(stories):
    c, w, tok = stories
    prompts = [tok.encode("Once upon a time"), tok.encode("Tom had a big dog")]
    P = min(map(len, prompts))
    prompts = [p[:P] for p in prompts]
    want = model.greedy(c, w, prompts, 40)
    got = np.asarray(stacked.sample(c, w, jnp.asarray(np.asarray(prompts, np.int32)), 40,
                                    jax.random.PRNGKey(0), temperature=0.0))
    np.testing.assert_array_equal(got, want)
    s = np.asarray(stacked.sample(c, w, jnp.asarray(np.asarray(prompts, np.int32)), 40,
                                  jax.random.PRNGKey(1), temperature=1.0))
    np.testing.assert_array_equal(s[:, :P], np.asarray(prompts))
    assert s.min() >= 0 and s.max() < c.vocab_size


def test_batched_training_lowers_the_loss_and_the_heldout_kl(stories, tmp_path):
    """Codecs G = 32 and 16 initialized on one text, trained side by side a few steps on
    other texts (bench/text/stories-train.txt, 64-token sequences, batches of 8) with
    selection on stories-val.txt; held out: the greedy text from "Tom had a big dog"."""
    c, w, tok = stories
    dump, weights = tmp_path / "dump.st", tmp_path / "weights.st"
    subprocess.run([tool("examples", "kvcd_stories"), "--checkpoint", CKPT, "--tokenizer", TOK,
                    "--steps", "256", "--dump", str(dump), "--dump-prompts", "Once upon a time",
                    "--weights", str(weights)], check=True, capture_output=True)
    inits = []
    for g in (32, 16):
        out = tmp_path / f"g{g}.st"
        subprocess.run([tool("tools", "kvcd-calibrate"), "fsq", "--dump", str(dump), "--weights",
                        str(weights), "--latent", str(g), "--out", str(out)], check=True,
                       capture_output=True)
        inits.append(fsq.read_codec(str(out)))
    text = os.path.join(ROOT, "bench", "text")

    def block(specs, T):
        ids = np.concatenate(finetune.sequences(specs, c, w, tok, 512))
        n = len(ids) // T
        return ids[:n * T].reshape(n, T)

    train_seqs = block([f"text:{text}/stories-train.txt"], 64)
    val_seqs = block([f"text:{text}/stories-val.txt"], 64)
    best_calls = []
    tuned, rep = train_batched.train(
        c, w, [layers for _, layers in inits], train_seqs, val_seqs, batch=8, sink=4, recent=8,
        lr=2e-2, warmup=2, seconds=0, max_steps=12, eval_every=4, precision="highest",
        on_best=lambda i, layers, step, v: best_calls.append((i, step, v)), log=None)
    assert rep["steps"] == 12 and len(rep["train"]) == 12
    for i in range(2):
        curve = [losses[i] for _, losses in rep["train"]]
        assert np.mean(curve[-3:]) < np.mean(curve[:3]), (i, curve)
        r = rep["codecs"][i]
        assert r["val_kl_best"] <= r["val_kl_init"]
        assert r["best_step"] > 0, rep["val"]  # the validation KL went down
    assert sorted({i for i, step, _ in best_calls if step == 0}) == [0, 1]
    heldout = finetune.sequences(["prompt:Tom had a big dog"], c, w, tok, 128)
    for (meta, init), got, g in zip(inits, tuned, (32, 16)):
        assert got[0]["encoder"].shape == (g, c.dim)
        before = finetune.evaluate(c, w, heldout, init, 4, 8)["kl_mean"]
        after = finetune.evaluate(c, w, heldout, got, 4, 8)["kl_mean"]
        assert after <= before, (g, before, after)
        path = tmp_path / f"tuned{g}.st"
        fsq.write_codec(str(path), meta, got, "test")
        assert fsq.read_codec(str(path))[0]["latent_width"] == str(g)
