"""``KvcdConnector``: kvcd as vLLM's KV store (a ``KVConnectorBase_V1``).

Scheduler side: a new request's prompt is matched against kvcd (``Match``, whole blocks,
kvcd's page size = the engine's block size); the engine allocates blocks for the hit and
the step's metadata says which blocks to load and which freshly computed prompt blocks to
store. Worker side: before the forward, the matched blocks are fetched expanded to BF16
(``OpenSequence`` + ``FetchPages``, in chunks) and written into the engine's blocks; after
it, the new blocks are copied out and stored with one ``Put`` per request (all layers; the
registered model's history format decides how kvcd stores them) on a background thread, so
a slow daemon never holds the forward.

A load that fails (the daemon gone, the prefix evicted in between, the deadline passed)
reports its blocks through ``get_block_ids_with_load_errors``: with
``kv_load_failure_policy: "recompute"`` vLLM recomputes them. After a transport failure the
connector skips kvcd for ``backoff_s`` (matches answer 0, saves are counted as failed).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvcd

from . import config as config_mod
from . import layout
from .plan import KvcdConnectorMetadata, LoadSpec, Planner, SaveSpec
from .stats import KvcdConnectorStats, KvcdPromMetrics
from .store import Store, geometry_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvcd.vllm")

_FETCH_BYTES = 64 << 20  # default FetchPages answer size (fetch_chunk_tokens)


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
            self._layers: List[torch.Tensor] = []
            self._failed_blocks: set = set()
            self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcd-save")
            self._pending_bytes = 0
            token_bytes = 4 * self.geometry.num_layers * self.geometry.num_kv_heads \
                * self.geometry.head_dim
            self._chunk_tokens = self.cfg.fetch_chunk_tokens or \
                max(bs, _FETCH_BYTES // token_bytes // bs * bs)
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
        self._layers = [cache for _, cache in ordered]

    def _layers_from(self, forward_context: "ForwardContext") -> None:
        if self._layers:
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
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        bs = self.geometry.block_size
        done = 0  # blocks written
        nbytes = 0
        t0 = time.perf_counter()
        try:
            if not self.store.try_ensure_model("load"):
                raise kvcd.Unavailable("the daemon is being skipped after a failure")
            client = self.store.client
            seq = client.open_sequence(self.cfg.model, spec.tokens, cache_salt=spec.cache_salt,
                                       auto_renew=False)
            try:
                have = min(len(spec.block_ids), max(0, seq.matched_tokens - spec.first_token) // bs)
                step = self._chunk_tokens // bs
                while done < have:
                    n = min(step, have - done)
                    got = client.fetch_pages(seq, first_token=spec.first_token + done * bs,
                                             num_tokens=n * bs, expand_to_bf16=True,
                                             as_torch=True)
                    layout.scatter(self._layers, spec.block_ids[done:done + n], got.k, got.v)
                    nbytes += got.k.numel() * got.k.element_size() * 2
                    done += n
            finally:
                try:
                    seq.close(missing_ok=True)
                except kvcd.KvcdError:
                    pass
            if done < len(spec.block_ids):
                log.warning("kvcd load of request %s: %d of %d blocks still cached; the rest "
                            "is recomputed", spec.req_id, done, len(spec.block_ids))
        except kvcd.KvcdError as e:
            self.store.failed(f"load of request {spec.req_id}", e)
        failed = spec.block_ids[done:]
        self._failed_blocks.update(failed)
        self._count(loaded_tokens=done * bs, load_bytes=nbytes,
                    load_seconds=time.perf_counter() - t0, failed_load_blocks=len(failed))

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
        if not self._layers:
            from vllm.forward_context import get_forward_context
            self._layers_from(get_forward_context())
        for spec in meta.saves:
            if not self.store.available():
                self._count(failed_saves=1)
                continue
            k, v = layout.gather(self._layers, spec.block_ids, self.geometry.head_dim)
            nbytes = k.numel() * k.element_size() * 2
            with self._stats_lock:
                if self._pending_bytes + nbytes > self.cfg.max_pending_save_bytes:
                    self._stats.add(dropped_saves=1)
                    self.totals.add(dropped_saves=1)
                    continue
                self._pending_bytes += nbytes
            self._saver.submit(self._put, spec, k, v, nbytes)

    def _put(self, spec: SaveSpec, k: torch.Tensor, v: torch.Tensor, nbytes: int) -> None:
        t0 = time.perf_counter()
        try:
            if not self.store.try_ensure_model("save"):
                self._count(failed_saves=1)
                return
            self.store.client.put(self.cfg.model, spec.tokens, k, v,
                                  cache_salt=spec.cache_salt, kv_first_token=spec.first_token)
            self._count(saved_tokens=len(spec.tokens) - spec.first_token, save_bytes=nbytes,
                        save_seconds=time.perf_counter() - t0)
        except kvcd.KvcdError as e:
            self.store.failed(f"save of request {spec.req_id}", e)
            self._count(failed_saves=1)
        finally:
            with self._stats_lock:
                self._pending_bytes -= nbytes

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def flush(self, timeout: Optional[float] = None) -> bool:
        """Waits until every queued save has been answered; False on ``timeout``."""
        done = threading.Event()
        try:
            self._saver.submit(done.set)
        except RuntimeError:  # the executor was shut down (interpreter exit): nothing queued
            return True
        return done.wait(timeout)

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self.flush(self.cfg.timeout_s)
            self._saver.shutdown(wait=False, cancel_futures=True)
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
