"""The controller's log of scaling decisions and worker changes: the newest events, and counts since start
(what /metrics exports). No Ray."""
from __future__ import annotations

import collections
import logging
import threading
import time

from worker_runtime.membership import ScalingEvent

logger = logging.getLogger(__name__)


class EventLog:
    """Keeps the last `max_events` events; `counts` per (pool, action) cover every event since start."""

    def __init__(self, max_events: int = 1000):
        self.max_events = max_events
        self.events: collections.deque[ScalingEvent] = collections.deque(maxlen=max_events)
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def record(self, pool: str, action: str, worker_id: str, reason: str) -> None:
        with self._lock:
            self.events.append(ScalingEvent(time.time(), pool, action, worker_id, reason))
            self.counts[(pool, action)] += 1
        logger.info("scaling: %s %s %s (%s)", pool, action, worker_id, reason)

    def since(self, t: float) -> list[ScalingEvent]:
        """The kept events newer than `t` (wall-clock seconds), oldest first."""
        with self._lock:
            return [e for e in self.events if e.time > t]

    def totals(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.counts)
