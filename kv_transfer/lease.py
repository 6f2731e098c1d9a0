"""The sender's lease table: blocks of prefilled requests stay pinned until decode has pulled them.

A lease ends in one of three ways: the receiver's Release RPC after a pull,
the prefill side's own release (abort), or its TTL running out while nobody
pulls. Then `on_release(block_ids)` runs once, so the engine's block manager
can drop its references. A lease that is released while a pull still reads
its blocks hands them back only when that pull ends, so a block is never
reused under a reader.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

OnRelease = Callable[[list[int]], None]


@dataclass(slots=True)
class Lease:
    """One request's pinned blocks; `layers_ready` grows while prefill is still running."""
    request_id: str
    block_ids: list[int]
    block_hashes: list[int]
    num_tokens: int
    on_release: OnRelease
    ttl: float
    expires_at: float
    layers_ready: int
    active_pulls: int = 0
    released: bool = False


class LeaseTable:
    """Thread-safe leases with TTL expiry by a background reaper thread."""

    def __init__(self, num_layers: int, default_ttl: float):
        self.num_layers = num_layers
        self.default_ttl = default_ttl
        self._leases: dict[str, Lease] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._reaper = threading.Thread(target=self._reap, name="kv-lease-reaper", daemon=True)
        self._reaper.start()

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    @property
    def num_active_pulls(self) -> int:
        """Pulls reading leased blocks right now (a load signal for metrics)."""
        with self._cond:
            return sum(lease.active_pulls for lease in self._leases.values())

    def add(self, request_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int,
            on_release: OnRelease, ttl: float | None = None, layers_ready: int | None = None) -> Lease:
        """Pin `block_ids` for `request_id`; `layers_ready` < num_layers means prefill is still writing."""
        ttl = self.default_ttl if ttl is None else ttl
        ready = self.num_layers if layers_ready is None else layers_ready
        lease = Lease(request_id, list(block_ids), list(block_hashes), num_tokens, on_release,
                      ttl, time.monotonic() + ttl, ready)
        with self._cond:
            if self._closed:
                raise RuntimeError("lease table is closed")
            if request_id in self._leases:
                raise ValueError(f"request {request_id!r} already holds a lease")
            self._leases[request_id] = lease
            self._cond.notify_all()
        return lease

    def mark_layers_ready(self, request_id: str, num_layers_ready: int) -> None:
        """Layers [0, num_layers_ready) of the request's blocks are final and may be sent."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is not None and num_layers_ready > lease.layers_ready:
                lease.layers_ready = min(num_layers_ready, self.num_layers)
                self._cond.notify_all()

    def begin_pull(self, request_id: str) -> Lease | None:
        """The live lease of `request_id`, pinned until `end_pull`; None if it is gone."""
        with self._cond:
            lease = self._leases.get(request_id)
            if lease is not None:
                lease.active_pulls += 1
            return lease

    def end_pull(self, lease: Lease) -> None:
        """A pull stopped reading; the TTL restarts so the receiver may retry or release."""
        with self._cond:
            lease.active_pulls -= 1
            lease.expires_at = time.monotonic() + lease.ttl
            finished = lease.released and lease.active_pulls == 0
            self._cond.notify_all()
        if finished:
            self._hand_back(lease)

    def wait_layers(self, lease: Lease, layer_end: int, deadline: float,
                    is_active: Callable[[], bool] = lambda: True) -> bool:
        """Block until layers [0, layer_end) are ready; False if released, cancelled or past `deadline`."""
        with self._cond:
            while lease.layers_ready < layer_end:
                remaining = deadline - time.monotonic()
                if lease.released or remaining <= 0 or not is_active():
                    return False
                self._cond.wait(min(remaining, 1.0))
            return not lease.released

    def wake(self) -> None:
        """Wake waiters so they re-check their cancellation (e.g. when an RPC ends)."""
        with self._cond:
            self._cond.notify_all()

    def release(self, request_id: str) -> bool:
        """End the lease now (pull done, or request aborted); False if it was already gone."""
        with self._cond:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return False
            lease.released = True
            idle = lease.active_pulls == 0
            self._cond.notify_all()
        if idle:
            self._hand_back(lease)
        return True

    def close(self) -> None:
        """Release every lease and stop the reaper."""
        with self._cond:
            self._closed = True
            ids = list(self._leases)
            self._cond.notify_all()
        for request_id in ids:
            self.release(request_id)
        self._reaper.join()

    def _reap(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                now = time.monotonic()
                expired = [r for r, lease in self._leases.items()
                           if lease.active_pulls == 0 and lease.expires_at <= now]
                if not expired:
                    waiting = [lease.expires_at for lease in self._leases.values() if lease.active_pulls == 0]
                    self._cond.wait(min(waiting, default=now + 60.0) - now)
                    continue
            for request_id in expired:
                logger.info("KV lease of request %s expired unpulled", request_id)
                self.release(request_id)

    @staticmethod
    def _hand_back(lease: Lease) -> None:
        try:
            lease.on_release(lease.block_ids)
        except Exception:
            logger.exception("on_release of request %s failed", lease.request_id)
