"""Tenants' quotas shared by the ingress replicas.

With one ingress replica, flow control counts each tenant's tokens per minute and requests running itself
(router/api/flow_control.py). With several, each counting alone would give a tenant its quota once per replica.
So the counts live in one `QuotaLedger` (a Ray actor per cluster, beside the metrics hub) and each replica's
`SharedQuotas` leases from it:

- Tokens per minute: the ledger holds the tenant's bucket. A replica short of tokens for a request borrows what
  the request needs plus a slice (`SLICE_FRACTION` of the minute's budget, split among the replicas), so most
  requests are charged from what the replica already holds; refunds of unused output tokens beyond one slice go
  back. A request the ledger cannot cover gets the ledger's wait as its Retry-After.
- Max concurrent: a replica runs a tenant's request only on a slot leased from the ledger. A request without
  one queues while the replica waits on the ledger for a slot (a long poll, woken when any replica gives one
  back); the slot goes back when the request ends.
- Leases expire: each replica reports every `RENEW_S` what it holds; a replica not heard from for `LEASE_TTL_S`
  (its process gone) loses its slots. A ledger that restarts learns the slots from the next reports.

Tokens a replica holds are not reported: a dead replica's share returns with the bucket's refill. The ledger
unreachable is no reason to drop a quota: the limited tenant's request gets 503 with Retry-After, counted in
`tandem:flow_ledger_errors`; tenants without quotas never ask the ledger.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import ray

logger = logging.getLogger(__name__)

SLICE_FRACTION = 0.25  # of a minute's tokens, split among the replicas: what a replica borrows beyond its need
RENEW_S = 2.0  # how often a replica reports its slots
LEASE_TTL_S = 10.0  # a replica not heard from for this long has its slots taken back
ACQUIRE_WAIT_S = 5.0  # how long one long poll for a slot waits before asking again


class LedgerUnavailable(Exception):
    """The quota ledger did not answer: a quota cannot be checked."""


class _Bucket:
    """A minute's tokens, refilled continuously (the ledger's side of flow_control.TokenBucket)."""

    __slots__ = ("capacity", "rate", "level", "at")

    def __init__(self, per_minute: int, now: float):
        self.capacity, self.rate, self.level, self.at = float(per_minute), per_minute / 60.0, float(per_minute), now

    def refill(self, per_minute: int, now: float) -> None:
        if per_minute != self.capacity:  # a new config: the new rate from now on
            self.capacity, self.rate = float(per_minute), per_minute / 60.0
        self.level = min(self.capacity, self.level + (now - self.at) * self.rate)
        self.at = now


class QuotaLedger:
    """The cluster's count of every limited tenant's tokens and slots; the ingress replicas lease from it.
    Keys are `<model>/<tenant>`; holders are `<replica>/<model>`. Every method is async, so that a Ray actor
    of it runs them all on its one event loop."""

    def __init__(self, lease_ttl_s: float = LEASE_TTL_S, clock: Callable[[], float] = time.monotonic):
        self.lease_ttl_s = lease_ttl_s
        self.clock = clock
        self.buckets: dict[str, _Bucket] = {}
        self.slots: dict[str, dict[str, int]] = {}  # holder -> key -> slots held
        self.seen: dict[str, float] = {}  # holder -> when it last called
        self._freed = asyncio.Event()  # set (and replaced) whenever slots come back

    # ---- tokens ---------------------------------------------------------------------------------------

    async def borrow_tokens(self, key: str, per_minute: int, need: int, extra: int) -> tuple[int, float]:
        """Take `need` tokens and up to `extra` more (as many as the bucket has): (tokens taken, 0); or take
        nothing and return (0, seconds until `need` are there)."""
        bucket = self._bucket(key, per_minute)
        if bucket.level < need:
            return 0, (need - bucket.level) / bucket.rate
        granted = need + max(0, min(extra, int(bucket.level - need)))
        bucket.level -= granted
        return granted, 0.0

    async def return_tokens(self, key: str, per_minute: int, tokens: int) -> None:
        bucket = self._bucket(key, per_minute)
        bucket.level = min(bucket.capacity, bucket.level + max(0, tokens))

    def _bucket(self, key: str, per_minute: int) -> _Bucket:
        now = self.clock()
        bucket = self.buckets.get(key)
        if bucket is None:
            bucket = self.buckets[key] = _Bucket(per_minute, now)
        bucket.refill(per_minute, now)
        return bucket

    # ---- slots ----------------------------------------------------------------------------------------

    async def acquire_slot(self, holder: str, key: str, cap: int, wait_s: float = ACQUIRE_WAIT_S) -> bool:
        """One more slot of `key` for `holder` while fewer than `cap` are held cluster-wide: True at once or
        as soon as one comes back within `wait_s`, else False."""
        deadline = self.clock() + wait_s
        while True:
            self._touch(holder)
            if self.held(key) < cap:
                held = self.slots.setdefault(holder, {})
                held[key] = held.get(key, 0) + 1
                return True
            left = deadline - self.clock()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._freed.wait(), min(left, self.lease_ttl_s / 2))
            except asyncio.TimeoutError:
                pass  # look again: a silent holder may have expired meanwhile

    async def release_slots(self, holder: str, key: str, n: int = 1) -> None:
        self._touch(holder)
        held = self.slots.get(holder, {})
        if key in held:
            held[key] = max(0, held[key] - n)
            if not held[key]:
                del held[key]
        self._wake()

    async def renew(self, holder: str, held: dict[str, int]) -> None:
        """`holder` is alive and holds `held`. A holder the ledger does not know (it restarted, or took the
        holder for gone) is taken at its word; otherwise the ledger's own count stands: a report can cross a
        grant on its way."""
        if holder not in self.slots:
            self.slots[holder] = {k: n for k, n in held.items() if n > 0}
        self._touch(holder)

    def held(self, key: str) -> int:
        self._expire()
        return sum(slots.get(key, 0) for slots in self.slots.values())

    async def report(self) -> dict:
        """What the ledger holds, for `tandem status` and tests."""
        self._expire()
        return {"slots": {h: dict(s) for h, s in self.slots.items() if s},
                "tokens": {k: b.level for k, b in self.buckets.items()}}

    def _touch(self, holder: str) -> None:
        self.seen[holder] = self.clock()

    def _expire(self) -> None:
        now = self.clock()
        gone = [h for h, at in self.seen.items() if now - at > self.lease_ttl_s]
        for holder in gone:
            del self.seen[holder]
            if self.slots.pop(holder, None):
                logger.warning("ingress %s has not renewed its quota slots for %.0fs: they are taken back", holder,
                               self.lease_ttl_s)
                self._wake()

    def _wake(self) -> None:
        self._freed.set()
        self._freed = asyncio.Event()


class SharedQuotas:
    """One ingress replica's leases from the ledger, for one model's flow control. `ledger` is the actor's
    handle (or anything whose methods have `.remote(...)` returning an awaitable)."""

    def __init__(self, ledger, model: str, replica: str, replicas: int, errors=None):
        self.ledger = ledger
        self.model = model
        self.holder = f"{replica}/{model}"
        self.replicas = max(1, replicas)
        self.errors = errors  # a prometheus Counter: calls to the ledger that failed
        self.prepaid: dict[str, int] = {}  # tenant -> tokens borrowed and not used yet
        self.held: dict[str, int] = {}  # tenant -> slots leased
        self._locks: dict[str, asyncio.Lock] = {}
        self._acquiring: dict[str, asyncio.Task] = {}
        self._tasks: set[asyncio.Task] = set()

    def key(self, tenant: str) -> str:
        return f"{self.model}/{tenant}"

    def slice(self, per_minute: int) -> int:
        return int(per_minute * SLICE_FRACTION / self.replicas)

    async def take_tokens(self, tenant: str, per_minute: int, cost: int) -> float:
        """Charge `cost` tokens: 0, or the seconds until the ledger has them (nothing charged). Raises
        LedgerUnavailable."""
        lock = self._locks.setdefault(tenant, asyncio.Lock())
        async with lock:
            have = self.prepaid.get(tenant, 0)
            if have < cost:
                granted, wait_s = await self._call(self.ledger.borrow_tokens, self.key(tenant), per_minute,
                                                   cost - have, self.slice(per_minute))
                if wait_s:
                    return wait_s
                have += granted
            self.prepaid[tenant] = have - cost
            return 0.0

    def give_back(self, tenant: str, per_minute: int, tokens: int) -> None:
        """Tokens charged and not used: kept up to one slice, the rest returned to the ledger."""
        have = self.prepaid.get(tenant, 0) + tokens
        keep = self.slice(per_minute)
        self.prepaid[tenant] = min(have, keep)
        if have > keep:
            self._background(self.ledger.return_tokens, self.key(tenant), per_minute, have - keep)

    def has_slot(self, tenant: str, running: int) -> bool:
        return running < self.held.get(tenant, 0)

    def want_slot(self, tenant: str, cap: int, needed: Callable[[], int], on_slot: Callable[[], None],
                  on_error: Callable[[Exception], None]) -> None:
        """Lease slots of `tenant` from the ledger while it holds fewer than `needed()` (its requests running
        and queued here), calling `on_slot()` after each; one lease at a time per tenant. A slot that comes
        when no longer needed (its client left meanwhile) goes back. `on_error` when the ledger does not
        answer."""
        task = self._acquiring.get(tenant)
        if task is not None and not task.done():
            return

        async def lease() -> None:
            while self.held.get(tenant, 0) < needed():
                try:
                    ok = await self._call(self.ledger.acquire_slot, self.holder, self.key(tenant), cap,
                                          ACQUIRE_WAIT_S)
                except LedgerUnavailable as exc:
                    on_error(exc)
                    return
                if ok:
                    self.held[tenant] = self.held.get(tenant, 0) + 1
                    on_slot()
                    self.trim(tenant, needed())

        self._acquiring[tenant] = asyncio.get_running_loop().create_task(lease())

    def trim(self, tenant: str, needed: int) -> None:
        """Give back the slots of `tenant` beyond `needed` (its requests running and queued here)."""
        surplus = self.held.get(tenant, 0) - needed
        if surplus > 0:
            self.held[tenant] -= surplus
            self._background(self.ledger.release_slots, self.holder, self.key(tenant), surplus)

    async def renew_forever(self) -> None:
        while True:
            await asyncio.sleep(RENEW_S)
            try:
                await self._call(self.ledger.renew, self.holder, {self.key(t): n for t, n in self.held.items() if n})
            except LedgerUnavailable as exc:
                logger.warning("cannot renew this replica's quota slots: %s", exc)

    async def _call(self, method, *args):
        try:
            return await method.remote(*args)
        except (ray.exceptions.RayError, ConnectionError, OSError) as exc:
            if self.errors is not None:
                self.errors.inc()
            raise LedgerUnavailable(f"the quota ledger did not answer: {exc}") from exc

    def _background(self, method, *args) -> None:
        async def call() -> None:
            try:
                await self._call(method, *args)
            except LedgerUnavailable as exc:
                logger.warning("%s", exc)

        task = asyncio.get_running_loop().create_task(call())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
