"""kvcd as vLLM's KV store: a vLLM V1 KV connector (needs ``vllm``; not imported by
``import kvcd``).

    --kv-transfer-config '{"kv_connector": "KvcdConnector",
                           "kv_connector_module_path": "kvcd.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"target": "127.0.0.1:50051",
                                                         "history_format": "bf16"}}'

:mod:`kvcd.vllm.config` lists the ``kv_connector_extra_config`` keys.
"""
from .connector import KvcdConnector

__all__ = ["KvcdConnector"]
