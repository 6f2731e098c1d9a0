"""The autoscaler's policy: one pool's load signals in, a replica count out. Pure: no Ray, no clock.

Prefill scales on queued prefill tokens per worker and TTFT; decode on KV cache usage, running
sequences per worker and ITL. Hysteresis: a pool grows when any signal is above its `up` value and
shrinks only when every signal, projected onto one worker fewer, is below its `down` value.
Cooldowns keep it from flapping while new workers warm up or a drain settles.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from worker_runtime.protocol import WorkerStats


@dataclass(slots=True)
class Thresholds:
    """`per_worker` signals are averages that spread over the pool, so removing a worker raises them by
    n/(n-1); latencies are taken as they are."""
    up: float
    down: float
    per_worker: bool = True

    def __post_init__(self):
        if not self.down < self.up:
            raise ValueError(f"down threshold {self.down} must be below up threshold {self.up}")


@dataclass(slots=True)
class Decision:
    """What the policy wants for one pool, and why."""
    pool: str
    current: int
    desired: int
    reason: str
    signals: dict[str, float | None] = field(default_factory=dict)

    @property
    def action(self) -> str:
        return "scale_up" if self.desired > self.current else "scale_down" if self.desired < self.current \
            else "hold"


def pool_signals(pool: str, stats: list[WorkerStats], latency: dict[str, float | None]) -> dict[str, float | None]:
    """The signals one pool scales on, from its workers' stats and the recent latency quantiles."""
    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else None

    if pool == "prefill":
        return {"queued_prefill_tokens": mean(s.queued_prefill_tokens for s in stats),
                "ttft_s": latency.get("ttft_s")}
    return {"kv_usage": mean(s.kv_usage for s in stats),
            "num_running": mean(s.num_running for s in stats),
            "itl_s": latency.get("itl_s")}


class ScalingPolicy:
    """Decides one pool's replica count from its signals; remembers its own last changes for cooldowns."""

    def __init__(self, pool: str, min_replicas: int, max_replicas: int, thresholds: dict[str, Thresholds],
                 upscale_cooldown_s: float, downscale_cooldown_s: float):
        if not 0 <= min_replicas <= max_replicas:
            raise ValueError(f"{pool}: need 0 <= min_replicas <= max_replicas, got {min_replicas}, {max_replicas}")
        self.pool = pool
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.thresholds = thresholds
        self.upscale_cooldown_s = upscale_cooldown_s
        self.downscale_cooldown_s = downscale_cooldown_s
        self.last_up = -math.inf
        self.last_change = -math.inf

    def decide(self, replicas: int, signals: dict[str, float | None], now: float) -> Decision:
        """The replica count for the pool at time `now` (seconds, any monotonic clock)."""
        def decision(desired: int, reason: str) -> Decision:
            if desired > replicas:
                self.last_up = self.last_change = now
            elif desired < replicas:
                self.last_change = now
            return Decision(self.pool, replicas, desired, reason, dict(signals))

        if replicas < self.min_replicas:
            return decision(self.min_replicas, f"below min_replicas={self.min_replicas}")
        if replicas > self.max_replicas:
            return decision(self.max_replicas, f"above max_replicas={self.max_replicas}")
        known = {name: value for name, value in signals.items() if value is not None and name in self.thresholds}
        over = {name: value / self.thresholds[name].up for name, value in known.items()
                if value > self.thresholds[name].up}
        if over:
            name = max(over, key=over.get)
            reason = f"{name}={known[name]:.3g} > {self.thresholds[name].up:g}"
            if replicas >= self.max_replicas:
                return decision(replicas, f"{reason}, at max_replicas={self.max_replicas}")
            if now - self.last_up < self.upscale_cooldown_s:
                return decision(replicas, f"{reason}, upscale cooldown")
            # Grow in proportion to the worst overload, at most doubling per decision.
            step = max(1, math.ceil(replicas * (min(over[name], 2.0) - 1.0)))
            return decision(min(self.max_replicas, replicas + step), reason)
        if not known or replicas <= self.min_replicas:
            return decision(replicas, "no signal" if not known else "at min_replicas")
        projected = {name: self._projected(name, value, replicas) for name, value in known.items()}
        busy = [name for name, value in projected.items() if value >= self.thresholds[name].down]
        if busy:
            return decision(replicas, f"within band ({', '.join(busy)})")
        if now - self.last_change < self.downscale_cooldown_s:
            return decision(replicas, "idle, downscale cooldown")
        return decision(replicas - 1, "idle: " + ", ".join(f"{n}={v:.3g}" for n, v in known.items()))

    def _projected(self, name: str, value: float, replicas: int) -> float:
        if not self.thresholds[name].per_worker or replicas <= 1:
            return value
        return value * replicas / (replicas - 1)


class LatencyWindow:
    """Recent latency samples by name ("ttft_s", "itl_s") with their arrival times; quantiles over a window."""

    def __init__(self, max_samples: int = 8192):
        self.samples: dict[str, deque[tuple[float, float]]] = {}
        self.max_samples = max_samples

    def add(self, name: str, values: list[float], now: float) -> None:
        queue = self.samples.setdefault(name, deque(maxlen=self.max_samples))
        queue.extend((now, float(v)) for v in values)

    def quantile(self, name: str, q: float, since: float) -> float | None:
        """The q-quantile (nearest rank) of the samples newer than `since`; None without samples."""
        values = sorted(v for t, v in self.samples.get(name, ()) if t >= since)
        if not values:
            return None
        return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]
