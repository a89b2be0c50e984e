"""tools/fsq_finetune on real models: the JAX forward pass against the C++ workers
(stories260K logits from kvcd_stories; SmolLM2-135M post-RoPE q/k/v from kvcd-llama --dump
when scripts/fetch-smollm2.sh has fetched it), the Hugging Face-layout reader against the
llama2.c reader, the q/k norm, and a short fine-tuning run from a codec initialized by
kvcd-calibrate fsq that lowers the training loss and does not raise the KL on a held-out
text. Needs the C++ tools built (scripts/build.sh kvcd_stories kvcd-calibrate kvcd-eval
kvcd-llama) under $KVCD_BUILD_DIR (default build/)."""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import finetune  # noqa: E402
import fsq  # noqa: E402
import model  # noqa: E402

DATA = os.environ.get("KVCD_SHARED_DATA", os.path.join(ROOT, "..", "shared", "data"))
CKPT = os.path.join(DATA, "stories260K", "stories260K.bin")
TOK = os.path.join(DATA, "stories260K", "tok512.bin")
BUILD = os.path.join(ROOT, os.environ.get("KVCD_BUILD_DIR", "build"))
SMOL = os.path.join(os.environ.get("KVCD_MODEL_CACHE", os.path.join(ROOT, ".cache", "models")),
                    "smollm2-135m-instruct")

stories = pytest.mark.skipif(not os.path.exists(CKPT), reason=f"no stories260K under {DATA}")


def tool(*parts):
    path = os.path.join(BUILD, *parts)
    assert os.access(path, os.X_OK), f"{path} not built (scripts/build.sh {parts[-1]})"
    return path


@pytest.fixture(scope="module")
def llama2c_model():
    c, w = model.load_llama2c(CKPT)
    return c, w, model.llama2c.Tokenizer(TOK, c.vocab_size)


@stories
def test_forward_matches_the_cpp_worker(llama2c_model, tmp_path):
    c, w, tok = llama2c_model
    out = tmp_path / "logits.safetensors"
    subprocess.run([tool("examples", "kvcd_stories"), "--checkpoint", CKPT,
                    "--tokenizer", TOK, "--prompt", "Lily saw a cat", "--steps", "48",
                    "--logits", str(out)], check=True, capture_output=True)
    ref = load_file(str(out))
    inputs = ref["inputs"].astype(np.int32)
    assert inputs[:len(tok.encode("Lily saw a cat"))].tolist() == tok.encode("Lily saw a cat")
    logits = np.asarray(model.forward(c, w, inputs))
    assert logits.shape == ref["logits"].shape
    np.testing.assert_allclose(logits, ref["logits"], atol=2e-3, rtol=0)
    assert (np.argmax(logits, -1) == np.argmax(ref["logits"], -1)).all()


def hf_file(path, c, w, pairing, qk_norm=None):
    """stories260K's weights as a Hugging Face-layout safetensors file (tools/
    gguf_to_safetensors.py's names and metadata); "half" permutes the q/k rows of every head
    from llama2.c's interleaved pairs to Hugging Face's (i, i + d/2)."""
    import gguf_to_safetensors as conv

    t = {"model.embed_tokens.weight": w["emb"], "model.norm.weight": w["rms_final"]}
    names = {"rms_att": "input_layernorm", "wq": "self_attn.q_proj", "wk": "self_attn.k_proj",
             "wv": "self_attn.v_proj", "wo": "self_attn.o_proj", "rms_ffn": "post_attention_layernorm",
             "w1": "mlp.gate_proj", "w3": "mlp.up_proj", "w2": "mlp.down_proj"}
    for l in range(c.n_layers):
        for k, n in names.items():
            a = np.asarray(w[k][l])
            if pairing == "half" and k in ("wq", "wk"):
                a = conv.gguf_rows_to_hf(a, c.n_heads if k == "wq" else c.n_kv_heads)
            t[f"model.layers.{l}.{n}.weight"] = a
        if qk_norm is not None:
            t[f"model.layers.{l}.self_attn.q_norm.weight"] = qk_norm[0][l]
            t[f"model.layers.{l}.self_attn.k_norm.weight"] = qk_norm[1][l]
    meta = {"kvcd.model": "llama", "kvcd.dim": str(c.dim), "kvcd.hidden_dim": str(c.hidden_dim),
            "kvcd.n_layers": str(c.n_layers), "kvcd.n_heads": str(c.n_heads),
            "kvcd.n_kv_heads": str(c.n_kv_heads), "kvcd.head_dim": str(c.head_dim),
            "kvcd.vocab_size": str(c.vocab_size), "kvcd.max_seq_len": str(c.seq_len),
            "kvcd.rope_theta": "10000.0", "kvcd.rms_eps": "1e-05", "kvcd.rope_pairing": pairing,
            "kvcd.tied_embeddings": "1", "kvcd.qk_norm": "0" if qk_norm is None else "1"}
    save_file({k: np.ascontiguousarray(v, np.float32) for k, v in t.items()}, str(path), metadata=meta)
    return str(path)


