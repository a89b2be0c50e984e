"""The daemon as the connector sees it: one client, the model registered from the engine's
geometry, and a back-off so that a dead or slow daemon costs the engine one deadline, not
one per request.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Optional

import kvcd

from .config import ConnectorConfig

log = logging.getLogger("kvcd.vllm")


@dataclass(frozen=True)
class Geometry:
    """What the engine's model looks like to kvcd."""
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    rope_theta: float = 0.0


def geometry_of(vllm_config) -> Geometry:
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    hf = mc.hf_text_config
    theta = getattr(hf, "rope_theta", None)
    if theta is None:
        params = getattr(hf, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 0.0) if isinstance(params, dict) else 0.0
    return Geometry(num_layers=mc.get_num_layers(pc), num_q_heads=mc.get_num_attention_heads(pc),
                    num_kv_heads=mc.get_num_kv_heads(pc), head_dim=mc.get_head_size(),
                    block_size=vllm_config.cache_config.block_size, rope_theta=float(theta))


class Store:
    """The kvcd client of one connector (scheduler or worker side); ``timeout``: the
    deadline of every call (the scheduler's is short: it waits on Match)."""

    def __init__(self, cfg: ConnectorConfig, geometry: Geometry, *, timeout: float) -> None:
        self.cfg = cfg
        self.geometry = geometry
        tls = None
        if cfg.tls_root_certificates:
            tls = kvcd.TLS(root_certificates=cfg.tls_root_certificates,
                           client_certificate=cfg.tls_client_certificate,
                           client_key=cfg.tls_client_key, server_name=cfg.tls_server_name)
        # wait_ready=None: the engine starts whether or not the daemon is up.
        self.client = kvcd.Client(cfg.target, tls=tls, token=cfg.token, timeout=timeout,
                                  wait_ready=None)
        self._lock = threading.Lock()
        self._model_ready = False
        self._down_until = 0.0

    # -- health -----------------------------------------------------------------------

    def available(self) -> bool:
        """False while backing off after a failure of the transport."""
        return time.monotonic() >= self._down_until

    def failed(self, what: str, err: Exception) -> None:
        """Logs a failed call; a transport failure (the daemon unreachable, or past the
        deadline) makes the connector skip kvcd for ``backoff_s``."""
        if isinstance(err, (kvcd.Unavailable, kvcd.DeadlineExceeded, kvcd.Cancelled)):
            self._down_until = time.monotonic() + self.cfg.backoff_s
            self._model_ready = False
        log.warning("kvcd %s failed (%s); the engine computes without kvcd", what, err)

    # -- the model --------------------------------------------------------------------

    def _profile_fields(self) -> dict:
        g, c = self.geometry, self.cfg
        fields = dict(name=c.model, num_layers=g.num_layers, num_q_heads=g.num_q_heads,
                      num_kv_heads=g.num_kv_heads, head_dim=g.head_dim, page_size=g.block_size,
                      memory_bytes=c.memory_bytes)
        if c.history_format == "bf16":
            fields["history_format"] = "bf16"
        else:
            fields.update(history_format="int2-oscar", sink_tokens=c.sink_tokens,
                          recent_tokens=c.recent_tokens)
            if not c.codec_file:
                fields["codec"] = c.codec
        if g.rope_theta > 0:
            fields["rope"] = {"theta": g.rope_theta, "rotary_dims": g.head_dim}
        return fields

    def _check(self, p) -> None:
        g = self.geometry
        want = (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size)
        have = (p.num_layers, p.num_kv_heads, p.head_dim, p.page_size)
        if want != have:
            raise ValueError(
                f"kvcd connector: model '{self.cfg.model}' in kvcd has (layers, kv_heads, "
                f"head_dim, page_size) {have}, the engine's is {want}; choose another "
                f"'model' in kv_connector_extra_config")

    def ensure_model(self) -> None:
        """Registers the model from the engine's geometry unless kvcd has it; checks the
        geometry of an existing one (``ValueError`` when it differs)."""
        if self._model_ready:
            return
        with self._lock:
            if self._model_ready:
                return
            try:
                self._check(self.client.profile(self.cfg.model))
            except kvcd.NotFound:
                blob = b""
                if self.cfg.codec_file:
                    with open(self.cfg.codec_file, "rb") as f:
                        blob = f.read()
                try:
                    info = self.client.register_model(codec_blob=blob, tenant=self.cfg.tenant,
                                                      **self._profile_fields())
                    log.info("kvcd: registered model '%s' (%s, history %s)", self.cfg.model,
                             info.codec, self.cfg.history_format)
                except kvcd.AlreadyExists:  # another engine registered it meanwhile
                    self._check(self.client.profile(self.cfg.model))
            self._model_ready = True

    def try_ensure_model(self, what: str) -> bool:
        """ensure_model; False (and backing off) when the daemon cannot be reached."""
        if not self.available():
            return False
        try:
            self.ensure_model()
            return True
        except kvcd.KvcdError as e:
            self.failed(what, e)
            return False

    def close(self) -> None:
        self.client.close()

    def match(self, tokens, cache_salt: str) -> int:
        """Tokens of ``tokens`` kvcd holds under ``cache_salt`` (0 when it cannot tell
        within the deadline)."""
        if not self.try_ensure_model("match"):
            return 0
        try:
            return self.client.match(self.cfg.model, tokens,
                                     cache_salt=cache_salt).matched_tokens
        except kvcd.KvcdError as e:
            self.failed("match", e)
            return 0

    def info(self) -> Optional[kvcd.pb.ModelInfo]:
        try:
            return self.client.get_model(self.cfg.model)
        except kvcd.KvcdError:
            return None
