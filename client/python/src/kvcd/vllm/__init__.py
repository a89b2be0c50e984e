"""kvcd as vLLM's KV store: a vLLM V1 KV connector (needs ``vllm``; not imported by
``import kvcd``).

    --kv-transfer-config '{"kv_connector": "KvcdConnector",
                           "kv_connector_module_path": "kvcd.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"target": "127.0.0.1:50051",
                                                         "history_format": "bf16"}}'

:mod:`kvcd.vllm.config` lists the ``kv_connector_extra_config`` keys. On a CUDA engine the blocks can move through kvcd's
CUDA IPC data plane (``"transport": "cuda_ipc"``, opt-in: :mod:`kvcd.vllm.transfer`).

``KvcdConnector`` is imported on first use, so that the vLLM-free parts (the worker side's
transfers, :mod:`kvcd.vllm.worker`) can be used where vLLM is not installed.
"""
from typing import Any

__all__ = ["KvcdConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvcdConnector":
        from .connector import KvcdConnector
        return KvcdConnector
    raise AttributeError(f"module 'kvcd.vllm' has no attribute '{name}'")
