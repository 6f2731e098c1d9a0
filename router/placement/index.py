"""Exact prefix index: which worker holds which KV block, fed by KV events.

Every worker publishes `KVEventBatch`es (blocks stored / removed / all
cleared), numbered per worker. The index keeps two views of the same facts:

- per worker, the set of block hashes it holds, so a worker's entries can be
  replaced (resync) or dropped (dead worker) in O(its blocks);
- per block hash, a bitmask of the worker slots holding it (a Python int), so
  one routing lookup walks the request's hash chain once for all workers at
  a time, with one dict lookup and a few integer operations per block.

Blocks in a worker's tiers below its device cache (engine/kv_tiers.py: host,
disk) are kept apart, per tier and in a second bitmask map: `overlap` counts
them with `tiers=True` (the worker promotes them before computing), and
`tier_overlap` tells device hits from those.

The shared store (engine/kv_remote.py, tier "remote") is one set of blocks for
the whole cluster: a block one worker wrote there counts, with `tiers=True`,
for every worker that reads the store (its snapshot lists the tier), as a
block in that worker's "remote" tier, priced at its measured promotion from
the store. The store drops blocks on its own (its LRU); a block the index
still lists is then a miss, which the worker computes and reports.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.kv_events import REMOTE_TIER, KVEvent, KVEventBatch

SHARED_TIER = REMOTE_TIER  # the cluster's shared store: its blocks are every reader's
MAX_SHARED_BLOCKS = 1 << 20  # the store's blocks the index remembers, the most recently stored


@dataclass(slots=True)
class _WorkerEntry:
    bit: int  # 1 << slot; the worker's bit in every block's owner mask
    blocks: set[int] = field(default_factory=set)
    lower: dict[str, set[int]] = field(default_factory=dict)  # tier below the device cache -> its blocks
    seq: int = -1  # last applied batch sequence number
    needs_resync: bool = False
    # Prompts routed to the worker and not finished: their blocks will be there once computed.
    in_flight: dict[str, tuple[int, ...]] = field(default_factory=dict)
    in_flight_blocks: Counter = field(default_factory=Counter)


class PrefixIndex:
    """Block hash -> workers holding it, exact as long as no event is lost.

    Sequence numbers: a worker's first batch carries seq 0 and each next batch
    seq + 1. A batch that skips ahead means events were lost; `apply` then
    returns False, leaves the worker's entries as they were (still a good
    guess for routing) and refuses further batches from it until `resync`
    installs a snapshot. Batches at or below the last applied seq are
    replays already reflected in the index and are ignored.
    """

    def __init__(self) -> None:
        self._workers: dict[str, _WorkerEntry] = {}
        self._owners: dict[int, int] = {}  # block hash -> bitmask of worker slots
        self._lower_owners: dict[int, int] = {}  # block hash -> bitmask of the workers holding it in a lower tier
        self._slot_worker: list[str | None] = []  # slot -> worker id
        self._free_slots: list[int] = []
        self._pool_masks: dict[tuple[str, ...], int] = {}  # worker ids -> their bits
        self._shared: dict[int, None] = {}  # blocks in the shared store, oldest first
        self._shared_readers = 0  # bitmask of the workers that read the shared store

    # ---- feeding -----------------------------------------------------------------

    def apply(self, batch: KVEventBatch) -> bool:
        """Apply one worker's batch; False when a gap was detected (resync that worker)."""
        entry = self._workers.get(batch.worker_id) or self._add_worker(batch.worker_id)
        if entry.needs_resync:
            return False
        if batch.seq <= entry.seq:
            return True
        if batch.seq != entry.seq + 1:
            entry.needs_resync = True
            return False
        for event in batch.events:
            self._apply_event(entry, event)
        entry.seq = batch.seq
        return True

    def resync(self, worker_id: str, block_hashes: Iterable[int], seq: int,
               tiers: dict[str, Iterable[int]] | None = None) -> None:
        """Replace a worker's entries with a snapshot taken after its batch `seq` (`tiers`: per tier below its
        device cache, the blocks it holds)."""
        entry = self._workers.get(worker_id) or self._add_worker(worker_id)
        self._drop_blocks(entry, entry.blocks)
        entry.blocks = set()
        self._clear_lower(entry)
        self._store_blocks(entry, block_hashes)
        self._shared_readers &= ~entry.bit
        for tier, hashes in (tiers or {}).items():
            if tier == SHARED_TIER:
                self._store_shared(entry, hashes)
            else:
                self._store_lower(entry, tier, hashes)
        entry.seq = seq
        entry.needs_resync = False

    def remove_worker(self, worker_id: str) -> None:
        """Forget a dead or removed worker at once; cost is O(its blocks)."""
        entry = self._workers.pop(worker_id, None)
        if entry is None:
            return
        self._drop_blocks(entry, entry.blocks)
        self._clear_lower(entry)
        self._shared_readers &= ~entry.bit
        self._pool_masks.clear()
        slot = entry.bit.bit_length() - 1
        self._slot_worker[slot] = None
        self._free_slots.append(slot)

    def begin_prompt(self, worker_id: str, key: str, block_hashes: Sequence[int]) -> None:
        """A prompt routed to `worker_id` to be computed there: until `end_prompt`, its blocks count as held
        by that worker (`overlap(..., in_flight=True)`), so a request sharing its prefix that arrives while
        it is still being computed queues behind it there instead of computing the prefix again elsewhere."""
        entry = self._workers.get(worker_id) or self._add_worker(worker_id)
        hashes = tuple(block_hashes)
        if key not in entry.in_flight and hashes:
            entry.in_flight[key] = hashes
            entry.in_flight_blocks.update(hashes)

    def end_prompt(self, worker_id: str, key: str) -> None:
        entry = self._workers.get(worker_id)
        hashes = entry.in_flight.pop(key, None) if entry is not None else None
        if hashes:
            entry.in_flight_blocks.subtract(hashes)
            entry.in_flight_blocks += Counter()  # drop the zeros

    # ---- querying ----------------------------------------------------------------

    def overlap(self, block_hashes: Sequence[int], workers: Iterable[str], in_flight: bool = False,
                tiers: bool = False) -> dict[str, int]:
        """For each worker, how many leading blocks of the request's hash chain it holds (with `in_flight`,
        or will hold once the prompts routed to it are computed: `begin_prompt`; with `tiers`, in its device
        cache or a tier below it).

        Counting stops at a worker's first miss: a block is only reusable when
        every block before it is cached on the same worker too.
        """
        pool = tuple(workers)
        tiers = tiers and self._has_lower()
        result = self._overlap(block_hashes, pool, tiers)
        if in_flight:
            for worker_id in pool:
                entry = self._workers.get(worker_id)
                if entry is not None and entry.in_flight_blocks:
                    ahead = entry.in_flight_blocks
                    depth = 0
                    for block_hash in block_hashes:
                        if block_hash not in ahead and block_hash not in entry.blocks \
                                and not (tiers and self._held_lower(entry, block_hash)):
                            break
                        depth += 1
                    result[worker_id] = max(result[worker_id], depth)
        return result

    def tier_overlap(self, block_hashes: Sequence[int], workers: Iterable[str]) -> dict[str, tuple[int, int]]:
        """For each worker, (leading blocks in its device cache, leading blocks in it or a tier below it)."""
        pool = tuple(workers)
        device = self._overlap(block_hashes, pool)
        if not self._has_lower():
            return {worker_id: (n, n) for worker_id, n in device.items()}
        anywhere = self._overlap(block_hashes, pool, True)
        return {worker_id: (device[worker_id], anywhere[worker_id]) for worker_id in pool}

    def lower_tiers(self, worker_id: str, block_hashes: Sequence[int]) -> dict[str, int]:
        """Of `block_hashes` (blocks the worker holds below its device cache), how many each tier holds (the
        first tier listing a block counts it)."""
        entry = self._workers.get(worker_id)
        counts: dict[str, int] = {}
        if entry is None:
            return counts
        reads_shared = bool(self._shared_readers & entry.bit)
        for block_hash in block_hashes:
            for tier, hashes in entry.lower.items():
                if block_hash in hashes:
                    counts[tier] = counts.get(tier, 0) + 1
                    break
            else:
                if reads_shared and block_hash in self._shared:
                    counts[SHARED_TIER] = counts.get(SHARED_TIER, 0) + 1
        return counts

    def num_lower_blocks(self, worker_id: str) -> dict[str, int]:
        """Per tier below the worker's device cache, how many blocks the index holds for it (the shared store's
        for a worker that reads it)."""
        entry = self._workers.get(worker_id)
        if entry is None:
            return {}
        counts = {tier: len(hashes) for tier, hashes in entry.lower.items()}
        if self._shared_readers & entry.bit:
            counts[SHARED_TIER] = len(self._shared)
        return counts

    def num_shared_blocks(self) -> int:
        """Blocks the index lists in the shared store."""
        return len(self._shared)

    def _overlap(self, block_hashes: Sequence[int], pool: tuple[str, ...], tiers: bool = False) -> dict[str, int]:
        result = dict.fromkeys(pool, 0)
        mask = self._pool_masks.get(pool)
        if mask is None:
            mask = self._pool_mask(pool)
        owners = self._owners
        lower = self._lower_owners if tiers else None
        shared, readers = (self._shared, self._shared_readers) if tiers and self._shared_readers else (None, 0)
        slot_worker = self._slot_worker
        depth = 0
        for block_hash in block_hashes:
            if not mask:
                return result
            held = owners.get(block_hash, 0)
            if lower is not None:
                held |= lower.get(block_hash, 0)
            if shared is not None and block_hash in shared:
                held |= readers
            held &= mask
            if depth:  # workers lost at depth 0 keep the default 0
                lost = mask ^ held
                while lost:
                    low = lost & -lost
                    result[slot_worker[low.bit_length() - 1]] = depth
                    lost ^= low
            mask = held
            depth += 1
        while mask:
            low = mask & -mask
            result[slot_worker[low.bit_length() - 1]] = depth
            mask ^= low
        return result

    def needs_resync(self, worker_id: str) -> bool:
        """True after a gap in the worker's batches, until `resync`."""
        entry = self._workers.get(worker_id)
        return entry is not None and entry.needs_resync

    def num_blocks(self, worker_id: str) -> int:
        """How many blocks the index holds for the worker."""
        entry = self._workers.get(worker_id)
        return 0 if entry is None else len(entry.blocks)

    def workers(self) -> list[str]:
        """Workers the index has entries or a sequence position for."""
        return list(self._workers)

    def __len__(self) -> int:
        """Number of distinct block hashes held by at least one worker."""
        return len(self._owners)

    # ---- internals ---------------------------------------------------------------

    def _pool_mask(self, pool: tuple[str, ...]) -> int:
        # Routing asks about the same few pools over and over; caching their
        # masks saves a dict lookup per worker per decision.
        mask = 0
        for worker_id in pool:
            entry = self._workers.get(worker_id)
            if entry is not None:
                mask |= entry.bit
        if len(self._pool_masks) >= 64:
            self._pool_masks.clear()
        self._pool_masks[pool] = mask
        return mask

    def _add_worker(self, worker_id: str) -> _WorkerEntry:
        self._pool_masks.clear()
        if self._free_slots:
            slot = self._free_slots.pop()
            self._slot_worker[slot] = worker_id
        else:
            slot = len(self._slot_worker)
            self._slot_worker.append(worker_id)
        entry = self._workers[worker_id] = _WorkerEntry(bit=1 << slot)
        return entry

    def _has_lower(self) -> bool:
        """Whether any worker holds blocks below its device cache (the shared store's included)."""
        return bool(self._lower_owners) or bool(self._shared and self._shared_readers)

    def _held_lower(self, entry: _WorkerEntry, block_hash: int) -> bool:
        return bool(self._lower_owners.get(block_hash, 0) & entry.bit) or (
            bool(self._shared_readers & entry.bit) and block_hash in self._shared)

    def _store_shared(self, entry: _WorkerEntry, block_hashes: Iterable[int]) -> None:
        """Blocks a worker wrote to (or found in) the shared store; it reads the store."""
        self._shared_readers |= entry.bit
        shared = self._shared
        for block_hash in block_hashes:
            shared.pop(block_hash, None)
            shared[block_hash] = None
        while len(shared) > MAX_SHARED_BLOCKS:
            del shared[next(iter(shared))]

    def _apply_event(self, entry: _WorkerEntry, event: KVEvent) -> None:
        # `stored` events carry parent_hash for tree-shaped indexes; a flat
        # index does not need it because `overlap` checks contiguity itself.
        if event.tier == SHARED_TIER:  # the cluster's store: a worker's "cleared" (its own tiers) leaves it be
            if event.kind == "stored":
                self._store_shared(entry, event.block_hashes)
            elif event.kind == "removed":  # the store no longer had them
                for block_hash in event.block_hashes:
                    self._shared.pop(block_hash, None)
            elif event.kind != "cleared":
                raise ValueError(f"unknown KV event kind {event.kind!r}")
        elif event.tier != "device" and event.kind != "cleared":
            if event.kind == "stored":
                self._store_lower(entry, event.tier, event.block_hashes)
            elif event.kind == "removed":
                self._drop_lower(entry, event.tier, event.block_hashes)
            else:
                raise ValueError(f"unknown KV event kind {event.kind!r}")
        elif event.kind == "stored":
            self._store_blocks(entry, event.block_hashes)
        elif event.kind == "removed":
            held = entry.blocks.intersection(event.block_hashes)
            entry.blocks -= held
            self._drop_blocks(entry, held)
        elif event.kind == "cleared":  # every tier
            self._drop_blocks(entry, entry.blocks)
            entry.blocks = set()
            self._clear_lower(entry)
        else:
            raise ValueError(f"unknown KV event kind {event.kind!r}")

    def _store_blocks(self, entry: _WorkerEntry, block_hashes: Iterable[int]) -> None:
        owners, blocks, bit = self._owners, entry.blocks, entry.bit
        for block_hash in block_hashes:
            if block_hash not in blocks:
                blocks.add(block_hash)
                owners[block_hash] = owners.get(block_hash, 0) | bit

    def _drop_blocks(self, entry: _WorkerEntry, block_hashes: Iterable[int]) -> None:
        owners, bit = self._owners, entry.bit
        for block_hash in block_hashes:
            remaining = owners[block_hash] & ~bit
            if remaining:
                owners[block_hash] = remaining
            else:
                del owners[block_hash]

    def _store_lower(self, entry: _WorkerEntry, tier: str, block_hashes: Iterable[int]) -> None:
        held = entry.lower.setdefault(tier, set())
        owners, bit = self._lower_owners, entry.bit
        for block_hash in block_hashes:
            held.add(block_hash)
            owners[block_hash] = owners.get(block_hash, 0) | bit

    def _drop_lower(self, entry: _WorkerEntry, tier: str, block_hashes: Iterable[int]) -> None:
        held = entry.lower.get(tier)
        if not held:
            return
        owners, bit = self._lower_owners, entry.bit
        for block_hash in block_hashes:
            if block_hash not in held:
                continue
            held.discard(block_hash)
            if any(block_hash in other for other in entry.lower.values()):
                continue  # still in another of its tiers
            remaining = owners[block_hash] & ~bit
            if remaining:
                owners[block_hash] = remaining
            else:
                del owners[block_hash]

    def _clear_lower(self, entry: _WorkerEntry) -> None:
        for tier, held in list(entry.lower.items()):
            self._drop_lower(entry, tier, list(held))
        entry.lower = {}
