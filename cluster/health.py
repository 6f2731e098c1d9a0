"""What the controller's health checks conclude, from the pings' outcomes. No Ray: `WorkerPool.ping` turns
each ping's reply into a `Ping`, and `observe` applies them to the pool's members.

A worker is healthy when its last ping answered. Dead for good (Ray will not restart it) takes two checks in a
row that found the actor dead: a ping in flight when the process crashed fails alike even if Ray restarts it,
and a ping sent while it restarts waits for the new process instead. Stalled: it answers, but its engine loop
has been stuck past the pool's `stall_timeout_s`.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

DEAD_AFTER_CHECKS = 2


@dataclass(slots=True)
class Ping:
    """One health ping's outcome: answered (`ok`), found the actor dead (`died`), or found its engine loop
    stuck (`stalled`: why)."""
    ok: bool
    died: bool = False
    stalled: str | None = None


@dataclass(slots=True)
class HealthChanges:
    """What one round of checks changed in a pool: workers whose health flipped (id -> healthy now), those
    to restart (stalled) and those to remove (dead for good, not draining: a drain removes its own)."""
    flipped: dict[str, bool] = field(default_factory=dict)
    stalled: list = field(default_factory=list)
    dead: list = field(default_factory=list)


def observe(workers: Iterable, pings: dict[str, Ping]) -> HealthChanges:
    """Apply `pings` (worker id -> outcome) to the pool's `workers` (WorkerInfo: `healthy`, `died`, `stalled`,
    `draining` are updated or read); workers without a ping keep their state."""
    changes = HealthChanges()
    for info in workers:
        ping = pings.get(info.worker_id)
        if ping is not None:
            if info.healthy != ping.ok:
                changes.flipped[info.worker_id] = ping.ok
            info.healthy = ping.ok
            info.died = info.died + 1 if ping.died else 0
            info.stalled = ping.stalled
        if info.stalled:
            changes.stalled.append(info)
        if info.died >= DEAD_AFTER_CHECKS and not info.draining:
            changes.dead.append(info)
    return changes