@stories
@pytest.mark.parametrize("pairing", ["interleaved", "half"])
def test_safetensors_reader_gives_the_llama2c_model(llama2c_model, tmp_path, pairing):
    c, w, tok = llama2c_model
    c2, w2 = model.load(hf_file(tmp_path / "m.st", c, w, pairing))
    assert (c2.pairing, c2.tied, c2.qk_norm, c2.n_kv_heads) == (pairing, True, False, c.n_kv_heads)
    tokens = jnp.asarray(tok.encode("Lily saw a cat and a dog in the park"))
    np.testing.assert_allclose(np.asarray(model.forward(c2, w2, tokens)),
                               np.asarray(model.forward(c, w, tokens)), atol=1e-4, rtol=0)


@stories
def test_qk_norm_is_per_head_before_rope(llama2c_model, tmp_path):
    c, w, tok = llama2c_model
    rng = np.random.default_rng(1)
    norms = [rng.uniform(0.5, 1.5, (c.n_layers, c.head_dim)).astype(np.float32) for _ in range(2)]
    c2, w2 = model.load(hf_file(tmp_path / "n.st", c, w, "interleaved", norms))
    assert c2.qk_norm
    tokens = jnp.asarray(tok.encode("Lily saw a cat and a dog in the park"))
    base = np.asarray(model.forward(c2, w2, tokens))
    assert np.abs(base - np.asarray(model.forward(c, w, tokens))).max() > 1e-2  # it does something
    # A per-head positive rescaling of the q/k projection rows is normalized away...
    scale = np.repeat(rng.uniform(0.2, 5.0, c.n_kv_heads), c.head_dim).astype(np.float32)
    w3 = dict(w2, wk=w2["wk"] * scale[None, :, None])
    np.testing.assert_allclose(np.asarray(model.forward(c2, w3, tokens)), base, atol=2e-4, rtol=0)
    # ...and the post-RoPE key of layer 0 is RoPE(k_norm ⊙ k / rms(k)) per head (a direct
    # numpy computation on the interleaved pairs).
    _, acts = model.forward(c2, w2, tokens, residuals=True)
    xb, _, k, _ = (np.asarray(a, np.float64) for a in acts[0])
    kk = (xb @ np.asarray(w2["wk"][0], np.float64).T).reshape(len(tokens), c.n_kv_heads, c.head_dim)
    kk = kk / np.sqrt((kk * kk).mean(-1, keepdims=True) + 1e-5) * norms[1][0]
    ang = np.arange(len(tokens))[:, None] * 10000.0 ** (-np.arange(0, c.head_dim, 2) / c.head_dim)
    a, b = kk[..., 0::2], kk[..., 1::2]
    cs, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]
    want = np.stack([a * cs - b * sn, a * sn + b * cs], -1).reshape(kk.shape)
    np.testing.assert_allclose(k, want, atol=1e-4, rtol=0)


