"""KV tiers below the device cache: blocks evicted from it wait in host memory or on disk, and come back on a hit.

Each tier is a pool of block slots shaped like the KV cache's memory, least recently used first out, keyed by
block hash (which carries the tenant's cache salt, engine/hashing.py, so tenants stay apart in every tier). A
cached block whose last reference is dropped is demoted at once to the host tier, copied on a background thread
(off the step), so that evicting it from the device cache later costs nothing; a block pushed out of the host
tier goes down to the disk tier, when there is one. A prompt whose next blocks sit in a tier gets them promoted
(copied back into free device blocks and registered in the prefix cache) before the step that computes it, as
early as the request arrives. Tiers are inclusive: a block promoted or still on the device keeps its tier copy
until that tier's LRU drops it. Every change is a KV event naming the tier, for the router's index.

The host tier is pinned memory on CUDA. On CPU, where the device cache is host memory already, it is a memfd
(shared memory other workers of the host can map) that adds capacity beyond the cache. The disk tier is a
memory-mapped file in `disk_path`, unlinked as soon as it is mapped, so that a crash leaves nothing behind.

A copy job that fails drops the tier entries it was filling (counted: `copy_failures`), so a tier never serves a
block it does not hold. Slots can be pinned (`pin`) while someone reads them; LRU eviction passes them by."""
from __future__ import annotations

import logging
import math
import mmap
import os
import queue
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.kv_cache import KVCache
from engine.kv_events import REMOTE_TIER, KVEvent
from engine.kv_tiers_config import GIB, KVTiersConfig

REMOTE = -1  # the level of a block found in the remote store (engine/kv_remote.py)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Per tier: blocks stored into it, promoted out of it (hits), dropped by its LRU, and their bytes."""
    stored: int = 0
    hits: int = 0
    evicted: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    promote_seconds: float = 0.0  # time the engine thread spent copying hits back (what a hit costs)


@dataclass(slots=True)
class Tier:
    """One tier's slots: `memory` is shaped like the KV cache's memory with `num_slots` blocks."""
    name: str
    memory: torch.Tensor
    block_dim: int
    slots: OrderedDict = field(default_factory=OrderedDict)  # block hash -> slot, least recently used first
    tokens: dict = field(default_factory=dict)  # block hash -> token ids (a hit is confirmed by them)
    free: list = field(default_factory=list)
    pinned: Counter = field(default_factory=Counter)  # slot -> readers
    stats: TierStats = field(default_factory=TierStats)

    def __post_init__(self):
        self.free = list(range(self.num_slots - 1, -1, -1))

    @property
    def num_slots(self) -> int:
        return self.memory.shape[self.block_dim]

    def lookup(self, block_hash: int, token_ids: Sequence[int] | None = None) -> int | None:
        slot = self.slots.get(block_hash)
        if slot is None or token_ids is not None and self.tokens[block_hash] != tuple(token_ids):
            return None
        return slot


