"""What the scheduler side asks the worker side to move in one step: the blocks of a
request to load from kvcd and the blocks to store into it (no vLLM import, so that the
worker's transfers can be tested without an engine)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass
class LoadSpec:
    """Load tokens ``[first_token, first_token + len(block_ids) * block_size)`` of
    ``tokens`` into ``block_ids``."""
    req_id: str
    cache_salt: str
    tokens: List[int]
    first_token: int
    block_ids: List[int]


@dataclass
class SaveSpec:
    """Store the K/V of tokens ``[first_token, len(tokens))`` (whole blocks, read from
    ``block_ids``) under the prefix ``tokens``."""
    req_id: str
    cache_salt: str
    tokens: List[int]
    first_token: int
    block_ids: List[int]
