"""KV cache events, in Dynamo's vocabulary: blocks stored, blocks removed, all cleared.

The engine appends events as its prefix cache changes; workers stamp them with
a per-worker sequence number and publish them to the router's index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(slots=True)
class KVEvent:
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int] = field(default_factory=list)
    parent_hash: int | None = None  # for "stored": hash of the block before the first one


@dataclass(slots=True)
class KVEventBatch:
    """Events from one worker, numbered so a consumer can detect a gap."""
    worker_id: str
    seq: int
    events: list[KVEvent]