class _Copier:
    """One background thread running copy jobs in order; `wait(seq)` returns once job `seq` has run."""

    def __init__(self, on_done: Callable[[int, bool], None]):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done = 0
        self.submitted = 0
        self._cond = threading.Condition()
        self._on_done = on_done
        self._thread = threading.Thread(target=self._run, name="tandem-kv-tiers", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> int:
        self.submitted += 1
        self._jobs.put((self.submitted, job))
        return self.submitted

    def wait(self, seq: int) -> None:
        if self._done >= seq:
            return
        with self._cond:
            while self._done < seq:
                self._cond.wait()

    def close(self) -> None:
        self._jobs.put((None, None))
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            seq, job = self._jobs.get()
            if job is None:
                return
            ok = True
            try:
                job()
            except Exception:
                logger.exception("a KV tier copy failed; its blocks are dropped from the tier")
                ok = False
            self._on_done(seq, ok)
            with self._cond:
                self._done = seq
                self._cond.notify_all()


class KVTiers:
    """The tiers of one engine below its KV cache `cache`; KV events go to `events` (the block manager's list).

    Bookkeeping (which hash sits in which slot) happens on the engine thread; only the byte copies of
    demotions run on the copier thread. A device block being read by a pending demotion must not be written
    before it ends (`wait_block`, called when the block is reused); a tier slot being filled is waited for
    before it is read (`promote`)."""

    def __init__(self, config: KVTiersConfig, cache: KVCache, events: list[KVEvent]):
        self.config = config
        self.cache = cache
        self.events = events
        self.block_dim = 2 if cache.tp_size == 1 else 3
        self.bytes_per_block = math.prod(KVCache.memory_shape(cache.layout, 1, cache.tp_size)) \
            * getattr(torch, cache.layout.dtype).itemsize
        self.tiers: list[Tier] = []
        self._files: list[mmap.mmap] = []
        host_slots = int(config.host_gb * GIB // self.bytes_per_block)
        if host_slots < 1:
            raise ValueError(f"kv_tiers.host_gb {config.host_gb} holds no block of {self.bytes_per_block} bytes")
        self.tiers.append(Tier("host", self._host_memory(host_slots), self.block_dim))
        if config.disk_gb:
            disk_slots = int(config.disk_gb * GIB // self.bytes_per_block)
            if disk_slots < 1:
                raise ValueError(f"kv_tiers.disk_gb {config.disk_gb} holds no block of {self.bytes_per_block} bytes")
            self.tiers.append(Tier("disk", self._disk_memory(disk_slots, config.disk_path), self.block_dim))
        self.remote = None
        if config.remote_url:
            from engine.kv_remote import RemoteStore
            shape = list(self._shape(1))
            del shape[self.block_dim]
            self.remote = RemoteStore(config.remote_url, cache.layout, cache.tp_size, tuple(shape))
        self._in_remote: OrderedDict[int, None] = OrderedDict()  # hashes known to be in the store (bounded)
        self.remote_promote_seconds = 0.0
        self.copy_failures = 0
        self._block_jobs: dict[int, int] = {}  # device block -> the last job reading it
        self._slot_jobs: dict[tuple[int, int], int] = {}  # (tier level, slot) -> the last job writing it
        self._job_slots: dict[int, list[tuple[int, int]]] = {}  # pending job -> the (level, slot)s it fills
        self._failed: list[tuple[int, int]] = []  # (level, slot)s failed jobs filled, for the engine thread to drop
        self._lock = threading.Lock()
        self._copier = _Copier(self._job_done)

    # ---- memory --------------------------------------------------------------------------------------

    def _shape(self, num_slots: int) -> tuple[int, ...]:
        return KVCache.memory_shape(self.cache.layout, num_slots, self.cache.tp_size)

    def _host_memory(self, num_slots: int) -> torch.Tensor:
        dtype = getattr(torch, self.cache.layout.dtype)
        shape = self._shape(num_slots)
        if self.cache.memory.device.type == "cuda":
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        size = math.prod(shape) * dtype.itemsize
        if not hasattr(os, "memfd_create"):
            return torch.empty(shape, dtype=dtype)
        self.shm_fd = os.memfd_create(f"tandem-kv-host-tier-{os.getpid()}")
        os.ftruncate(self.shm_fd, size)
        self._files.append(mmap.mmap(self.shm_fd, size, flags=mmap.MAP_SHARED))
        return torch.frombuffer(self._files[-1], dtype=dtype).view(shape)

    def _disk_memory(self, num_slots: int, path: str) -> torch.Tensor:
        dtype = getattr(torch, self.cache.layout.dtype)
        shape = self._shape(num_slots)
        size = math.prod(shape) * dtype.itemsize
        os.makedirs(path, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="tandem-kv-disk-tier-", dir=path)
        try:
            os.unlink(name)  # the mapping keeps the file; nothing is left behind once the worker exits
            os.ftruncate(fd, size)
            self._files.append(mmap.mmap(fd, size, flags=mmap.MAP_SHARED))
        finally:
            os.close(fd)
        return torch.frombuffer(self._files[-1], dtype=dtype).view(shape)

    def close(self) -> None:
        """Stop the copier (pending copies finish first) and the store's connection."""
        self._copier.close()
        if self.remote is not None:
            self.remote.close()

    # ---- demotion ------------------------------------------------------------------------------------

    def demote(self, blocks: Sequence[tuple[int, int, tuple[int, ...]]]) -> None:
        """Copy (block id, hash, token ids) of freed cached blocks into the host tier, off the engine thread;
        blocks it already holds only become its most recent."""
        self._drop_failed()
        host = self.tiers[0]
        ids, slots, filled = [], [], []
        shared = []  # (hash, tokens, slot) of the blocks the shared store does not hold yet
        for block_id, block_hash, token_ids in blocks:
            if block_hash in host.slots:
                host.slots.move_to_end(block_hash)
                continue
            slot = self._take_slot(0)
            if slot is None:
                break  # every slot is pinned
            self._store(0, slot, block_hash, token_ids)
            ids.append(block_id)
            slots.append(slot)
            filled.append((0, slot))
            if self.remote is not None and block_hash not in self._in_remote:
                shared.append((block_hash, token_ids, slot))
                self._note_remote(block_hash)
        if ids:
            src, dst, dim = self.cache.memory, host.memory, self.block_dim
            ids_t, slots_t = torch.tensor(ids), torch.tensor(slots)
            remote = self.remote

            def copy():
                dst.index_copy_(dim, slots_t, src.index_select(dim, ids_t.to(src.device)).to(dst.device))
                if shared:  # written through to the shared store (a failure is counted there)
                    remote.put([(h, t, dst.select(dim, slot)) for h, t, slot in shared])

            seq = self._submit(copy, filled)
            for block_id in ids:
                self._block_jobs[block_id] = seq
            if shared:  # the router's index: every worker that reads the store may use them now
                self.events.append(KVEvent("stored", [h for h, _, _ in shared], tier=REMOTE_TIER))

    def _note_remote(self, block_hash: int) -> None:
        self._in_remote[block_hash] = None
        self._in_remote.move_to_end(block_hash)
        if len(self._in_remote) > 65536:
            self._in_remote.popitem(last=False)

    def remote_run(self, block_hashes: Sequence[int], token_ids: Sequence[int]) -> list[tuple[int, torch.Tensor, int]]:
        """The leading run of the chain `block_hashes` (of `token_ids`) that the remote store holds, as
        (REMOTE, block tensor, hash) for `promote`; [] without a store."""
        if self.remote is None or not block_hashes:
            return []
        run = self.remote.get_run(block_hashes, token_ids, self.cache.layout.block_size)
        new = [h for h in block_hashes[:len(run)] if h not in self._in_remote]
        for block_hash in block_hashes[:len(run)]:
            self._note_remote(block_hash)
        if new:  # written by a worker the router's index has not heard of (one gone, or another cluster's)
            self.events.append(KVEvent("stored", new, tier=REMOTE_TIER))
        missing = block_hashes[len(run)] if len(run) < len(block_hashes) else None
        if missing in self._in_remote:  # one we wrote or found before: the store dropped it (its LRU)
            del self._in_remote[missing]
            self.events.append(KVEvent("removed", [missing], tier=REMOTE_TIER))
        return [(REMOTE, block, block_hash) for block, block_hash in zip(run, block_hashes)]

    def wait_block(self, block_id: int) -> None:
        """Before device block `block_id` is written again: let a pending demotion of it finish."""
        seq = self._block_jobs.pop(block_id, None)
        if seq is not None:
            self._copier.wait(seq)

    def _take_slot(self, level: int) -> int | None:
        """A free slot of tier `level`, evicting its least recently used unpinned block (down to the next tier
        when there is one) if none is free; None when every slot is pinned."""
        tier = self.tiers[level]
        if tier.free:
            return tier.free.pop()
        victim = next((h for h, s in tier.slots.items() if not tier.pinned[s]), None)
        if victim is None:
            return None
        slot = tier.slots.pop(victim)
        token_ids = tier.tokens.pop(victim)
        tier.stats.evicted += 1
        self.events.append(KVEvent("removed", [victim], tier=tier.name))
        if level + 1 < len(self.tiers) and victim not in self.tiers[level + 1].slots:
            lower_slot = self._take_slot(level + 1)
            if lower_slot is not None:
                self._store(level + 1, lower_slot, victim, token_ids)
                src, dst, dim = tier.memory, self.tiers[level + 1].memory, self.block_dim
                self._copy_slot(slot, level + 1, lower_slot, src, dst, dim)
        return slot

    def _copy_slot(self, slot: int, lower: int, lower_slot: int, src, dst, dim) -> None:
        """Copy a slot down a tier (after the job filling it, and before any that refills it: jobs run in order)."""
        def copy():
            dst.select(dim, lower_slot).copy_(src.select(dim, slot))

        self._submit(copy, [(lower, lower_slot)])

    def _store(self, level: int, slot: int, block_hash: int, token_ids: Sequence[int]) -> None:
        tier = self.tiers[level]
        tier.slots[block_hash] = slot
        tier.tokens[block_hash] = tuple(token_ids)
        tier.stats.stored += 1
        tier.stats.bytes_in += self.bytes_per_block
        self.events.append(KVEvent("stored", [block_hash], tier=tier.name))

    def _submit(self, job: Callable[[], None], filled: list[tuple[int, int]]) -> int:
        with self._lock:
            seq = self._copier.submitted + 1
            self._job_slots[seq] = filled
        seq = self._copier.submit(job)
        for level, slot in filled:
            self._slot_jobs[(level, slot)] = seq
        return seq

    def _job_done(self, seq: int, ok: bool) -> None:  # on the copier thread
        with self._lock:
            filled = self._job_slots.pop(seq, ())
            if not ok:
                self._failed.extend(filled)

    def _drop_failed(self) -> None:
        """Forget what failed copies were filling (on the engine thread)."""
        if not self._failed:
            return
        with self._lock:
            filled, self._failed = self._failed, []
        for level, slot in filled:
            tier = self.tiers[level]
            block_hash = next((h for h, s in tier.slots.items() if s == slot), None)
            if block_hash is not None:
                del tier.slots[block_hash], tier.tokens[block_hash]
                tier.free.append(slot)
                self.events.append(KVEvent("removed", [block_hash], tier=tier.name))
            self.copy_failures += 1

    def _wait_slot(self, level: int, slot: int) -> None:
        seq = self._slot_jobs.pop((level, slot), None)
        if seq is not None:
            self._copier.wait(seq)

    # ---- promotion -----------------------------------------------------------------------------------

    def find(self, block_hash: int, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """(tier level, slot) of the highest tier holding `block_hash` with these tokens, or None."""
        if self._failed:
            self._drop_failed()
        for level, tier in enumerate(self.tiers):
            slot = tier.lookup(block_hash, token_ids)
            if slot is not None:
                return level, slot
        return None

    def promote(self, found: Sequence[tuple[int, int, int]], block_ids: Sequence[int]) -> None:
        """Copy tier slots (level, slot, hash) into device blocks `block_ids` (free ones, popped by the caller),
        before any step reads them; a block from the remote store is (REMOTE, its tensor, hash)."""
        started = time.perf_counter()
        by_level: dict[int, tuple[list[int], list[int]]] = {}
        dst, dim = self.cache.memory, self.block_dim
        for (level, slot, block_hash), block_id in zip(found, block_ids):
            if level == REMOTE:
                dst.select(dim, block_id).copy_(slot)
                continue
            self._wait_slot(level, slot)
            tier = self.tiers[level]
            tier.slots.move_to_end(block_hash)
            tier.stats.hits += 1
            tier.stats.bytes_out += self.bytes_per_block
            slots, ids = by_level.setdefault(level, ([], []))
            slots.append(slot)
            ids.append(block_id)
        for level, (slots, ids) in by_level.items():
            src = self.tiers[level].memory
            ids_t = torch.tensor(ids, device=dst.device)
            # Blocking, also on CUDA: the copier may refill these slots as soon as this returns.
            dst.index_copy_(dim, ids_t, src.index_select(dim, torch.tensor(slots)).to(dst.device))
        seconds = time.perf_counter() - started
        for level in by_level:
            self.tiers[level].stats.promote_seconds += seconds * len(by_level[level][0]) / len(found)
        if self.remote is not None:
            self.remote_promote_seconds += seconds * sum(1 for f in found if f[0] == REMOTE) / len(found)

    # ---- leases and state ----------------------------------------------------------------------------

    def pin(self, level: int, slot: int) -> None:
        self.tiers[level].pinned[slot] += 1

    def unpin(self, level: int, slot: int) -> None:
        tier = self.tiers[level]
        tier.pinned[slot] -= 1
        if tier.pinned[slot] <= 0:
            del tier.pinned[slot]

    def clear(self) -> None:
        """Forget every block of every tier (a prefix cache reset); pinned slots stay reserved until unpinned."""
        self.flush()
        for tier in self.tiers:
            tier.slots.clear()
            tier.tokens.clear()
            tier.free = [s for s in range(tier.num_slots - 1, -1, -1) if not tier.pinned[s]]

    def flush(self) -> None:
        """Wait for every copy submitted so far."""
        self._copier.wait(self._copier.submitted)
        self._block_jobs.clear()
        self._slot_jobs.clear()
        self._drop_failed()

    def snapshot(self) -> dict[str, list[int]]:
        """Per tier, the hashes it holds (a router resync); with a shared store, the blocks this worker knows it
        holds (the tier listed even when empty: the router's index learns from it that this worker reads it)."""
        tiers = {tier.name: list(tier.slots) for tier in self.tiers}
        if self.remote is not None:
            tiers[REMOTE_TIER] = list(self._in_remote)
        return tiers

    def stats(self) -> dict:
        """Per tier: capacity and use in blocks, the counters of TierStats; and failed copies."""
        tiers = {tier.name: {"num_slots": tier.num_slots, "num_used": len(tier.slots), "stored": tier.stats.stored,
                             "hits": tier.stats.hits, "evicted": tier.stats.evicted, "bytes_in": tier.stats.bytes_in,
                             "bytes_out": tier.stats.bytes_out, "promote_seconds": tier.stats.promote_seconds}
                 for tier in self.tiers}
        if self.remote is not None:
            remote = self.remote.stats()
            tiers[REMOTE_TIER] = {"num_slots": 0, "num_used": 0, "stored": remote["stored"], "hits": remote["hits"],
                               "evicted": 0, "bytes_in": remote["bytes_in"], "bytes_out": remote["bytes_out"],
                               "promote_seconds": self.remote_promote_seconds}
        return {"tiers": tiers, "copy_failures": self.copy_failures, "bytes_per_block": self.bytes_per_block,
                "remote_failures": 0 if self.remote is None else self.remote.failures}
