"""The scheduler side's plan: which blocks of which request are loaded from kvcd and which
are stored into it in the coming forward pass, sent to the worker side as the step's
connector metadata.

Only whole blocks of the prompt move. A request's blocks already in kvcd (its match) are
never sent again; every other block of its prompt is stored once, in the step that
completes it (chunked prefill stores chunk by chunk, ``Put`` with ``kv_first_token``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from .specs import LoadSpec, SaveSpec


@dataclass
class KvcdConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)


@dataclass
class _Request:
    prompt: List[int]
    cache_salt: str = ""
    kvcd_tokens: int = 0        # prompt tokens kvcd held at the match
    saved: int = 0              # prompt tokens kvcd holds or was sent (block-aligned)
    local_tokens: int = 0       # tokens the engine had computed at the match
    block_ids: List[int] = field(default_factory=list)


class Planner:
    """Per-request bookkeeping of the scheduler-side connector."""

    def __init__(self, block_size: int, *, load: bool, save: bool) -> None:
        self.block_size = block_size
        self.load = load
        self.save = save
        self._reqs: Dict[str, _Request] = {}
        self._loads: List[LoadSpec] = []

    def loadable(self, prompt: List[int], matched: int) -> int:
        """Of ``matched`` cached tokens, those the engine may take: whole blocks, leaving at
        least one prompt token to compute (the engine needs its logits)."""
        limit = (len(prompt) - 1) // self.block_size * self.block_size
        return max(0, min(matched, limit) // self.block_size * self.block_size)

    def matched(self, req_id: str, prompt: List[int], cache_salt: str, kvcd_tokens: int,
                local_tokens: int) -> int:
        """Records kvcd's match of a request (under ``cache_salt``); returns the tokens to
        load beyond the engine's ``local_tokens``."""
        r = self._reqs.setdefault(req_id, _Request(prompt=list(prompt), cache_salt=cache_salt))
        r.kvcd_tokens = kvcd_tokens
        r.saved = max(r.saved, min(kvcd_tokens, len(prompt) // self.block_size * self.block_size))
        r.local_tokens = local_tokens
        if not self.load:
            return 0
        return max(0, self.loadable(prompt, kvcd_tokens) - local_tokens)

    def allocated(self, req_id: str, block_ids: List[int], external_tokens: int) -> None:
        """The engine allocated ``block_ids`` for the request and will take
        ``external_tokens`` from kvcd after its local hit."""
        r = self._reqs.get(req_id)
        if r is None or external_tokens <= 0:
            return
        first = r.local_tokens // self.block_size
        n = external_tokens // self.block_size
        end = (first + n) * self.block_size
        self._loads.append(LoadSpec(req_id, r.cache_salt, r.prompt[:end], first * self.block_size,
                                    list(block_ids[first:first + n])))

    def _save(self, req_id: str, r: _Request, computed: int) -> Optional[SaveSpec]:
        end = min(computed, len(r.prompt)) // self.block_size * self.block_size
        if not self.save or end <= r.saved:
            return None
        first = r.saved
        blocks = r.block_ids[first // self.block_size:end // self.block_size]
        if len(blocks) * self.block_size != end - first:
            return None  # blocks not known (cannot happen with whole-prompt allocation)
        r.saved = end
        return SaveSpec(req_id, r.cache_salt, r.prompt[:end], first, list(blocks))

    def step(self, scheduler_output) -> KvcdConnectorMetadata:
        """The metadata of one scheduled step (resets the pending loads)."""
        meta = KvcdConnectorMetadata(loads=self._loads)
        self._loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is None:  # not matched (no connector lookup): nothing known to be stored
                continue
            r.block_ids = list(new.block_ids[0]) if new.block_ids else []
            spec = self._save(new.req_id, r,
                              new.num_computed_tokens + scheduled.get(new.req_id, 0))
            if spec:
                meta.saves.append(spec)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._reqs.get(req_id)
            if r is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                r.block_ids.extend(new_blocks[0])
            spec = self._save(req_id, r,
                              cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
            if spec:
                meta.saves.append(spec)
        return meta

    def finished(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)

    def kvcd_tokens(self, req_id: str) -> int:
        r = self._reqs.get(req_id)
        return 0 if r is None else r.kvcd_tokens
