"""The connector's counters, where vLLM collects connector stats: the periodic "KV Transfer
metrics" log line and, on the OpenAI server, Prometheus counters ``vllm:kvcd_*`` (the
daemon's own ``/metrics`` counts the same hits and bytes on its side).

Scheduler side: ``queried_tokens`` (prompt tokens looked up in kvcd) and ``hit_tokens``
(tokens the engine took from kvcd). Worker side: ``loaded_tokens``/``load_bytes``/
``load_seconds``, ``failed_load_blocks``, ``saved_tokens``/``save_bytes``/``save_seconds``,
``failed_saves`` and ``dropped_saves`` (queued beyond ``max_pending_save_bytes``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = ("queried_tokens", "hit_tokens", "loaded_tokens", "load_bytes", "load_seconds",
            "failed_load_blocks", "saved_tokens", "save_bytes", "save_seconds", "failed_saves",
            "dropped_saves")


@dataclass
class KvcdConnectorStats(KVConnectorStats):

    def __post_init__(self) -> None:
        for key in COUNTERS:
            self.data.setdefault(key, 0)

    def add(self, **counts: float) -> None:
        for key, value in counts.items():
            self.data[key] += value

    def reset(self) -> None:
        self.data = {key: 0 for key in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> "KvcdConnectorStats":
        for key in COUNTERS:
            self.data[key] += other.data.get(key, 0)
        return self

    def reduce(self) -> Dict[str, Any]:
        d = dict(self.data)
        d["load_MBps"] = round(d["load_bytes"] / d["load_seconds"] / 1e6, 1) \
            if d["load_seconds"] else 0.0
        d["save_MBps"] = round(d["save_bytes"] / d["save_seconds"] / 1e6, 1) \
            if d["save_seconds"] else 0.0
        d["load_seconds"] = round(d["load_seconds"], 4)
        d["save_seconds"] = round(d["save_seconds"], 4)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.get(key) for key in COUNTERS)

    def take(self) -> "KvcdConnectorStats | None":
        """A copy for vLLM (None when nothing happened); the counters restart at zero."""
        if self.is_empty():
            return None
        out = KvcdConnectorStats(data=dict(self.data))
        self.reset()
        return out


class KvcdPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per connector counter, ``vllm:kvcd_<name>_total``."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for key in COUNTERS:
            metric = self._counter_cls(name=f"vllm:kvcd_{key}",
                                       documentation=f"kvcd connector: {key.replace('_', ' ')}",
                                       labelnames=labelnames)
            self.counters[key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for key in COUNTERS:
            value = transfer_stats_data.get(key, 0)
            if value:
                self.counters[key][engine_idx].inc(value)
