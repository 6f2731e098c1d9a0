"""The cluster controller: one named Ray actor that owns the pools, watches health, scales and drains.

Ingress replicas, the CLI, the admin API and the autoscaler all go through it. Membership carries a
version number; every change that affects routing (a worker ready, draining, unhealthy or removed)
bumps it, and ingress replicas refresh their view when it changes.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools, WorkerInfo, WorkerPool

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"


@dataclass(slots=True)
class WorkerEntry:
    worker_id: str
    pool: str
    actor: object
    healthy: bool
    draining: bool


@dataclass(slots=True)
class Membership:
    version: int
    workers: list[WorkerEntry] = field(default_factory=list)


@dataclass(slots=True)
class ScalingEvent:
    time: float
    pool: str
    action: str  # "add", "drain", "remove", "unhealthy", "recovered"
    worker_id: str
    reason: str = ""


class ClusterController:
    """Owns both pools. Scale-up registers a worker only once its model is loaded; scale-down drains:
    the worker takes no new requests, its in-flight ones finish, then it leaves."""

    def __init__(self, config: ClusterConfig, health_interval_s: float = 2.0):
        self.config = config
        self.pools = Pools(config)
        self.version = 0
        self.events: list[ScalingEvent] = []
        self.lock = threading.RLock()
        self.health_interval_s = health_interval_s
        self._stop = threading.Event()
        self.pools.start()
        self._bump()
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()

    # ---- membership -----------------------------------------------------------------------------

    def membership(self, known_version: int = -1, wait_s: float = 0.0) -> Membership:
        """The current workers; waits up to `wait_s` for a version newer than `known_version`."""
        deadline = time.monotonic() + wait_s
        while self.version == known_version and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            entries = [WorkerEntry(w.worker_id, w.pool, w.actor, w.healthy, w.draining)
                       for pool in self.pools.pools() for w in pool.workers.values()]
            return Membership(self.version, entries)

    def config_dict(self) -> dict:
        return self.config.model_dump()

    # ---- operator actions ---------------------------------------------------------------------

    def scale(self, pool: str, replicas: int, reason: str = "operator") -> list[str]:
        """Grow or shrink `pool` to `replicas` workers (draining not counted); returns affected ids."""
        target = self._pool(pool)
        limits = self.config.prefill if pool == "prefill" else self.config.decode
        if not 0 <= replicas <= max(limits.max_replicas, 0) or replicas > 256:
            raise ValueError(f"{pool} replicas must be in [0, {limits.max_replicas}], got {replicas}")
        if pool == "decode" and replicas == 0:
            raise ValueError("the decode pool needs at least one worker")
        with self.lock:
            active = [w for w in target.workers.values() if not w.draining]
        if replicas > len(active):
            return self._add(target, replicas - len(active), reason)
        victims = sorted(active, key=lambda w: self._load(w))[: len(active) - replicas]
        for w in victims:
            self.drain(w.worker_id, reason)
        return [w.worker_id for w in victims]

    def drain(self, worker_id: str, reason: str = "operator", timeout_s: float = 600.0) -> bool:
        """Stop routing to a worker, let its in-flight requests finish, then remove it."""
        pool, info = self._find(worker_id)
        with self.lock:
            info.draining = True
            self._record(pool.pool, "drain", worker_id, reason)
            self._bump()
        ray.get(info.actor.drain.remote())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if ray.get(info.actor.num_in_flight.remote(), timeout=10) == 0:
                    break
            except ray.exceptions.RayError:
                break
            time.sleep(0.1)
        with self.lock:
            pool.remove(worker_id)
            self._record(pool.pool, "remove", worker_id, reason)
            self._bump()
        return True

    def status(self) -> dict:
        """Pools and workers with health, load, KV usage and prefix hit rates, for `tandem status`."""
        out = {"version": self.version, "mode": self.config.mode, "model": self.config.model_name, "pools": {}}
        for pool in self.pools.pools():
            rows = []
            for w in list(pool.workers.values()):
                row = {"worker_id": w.worker_id, "healthy": w.healthy, "draining": w.draining}
                try:
                    stats = ray.get(w.actor.stats.remote(), timeout=5)
                    row.update(running=stats.num_running, waiting=stats.num_waiting,
                               kv_usage=round(stats.kv_usage, 4),
                               prefix_hit_rate=round(stats.prefix_cache_hits / max(stats.prefix_cache_queries, 1), 4))
                except ray.exceptions.RayError as exc:
                    row["error"] = type(exc).__name__
                rows.append(row)
            out["pools"][pool.pool] = rows
        return out

    def scaling_events(self, since: float = 0.0) -> list[ScalingEvent]:
        return [e for e in self.events if e.time > since]

    def shutdown(self) -> None:
        self._stop.set()
        self.pools.shutdown()

    # ---- internals ------------------------------------------------------------------------------

    def _add(self, pool: WorkerPool, n: int, reason: str) -> list[str]:
        with self.lock:
            infos = pool.scale_up(n)
        pool.wait_ready(infos)
        with self.lock:
            for info in infos:
                self._record(pool.pool, "add", info.worker_id, reason)
            self._bump()
        return [i.worker_id for i in infos]

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for pool in self.pools.pools():
                with self.lock:
                    before = {wid: w.healthy for wid, w in pool.workers.items()}
                after = pool.check_health(timeout_s=max(self.health_interval_s, 2.0))
                changed = {wid for wid, ok in after.items() if before.get(wid) is not None and before[wid] != ok}
                if changed:
                    with self.lock:
                        for wid in changed:
                            self._record(pool.pool, "recovered" if after[wid] else "unhealthy", wid, "health check")
                        self._bump()

    def _pool(self, name: str) -> WorkerPool:
        pool = self.pools.prefill if name == "prefill" else self.pools.decode if name == "decode" else None
        if pool is None:
            raise ValueError(f"no {name!r} pool in {self.config.mode} mode (pools: prefill, decode)")
        return pool

    def _find(self, worker_id: str) -> tuple[WorkerPool, WorkerInfo]:
        for pool in self.pools.pools():
            if worker_id in pool.workers:
                return pool, pool.workers[worker_id]
        raise KeyError(f"no worker {worker_id!r}; `tandem status` lists them")

    def _load(self, info: WorkerInfo) -> int:
        try:
            return ray.get(info.actor.num_in_flight.remote(), timeout=5)
        except ray.exceptions.RayError:
            return -1

    def _record(self, pool: str, action: str, worker_id: str, reason: str) -> None:
        self.events.append(ScalingEvent(time.time(), pool, action, worker_id, reason))
        del self.events[:-1000]
        logger.info("scaling: %s %s %s (%s)", pool, action, worker_id, reason)

    def _bump(self) -> None:
        self.version += 1


def start_controller(config: ClusterConfig, detached: bool = False):
    """Create the named controller actor (which starts the pools) and wait until it is up."""
    options = {"name": f"{config.name}-{CONTROLLER_NAME}", "namespace": config.namespace, "num_cpus": 0,
               "max_concurrency": 32}
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(ClusterController).options(**options).remote(config)
    ray.get(actor.membership.remote())
    return actor


def get_controller(name: str = "tandem", namespace: str = "tandem"):
    return ray.get_actor(f"{name}-{CONTROLLER_NAME}", namespace=namespace)
