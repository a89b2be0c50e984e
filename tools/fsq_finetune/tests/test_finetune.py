"""tools/fsq_finetune on the real stories260K model (../shared/data/stories260K, read only):
the JAX forward pass against the C++ worker's logits, and a few fine-tuning steps from a
codec initialized by kvcd-calibrate fsq (the loss goes down; the written file loads in
kvcd-eval). Needs the C++ tools built (scripts/build.sh kvcd_stories kvcd-calibrate
kvcd-eval) under $KVCD_BUILD_DIR (default build/)."""
import os
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))

import finetune  # noqa: E402
import fsq  # noqa: E402
import llama2  # noqa: E402

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
def model():
    c, w = llama2.load_checkpoint(CKPT)
    return c, w, llama2.Tokenizer(TOK, c.vocab_size)


def test_forward_matches_the_cpp_worker(model, tmp_path):
    c, w, tok = model
    out = tmp_path / "logits.safetensors"
    subprocess.run([tool("client", "examples", "kvcd_stories"), "--checkpoint", CKPT,
                    "--tokenizer", TOK, "--prompt", "Lily saw a cat", "--steps", "48",
                    "--logits", str(out)], check=True, capture_output=True)
    ref = load_file(str(out))
    inputs = ref["inputs"].astype(np.int32)
    assert inputs[:len(tok.encode("Lily saw a cat"))].tolist() == tok.encode("Lily saw a cat")
    logits = np.asarray(llama2.forward(c, w, inputs))
    assert logits.shape == ref["logits"].shape
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-3, rtol=0)
    assert (np.argmax(logits, -1) == np.argmax(ref["logits"], -1)).all()


def test_straight_through_code_is_the_documented_fsq():
    import jax
    import jax.numpy as jnp
    u = jnp.asarray([-100.0, -1.0, -1 / 3, 0.0, 1 / 3, 0.5, 1.0, 100.0])
    z = np.asarray(fsq.fsq_code(u))
    t = 7.5075 * np.tanh(np.asarray(u, np.float64) + np.arctanh(0.5 / 7.5075)) - 0.5
    np.testing.assert_array_equal(z, np.clip(np.round(t), -8, 7))
    g = np.asarray(jax.grad(lambda x: jnp.sum(fsq.fsq_code(x)))(u))
    np.testing.assert_allclose(g, 7.5075 / np.cosh(np.asarray(u) + np.arctanh(0.5 / 7.5075)) ** 2,
                               rtol=1e-5, atol=1e-30)


def test_finetuning_lowers_the_loss_and_writes_a_loadable_codec(model, tmp_path):
    c, w, tok = model
    dump, weights, init = (tmp_path / n for n in ("dump.st", "weights.st", "init.st"))
    subprocess.run([tool("client", "examples", "kvcd_stories"), "--checkpoint", CKPT,
                    "--tokenizer", TOK, "--steps", "128", "--dump", str(dump),
                    "--dump-prompts", "Once upon a time", "--weights", str(weights)],
                   check=True, capture_output=True)
    subprocess.run([tool("tools", "kvcd-calibrate"), "fsq", "--dump", str(dump), "--weights",
                    str(weights), "--latent", "16", "--out", str(init)], check=True,
                   capture_output=True)
    meta, layers = fsq.read_codec(str(init))
    tokens = llama2.greedy(c, w, tok.encode("Once upon a time"), 96)
    tuned, losses = finetune.train(c, w, tokens, layers, steps=6, lr=2e-3, sink=4, recent=8,
                                   log=None)
    assert losses[0] > 0
    assert min(losses[1:]) < losses[0], losses
    out = tmp_path / "tuned.st"
    fsq.write_codec(str(out), meta, tuned, "test")
    meta2, back = fsq.read_codec(str(out))
    assert meta2["latent_width"] == "16"
    np.testing.assert_array_equal(back[2]["decoder_v"], tuned[2]["decoder_v"])
    assert any(not np.array_equal(a["encoder"], b["encoder"]) for a, b in zip(layers, back))
    # The C++ reader accepts it and evaluates it on the dump.
    r = subprocess.run([tool("tools", "kvcd-eval"), "--dump", str(dump), "--codec",
                        f"tuned={out}", "--sink", "4", "--recent", "8", "--rope-pairing",
                        "interleaved", "--positions", "4"], check=True, capture_output=True,
                       text=True)
    assert "tuned" in r.stdout
