"""The connector's settings: ``kv_connector_extra_config`` parsed and checked.

Every key is optional; an unknown key or a value of the wrong kind raises ``ValueError``
naming the key and what was expected, before the engine starts.

=========================  ==========================================================
key                        meaning (default)
=========================  ==========================================================
``target``                 daemon address ``HOST:PORT`` (``$KVCD_TARGET``, else
                           ``127.0.0.1:50051``)
``tls_root_certificates``  PEM path of the CA; with it the channel is TLS (off)
``tls_client_certificate`` / ``tls_client_key``: mTLS pair (none)
``tls_server_name``        name checked in the daemon's certificate (the target's host)
``token`` / ``token_env``  bearer token, or the variable holding it (none)
``model``                  model name in kvcd (``vllm-<served name>-<format>``, sanitized)
``cache_salt``             tenant namespace of the cached prefixes (``""``: default)
``tenant``                 tenant the model registration counts against (``""``)
``history_format``         ``bf16``, ``int2-oscar`` or ``int2-transform`` (``bf16``)
``codec``                  INT2 rotations: ``hadamard`` or ``identity`` (``hadamard``)
``codec_file``             codec safetensors sent with the registration; a version-3
                           file is required by (and selects) ``int2-transform``
``sink_tokens``            BF16 sink of the registered model, whole blocks (one block)
``recent_tokens``          BF16 recent window of the registered model (0)
``memory_bytes``           the model's share of the daemon's memory (256 MiB)
``timeout_s``              deadline of a load or save call (5.0)
``match_timeout_s``        deadline of the scheduler's Match (1.0)
``backoff_s``              after the daemon failed, how long it is skipped (5.0)
``load`` / ``save``        fetch matched blocks / store computed blocks (true / true)
``max_pending_save_bytes`` saves queued beyond this are dropped, not waited for (1 GiB)
``fetch_chunk_tokens``     tokens per FetchPages call, a multiple of the block size
``transport``              how blocks move: ``inline`` (bytes in the gRPC messages, the
                           default), ``cuda_ipc`` (CUDA IPC buffers on the engine's GPU
                           and a daemon on ``backend: cuda`` on that GPU, or fail) or
                           ``auto`` (CUDA IPC when the caches are CUDA tensors and the
                           daemon accepts the buffers, else inline). The IPC path is
                           opt-in (run on one GPU: engine and daemon on the same card)
``ipc_save_bytes``         with CUDA IPC: the save buffer on the engine's GPU; saves that
                           do not fit while earlier ones are stored go inline (1 GiB)
                           (as many blocks as fit in 64 MiB)
=========================  ==========================================================
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional

FORMATS = ("bf16", "int2-oscar", "int2-transform")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")

_DEFAULTS: Dict[str, Any] = {
    "target": None, "tls_root_certificates": None, "tls_client_certificate": None,
    "tls_client_key": None, "tls_server_name": None, "token": None, "token_env": None,
    "model": None, "cache_salt": "", "tenant": "", "history_format": "bf16",
    "codec": "hadamard", "codec_file": None, "sink_tokens": None, "recent_tokens": 0,
    "memory_bytes": 256 << 20, "timeout_s": 5.0, "match_timeout_s": 1.0, "backoff_s": 5.0,
    "load": True, "save": True, "max_pending_save_bytes": 1 << 30,
    "fetch_chunk_tokens": None, "transport": "inline", "ipc_save_bytes": 1 << 30,
}
TRANSPORTS = ("inline", "cuda_ipc", "auto")


@dataclass(frozen=True)
class ConnectorConfig:
    target: str
    tls_root_certificates: Optional[str]
    tls_client_certificate: Optional[str]
    tls_client_key: Optional[str]
    tls_server_name: Optional[str]
    token: Optional[str]
    model: str
    cache_salt: str
    tenant: str
    history_format: str
    codec: str
    codec_file: Optional[str]
    sink_tokens: int
    recent_tokens: int
    memory_bytes: int
    timeout_s: float
    match_timeout_s: float
    backoff_s: float
    load: bool
    save: bool
    max_pending_save_bytes: int
    fetch_chunk_tokens: Optional[int]
    transport: str = "inline"
    ipc_save_bytes: int = 1 << 30


def _kind(key: str, value: Any, kind: type) -> Any:
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(f"kvcd connector: kv_connector_extra_config['{key}'] is "
                         f"{value!r}, expected a {kind.__name__}")
    return value


def default_model_name(served_model: str, history_format: str) -> str:
    """``vllm-<last path component of the served model>-<format>``, cut to 64 characters
    of ``[A-Za-z0-9._-]``."""
    base = re.sub(r"[^A-Za-z0-9._-]", "-", os.path.basename(served_model.rstrip("/")))
    return f"vllm-{base}"[:64 - len(history_format) - 1] + "-" + history_format


def parse(extra: Optional[Mapping[str, Any]], *, served_model: str,
          block_size: int) -> ConnectorConfig:
    """Checks ``kv_connector_extra_config`` and fills the defaults."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"kvcd connector: unknown kv_connector_extra_config key(s) {unknown}; "
                         f"known keys: {sorted(_DEFAULTS)}")
    v = {**_DEFAULTS, **{k: x for k, x in extra.items() if x is not None}}
    for key in ("target", "tls_root_certificates", "tls_client_certificate", "tls_client_key",
                "tls_server_name", "token", "token_env", "model", "codec_file"):
        if v[key] is not None:
            _kind(key, v[key], str)
    for key in ("cache_salt", "tenant", "history_format", "codec", "transport"):
        _kind(key, v[key], str)
    for key in ("recent_tokens", "memory_bytes", "max_pending_save_bytes"):
        if _kind(key, v[key], int) < 0:
            raise ValueError(f"kvcd connector: {key} is {v[key]}, expected >= 0")
    for key in ("timeout_s", "match_timeout_s", "backoff_s"):
        if _kind(key, v[key], float) <= 0 and key != "backoff_s":
            raise ValueError(f"kvcd connector: {key} is {v[key]}, expected > 0")
    for key in ("load", "save"):
        _kind(key, v[key], bool)
    if v["transport"] not in TRANSPORTS:
        raise ValueError(f"kvcd connector: transport '{v['transport']}', expected one of "
                         f"{TRANSPORTS}")
    if _kind("ipc_save_bytes", v["ipc_save_bytes"], int) < 1 << 20:
        raise ValueError(f"kvcd connector: ipc_save_bytes is {v['ipc_save_bytes']}, expected "
                         f">= 1 MiB (1048576)")
    fmt = v["history_format"]
    if fmt not in FORMATS:
        raise ValueError(f"kvcd connector: history_format '{fmt}', expected one of {FORMATS}")
    if fmt == "int2-transform" and not v["codec_file"]:
        raise ValueError("kvcd connector: history_format 'int2-transform' needs codec_file "
                         "(a version-3 codec file, docs/formats.md)")
    if v["codec"] not in ("hadamard", "identity"):
        raise ValueError(f"kvcd connector: codec '{v['codec']}', expected 'hadamard' or "
                         f"'identity'")
    if v["codec_file"] and not os.path.isfile(v["codec_file"]):
        raise ValueError(f"kvcd connector: codec_file '{v['codec_file']}' is not a file")
    sink = block_size if v["sink_tokens"] is None else _kind("sink_tokens", v["sink_tokens"], int)
    if sink < 0 or sink % block_size:
        raise ValueError(f"kvcd connector: sink_tokens is {sink}, expected a multiple of the "
                         f"block size {block_size}")
    chunk = v["fetch_chunk_tokens"]
    if chunk is not None and (_kind("fetch_chunk_tokens", chunk, int) <= 0
                              or chunk % block_size):
        raise ValueError(f"kvcd connector: fetch_chunk_tokens is {chunk}, expected a positive "
                         f"multiple of the block size {block_size}")
    token = v["token"]
    if token is None and v["token_env"]:
        token = os.environ.get(v["token_env"])
        if not token:
            raise ValueError(f"kvcd connector: token_env names ${v['token_env']}, which is "
                             f"unset or empty")
    model = v["model"] or default_model_name(served_model, fmt)
    if not _NAME.match(model):
        raise ValueError(f"kvcd connector: model '{model}', expected 1 to 64 characters of "
                         f"[A-Za-z0-9._-]")
    target = v["target"] or os.environ.get("KVCD_TARGET") or "127.0.0.1:50051"
    return ConnectorConfig(
        target=target, tls_root_certificates=v["tls_root_certificates"],
        tls_client_certificate=v["tls_client_certificate"], tls_client_key=v["tls_client_key"],
        tls_server_name=v["tls_server_name"], token=token, model=model,
        cache_salt=v["cache_salt"], tenant=v["tenant"], history_format=fmt, codec=v["codec"],
        codec_file=v["codec_file"], sink_tokens=sink, recent_tokens=v["recent_tokens"],
        memory_bytes=v["memory_bytes"], timeout_s=v["timeout_s"],
        match_timeout_s=v["match_timeout_s"], backoff_s=v["backoff_s"], load=v["load"],
        save=v["save"], max_pending_save_bytes=v["max_pending_save_bytes"],
        fetch_chunk_tokens=chunk, transport=v["transport"], ipc_save_bytes=v["ipc_save_bytes"])
