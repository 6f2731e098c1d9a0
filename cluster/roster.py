"""The controller's versioned membership: every change that affects routing bumps the version and wakes the
ingress replicas long-polling for a newer one. No Ray.

The controller is a threaded Ray actor (its scaling calls block on workers), so the long poll waits on a
`threading.Condition`, not an asyncio one: each waiting call holds one of the actor's threads, as before.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from worker_runtime.membership import Membership, WorkerEntry


class Roster:
    """The version of the membership, and the condition its long polls wait on. Changes happen inside
    `change()`, which holds the lock for their duration and bumps the version once at the end."""

    def __init__(self, version: int | None = None):
        # From the clock by default: a restarted controller's versions never repeat one an ingress already saw.
        self.version = time.time_ns() // 1000 if version is None else version
        self._changed = threading.Condition(threading.RLock())

    @contextmanager
    def change(self) -> Iterator[None]:
        """Make a change that affects routing: nobody reads the membership halfway; waiters wake after it."""
        with self._changed:
            yield
            self.version += 1
            self._changed.notify_all()

    def membership(self, workers: Callable[[], Iterable[WorkerEntry]], known_version: int = -1,
                   wait_s: float = 0.0) -> Membership:
        """Copies of the entries `workers()` lists, at the current version; first waits up to `wait_s` for a
        version other than `known_version`. Copies: the caller's records keep changing after the reply."""
        with self._changed:
            self._changed.wait_for(lambda: self.version != known_version, timeout=wait_s)
            return Membership(self.version, [WorkerEntry(w.worker_id, w.pool, w.actor, w.healthy, w.draining)
                                             for w in workers()])
