"""How many workers each pool should have, and the steps from what it has: the controller's scaling and
drain decisions. No Ray: the controller carries the steps out on the pools.

`desired` is the size the pool returns to after a worker dies (when the pool replaces dead workers): set by
every `scale`, lowered by a drain (a drained worker is not replaced), kept from the adopted workers when a
controller restarts.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from cluster.config import PoolConfig
from worker_runtime.membership import ScaleResult


@dataclass(slots=True)
class ScaleStep:
    """What one `scale` call does: start `add` workers, or drain the `drain` ones; `event` is the decision
    to log ("scale_up", "scale_down"), None when the pool is already at its target."""
    result: ScaleResult
    add: int = 0
    drain: list = field(default_factory=list)
    event: str | None = None


class ScalingPlan:
    """Each pool's limits (from its PoolConfig) and desired size."""

    def __init__(self, pools: dict[str, PoolConfig]):
        self.limits = pools
        self.desired = {pool: config.replicas for pool, config in pools.items()}

    def check_target(self, pool: str, replicas: int) -> None:
        """Raise ValueError, saying which limit, unless `pool` may have `replicas` workers."""
        limit = self.limits[pool].max_replicas
        if not 0 <= replicas <= limit:
            raise ValueError(f"{pool} replicas must be in [0, {limit}] (max_replicas), got {replicas}")
        if pool == "decode" and replicas == 0:
            raise ValueError("the decode pool needs at least one worker")

    def scale(self, pool: str, active: Sequence, replicas: int, in_flight: Callable[[object], int]) -> ScaleStep:
        """The step from the `active` (not draining) workers to `replicas`; a scale-down drains the workers with
        the fewest requests in flight (`in_flight(worker)`). The new target is desired from now on."""
        self.check_target(pool, replicas)
        self.desired[pool] = replicas
        step = ScaleStep(ScaleResult(pool, len(active), replicas))
        if replicas > len(active):
            step.add, step.event = replicas - len(active), "scale_up"
        elif replicas < len(active):
            step.drain = sorted(active, key=in_flight)[: len(active) - replicas]
            step.event = "scale_down"
        return step

    def check_drain(self, pool: str, worker, active: Sequence) -> None:
        """Refuse (ValueError) to drain the last decode worker: nothing could serve the requests that follow."""
        if pool == "decode" and list(active) == [worker]:
            raise ValueError(f"{worker.worker_id} is the last decode worker; scale the decode pool up first")

    def drained(self, pool: str, active: Sequence) -> None:
        """After an operator's drain: the pool keeps the workers it has left (a drained worker is not replaced)."""
        self.desired[pool] = len(active)

    def adopted(self, pool: str, active: Sequence) -> int:
        """After a controller restart adopted `active` workers: keep the pool at that size (an operator's or
        the autoscaler's choice). Returns how many to start when it has none but should have some."""
        if active:
            self.desired[pool] = len(active)
            return 0
        return self.desired[pool]

    def missing(self, pool: str, active: Sequence) -> int:
        """How many workers replacing the dead should start: the pool is back at its desired size then."""
        return max(0, self.desired[pool] - len(active))
