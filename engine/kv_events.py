"""KV cache events, in Dynamo's vocabulary: blocks stored, blocks removed, all cleared.

The engine appends events as its prefix cache changes; workers stamp them with
a per-worker sequence number and publish them to the router's index. An event
names the tier it happened in: the device cache, or a tier below it
(engine/kv_tiers.py: "host", "disk", and "remote", the cluster's shared
store); "cleared" clears every tier of the worker's own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# The tier of the cluster's shared store (engine/kv_remote.py): unlike a worker's own tiers, every worker that reads
# the store can use a block one of them wrote there.
REMOTE_TIER = "remote"


@dataclass(slots=True)
class KVEvent:
    kind: Literal["stored", "removed", "cleared"]
    block_hashes: list[int] = field(default_factory=list)
    parent_hash: int | None = None  # for "stored": hash of the block before the first one
    tier: str = "device"


@dataclass(slots=True)
class KVEventBatch:
    """Events from one worker, numbered so a consumer can detect a gap."""
    worker_id: str
    seq: int
    events: list[KVEvent]


class KVEventLog:
    """A worker's numbered history of event batches, bounded; consumers poll with the last seq they saw.

    A consumer that fell behind the retained history gets `None` and must resync from a snapshot.
    """

    def __init__(self, worker_id: str, max_batches: int = 1024):
        self.worker_id = worker_id
        self.max_batches = max_batches
        self.batches: list[KVEventBatch] = []
        self.seq = 0

    def publish(self, events: list[KVEvent]) -> None:
        if not events:
            return
        self.seq += 1
        self.batches.append(KVEventBatch(self.worker_id, self.seq, events))
        if len(self.batches) > self.max_batches:
            del self.batches[: len(self.batches) - self.max_batches]

    def since(self, after_seq: int) -> list[KVEventBatch] | None:
        """Batches numbered after `after_seq`, or None when some of them were already dropped."""
        if after_seq >= self.seq:
            return []
        if not self.batches or self.batches[0].seq > after_seq + 1:
            return None
        return self.batches[after_seq + 1 - self.batches[0].seq:]
