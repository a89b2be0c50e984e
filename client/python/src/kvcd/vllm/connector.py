"""``KvcdConnector``: kvcd as vLLM's KV store (a ``KVConnectorBase_V1``).

Scheduler side: a new request's prompt is matched against kvcd (``Match``, whole blocks,
kvcd's page size = the engine's block size); the engine allocates blocks for the hit and
the step's metadata says which blocks to load and which freshly computed prompt blocks to
store. Worker side (:mod:`kvcd.vllm.worker`): before the forward, the matched blocks are
fetched (``OpenSequence`` + ``FetchPages``, in chunks) and written into the engine's blocks;
after it, the new blocks are copied out and stored with one ``Put`` per request (all layers;
the registered model's history format decides how kvcd stores them) on a background
thread, so a slow daemon never holds the forward. The bytes travel in the messages; on a
CUDA engine with ``transport: cuda_ipc`` (opt-in; run on one H100: bench/results/2026-12-05-vllm-gpu.md) through CUDA IPC
buffers on its GPU, device to device (:mod:`kvcd.vllm.transfer`).

A load that fails (the daemon gone, the prefix evicted in between, the deadline passed)
reports its blocks through ``get_block_ids_with_load_errors``: with
``kv_load_failure_policy: "recompute"`` vLLM recomputes them. After a transport failure the
connector skips kvcd for ``backoff_s`` (matches answer 0, saves are counted as failed).
"""
from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvcd

from . import config as config_mod
from . import layout
from .plan import KvcdConnectorMetadata, Planner
from .stats import KvcdConnectorStats, KvcdPromMetrics
from .store import Store, geometry_of
from .worker import WorkerTransfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvcd.vllm")


class KvcdConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        self.geometry = geometry_of(vllm_config)
        self.cfg = config_mod.parse(ktc.kv_connector_extra_config,
                                    served_model=vllm_config.model_config.served_model_name
                                    if isinstance(vllm_config.model_config.served_model_name,
                                                  str) else vllm_config.model_config.model,
                                    block_size=self.geometry.block_size)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvcd connector: kv_load_failure_policy is '%s'; a failed kvcd load "
                        "then fails the request. Set \"kv_load_failure_policy\": "
                        "\"recompute\" to recompute instead", ktc.kv_load_failure_policy)
        self._stats = KvcdConnectorStats()  # since vLLM last took them
        self.totals = KvcdConnectorStats()  # since the start
        self._stats_lock = threading.Lock()
        bs = self.geometry.block_size
        if role == KVConnectorRole.SCHEDULER:
            self.store = Store(self.cfg, self.geometry, timeout=self.cfg.match_timeout_s)
            self.planner = Planner(bs, load=self.cfg.load, save=self.cfg.save)
        else:
            self.store = Store(self.cfg, self.geometry, timeout=self.cfg.timeout_s)
            self.worker = WorkerTransfers(self.store, self._count)
        # Register (or check) the model now when the daemon is up; else on first use.
        if self.store.available():
            try:
                self.store.ensure_model()
            except kvcd.KvcdError as e:
                self.store.failed("model registration", e)

    def _count(self, **counts: float) -> None:
        with self._stats_lock:
            self._stats.add(**counts)
            self.totals.add(**counts)

    def _salt(self, request: "Request") -> str:
        return getattr(request, "cache_salt", None) or self.cfg.cache_salt

    # -- scheduler side -----------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[Optional[int], bool]:
        prompt = list(request.prompt_token_ids or [])
        if len(prompt) <= self.geometry.block_size or not (self.cfg.load or self.cfg.save):
            return 0, False
        salt = self._salt(request)
        hit = self.store.match(prompt, salt)
        self._count(queried_tokens=len(prompt))
        return self.planner.matched(request.request_id, prompt, salt, hit,
                                    num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        self.planner.allocated(request.request_id, list(blocks.get_block_ids()[0]),
                               num_external_tokens)
        self._count(hit_tokens=num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.planner.step(scheduler_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, Optional[dict[str, Any]]]:
        # The prompt's blocks were stored as they were computed (wait_for_save copies
        # them out before the step returns), so the engine may free them at once.
        self.planner.finished(request.request_id)
        return False, None

    # -- worker side --------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        g = self.geometry
        ordered = layout.ordered_layers(kv_caches)
        for name, cache in ordered:
            layout.check_layer(name, cache, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                               block_size=g.block_size)
        if len(ordered) != g.num_layers:
            raise ValueError(f"kvcd connector: {len(ordered)} attention layers registered, "
                             f"the model has {g.num_layers}")
        self.worker.set_layers([cache for _, cache in ordered])

    def _layers_from(self, forward_context: "ForwardContext") -> None:
        if self.worker.layers:
            return
        caches = {name: layer.kv_cache for name, layer in
                  forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None}
        self.register_kv_caches(caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcdConnectorMetadata)
        if meta.loads:
            self._layers_from(forward_context)
        for spec in meta.loads:
            self.worker.load(spec)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # every load completed in start_load_kv, before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        return  # all layers of a request are stored together in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcdConnectorMetadata)
        if not meta.saves:
            return
        if not self.worker.layers:
            from vllm.forward_context import get_forward_context
            self._layers_from(get_forward_context())
        for spec in meta.saves:
            self.worker.save(spec)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.take_failed_blocks()

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued save has been answered; False on ``timeout``."""
        return self.worker.flush(timeout)

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.worker.shutdown()
        self.store.close()

    # -- stats --------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> Optional[KvcdConnectorStats]:
        with self._stats_lock:
            return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict[str, Any]] = None
                                 ) -> Optional[KvcdConnectorStats]:
        return KvcdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KvcdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