@pytest.mark.skipif(not os.path.exists(os.path.join(SMOL, "model.safetensors")),
                    reason=f"no SmolLM2 under {SMOL} (scripts/fetch-smollm2.sh)")
def test_smollm2_projections_match_kvcd_llama(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("The lighthouse keeper climbed the stairs and checked the lamp.\n")
    dump = tmp_path / "d.st"
    subprocess.run([tool("examples", "kvcd-llama"), "--model", SMOL, "--dump",
                    str(dump), "--dump-text", str(text)], check=True, capture_output=True)
    ids = subprocess.run([tool("examples", "kvcd-llama"), "--model", SMOL, "--encode",
                          str(text)], check=True, capture_output=True, text=True).stdout.split()
    ref = load_file(str(dump))
    c, w = model.load(os.path.join(SMOL, "model.safetensors"))
    assert (c.pairing, c.tied, c.n_heads // c.n_kv_heads) == ("half", True, 3)
    _, acts = model.forward(c, w, jnp.asarray([int(i) for i in ids]), residuals=True)
    assert ref["layers.0.k"].shape[0] == len(ids)
    for l in (0, c.n_layers // 2, c.n_layers - 1):
        for j, name in ((1, "q"), (2, "k"), (3, "v")):
            got, want = np.asarray(acts[l][j]), ref[f"layers.{l}.{name}"]
            scale = np.abs(want).max()
            np.testing.assert_allclose(got, want, atol=2e-3 * scale, rtol=0,
                                       err_msg=f"layer {l} {name}")


def test_straight_through_code_is_the_documented_fsq():
    u = jnp.asarray([-100.0, -1.0, -1 / 3, 0.0, 1 / 3, 0.5, 1.0, 100.0])
    z = np.asarray(fsq.fsq_code(u))
    t = 7.5075 * np.tanh(np.asarray(u, np.float64) + np.arctanh(0.5 / 7.5075)) - 0.5
    np.testing.assert_array_equal(z, np.clip(np.round(t), -8, 7))
    g = np.asarray(jax.grad(lambda x: jnp.sum(fsq.fsq_code(x)))(u))
    np.testing.assert_allclose(g, 7.5075 / np.cosh(np.asarray(u) + np.arctanh(0.5 / 7.5075)) ** 2,
                               rtol=1e-5, atol=1e-30)


@stories
def test_finetuning_lowers_the_loss_and_the_heldout_kl(llama2c_model, tmp_path):
    """A codec initialized on one text (G = 32, 8x), fine-tuned a few deterministic steps on
    other texts (bench/text/stories-train.txt) with validation on a third
    (stories-val.txt): the training loss goes down, and on held-out text B (greedy from
    "Tom had a big dog", as in bench/results/2026-12-04-fsq-finetune.md) the KL after is at
    most the KL before."""
    c, w, tok = llama2c_model
    dump, weights, init = (tmp_path / n for n in ("dump.st", "weights.st", "init.st"))
    subprocess.run([tool("examples", "kvcd_stories"), "--checkpoint", CKPT,
                    "--tokenizer", TOK, "--steps", "256", "--dump", str(dump),
                    "--dump-prompts", "Once upon a time", "--weights", str(weights)],
                   check=True, capture_output=True)
    subprocess.run([tool("tools", "kvcd-calibrate"), "fsq", "--dump", str(dump), "--weights",
                    str(weights), "--latent", "32", "--out", str(init)], check=True,
                   capture_output=True)
    meta, layers = fsq.read_codec(str(init))
    fsq.check_codec_matches(meta, c, str(init))
    text = os.path.join(ROOT, "bench", "text")
    train_seqs = finetune.sequences([f"text:{text}/stories-train.txt"], c, w, tok, 128)
    val_seqs = finetune.sequences([f"text:{text}/stories-val.txt"], c, w, tok, 128)
    heldout = finetune.sequences(["prompt:Tom had a big dog"], c, w, tok, 128)
    tuned, hist = finetune.train(c, w, train_seqs, layers, steps=16, lr=5e-4, sink=4, recent=8,
                                 val_seqs=val_seqs, decay=0.0, eval_every=4, log=None)
    assert hist["train"][0] > 0
    assert hist["train"][-1] < hist["train"][0], hist["train"]
    assert hist["best_step"] > 0, hist["val"]  # the validation KL went down too
    before = finetune.evaluate(c, w, heldout, layers, 4, 8)["kl_mean"]
    after = finetune.evaluate(c, w, heldout, tuned, 4, 8)["kl_mean"]
    assert after <= before, (before, after)
    out = tmp_path / "tuned.st"
    fsq.write_codec(str(out), meta, tuned, "test")
    meta2, back = fsq.read_codec(str(out))
    assert meta2["latent_width"] == "32" and meta2["key_norm"] == "none"
    np.testing.assert_array_equal(back[2]["decoder_v"], tuned[2]["decoder_v"])
    # The C++ reader accepts it and evaluates it on the dump.
    r = subprocess.run([tool("tools", "kvcd-eval"), "--dump", str(dump), "--codec",
                        f"tuned={out}", "--sink", "4", "--recent", "8", "--rope-pairing",
                        "interleaved", "--positions", "4"], check=True, capture_output=True,
                       text=True)
    assert "tuned" in r.stdout


def test_codec_with_key_norm_round_trips_and_is_applied(tmp_path):
    """A key-norm codec (Qwen3-style) is written with key_norm = rms and its weights, read
    back, and the history rebuild normalizes each head's key before RoPE."""
    c = model.Config(dim=12, hidden_dim=8, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=6,
                     vocab_size=5, seq_len=16, pairing="half", qk_norm=True)
    rng = np.random.default_rng(3)
    G = 5
    layer = {"encoder": rng.standard_normal((G, 12)), "encoder_bias": rng.standard_normal(G),
             "decoder_k": rng.standard_normal((12, G)), "decoder_v": rng.standard_normal((12, G)),
             "bias_k": rng.standard_normal(12), "bias_v": rng.standard_normal(12),
             "key_norm": rng.uniform(0.5, 2, 6)}
    layer = {k: v.astype(np.float32) for k, v in layer.items()}
    meta = {"num_layers": 1, "residual_width": 12, "latent_width": G, "num_kv_heads": 2,
            "head_dim": 6}
    path = str(tmp_path / "kn.st")
    fsq.write_codec(path, meta, [layer], "test")
    meta2, back = fsq.read_codec(path)
    assert meta2["key_norm"] == "rms"
    fsq.check_codec_matches(meta2, c, path)
    np.testing.assert_array_equal(back[0]["key_norm"], layer["key_norm"])
    x = rng.standard_normal((3, 12)).astype(np.float32)
    k, _ = fsq.make_history(c, [back[0]])(0, jnp.asarray(x), model.rope_tables(c, 3))
    z = np.asarray(fsq.fsq_code(jnp.asarray(x @ layer["encoder"].T + layer["encoder_bias"])))
    raw = (z @ layer["decoder_k"].T + layer["bias_k"]).reshape(3, 2, 6).astype(np.float64)
    kn = raw / np.sqrt((raw * raw).mean(-1, keepdims=True) + 1e-5) * layer["key_norm"]
    ang = np.arange(3)[:, None] * 10000.0 ** (-np.arange(3) * 2 / 6)
    cs, sn = np.cos(ang)[:, None], np.sin(ang)[:, None]
    a, b = kn[..., :3], kn[..., 3:]
    want = np.concatenate([a * cs - b * sn, a * sn + b * cs], -1).reshape(3, 12)
    np.testing.assert_allclose(np.asarray(k), want, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="key_norm"):
        fsq.check_codec_matches(meta2, model.Config(12, 8, 1, 4, 2, 6, 5, 16), path)
