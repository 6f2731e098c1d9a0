"""The cluster controller: one named Ray actor that owns the pools, watches health, scales and drains.

Ingress replicas, the CLI, the admin API and the autoscaler all go through it. Membership carries a
version number; every change that affects routing (a worker ready, draining, unhealthy or removed)
bumps it, and ingress replicas refresh their view when it changes.
"""
from __future__ import annotations

import collections
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from cluster.config import ClusterConfig
from worker_runtime.membership import Membership, ScaleResult, ScalingEvent, ScalingReport, WorkerEntry
from cluster.pools import Pools, WorkerInfo, WorkerPool, stop_named_workers, stop_worker
from cluster.scaling_policy import LatencyWindow

logger = logging.getLogger(__name__)

CONTROLLER_NAME = "controller"

# The control plane (controller, autoscaler, metrics hub) runs on the Ray head, beside Serve's controller:
# not on a worker host, whose loss would take it along with that host's workers.
ON_HEAD = {"resources": {"node:__internal_head__": 0.001}}


class ClusterController:
    """Owns both pools. Scale-up registers a worker only once its model is loaded; scale-down drains:
    the worker takes no new requests, its in-flight ones finish, then it leaves. Scaling operations on
    one pool run one at a time, in call order.

    A drain first takes the worker out of membership routing and only after `drain_grace_s` makes the
    worker itself refuse new requests: requests routed to it just before (still in their prefill on
    another worker) are accepted, as a load balancer deregisters a target before stopping it."""

    def __init__(self, config: ClusterConfig, health_interval_s: float = 2.0, drain_grace_s: float = 2.0,
                 transfer_token: str | None = None):
        """`transfer_token`: the KV servers' token when the config sets none. Ray restarts a crashed
        controller with the same arguments, so the restarted one shares it with the workers it adopts."""
        enable_info_logging()
        self.config = config
        self.drain_grace_s = drain_grace_s
        self.pools = Pools(config, transfer_token)
        # Versions start from the clock: a restarted controller's never repeat one an ingress already saw.
        self.version = time.time_ns() // 1000
        self.events: list[ScalingEvent] = []
        self.event_counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.lock = threading.RLock()
        self.pool_locks = {pool.pool: threading.Lock() for pool in self.pools.pools()}
        self.desired = {pool.pool: pool.pool_config.replicas for pool in self.pools.pools()}
        self.latency = LatencyWindow()
        self.health_interval_s = health_interval_s
        self._stop = threading.Event()
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._adopt()
        else:
            stop_named_workers(config.name, config.namespace)  # left by a controller that was killed for good
            self.pools.start()
        self._bump()
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()

    def _adopt(self) -> None:
        """After a crash: take over the live workers, keeping each pool at the size it had (an operator's or
        the autoscaler's choice); finish the drains that were under way; start the pools that lost every
        worker afresh."""
        adopted = self.pools.adopt()
        for pool in self.pools.pools():
            infos = adopted[pool.pool]
            for info in infos:
                self._record(pool.pool, "adopt", info.worker_id, "controller restarted")
            active = [info for info in infos if not info.draining]
            if active:
                self.desired[pool.pool] = len(active)
            elif self.desired[pool.pool] > 0:
                self._add(pool, self.desired[pool.pool], "controller restarted without workers")
            draining = [info for info in infos if info.draining]
            if draining:
                threading.Thread(target=self._finish_drain, args=(pool, draining), daemon=True).start()
        logger.info("controller restarted: adopted %s",
                    {pool: [info.worker_id for info in infos] for pool, infos in adopted.items()})

    def _finish_drain(self, pool: WorkerPool, infos: list[WorkerInfo]) -> None:
        with self.pool_locks[pool.pool]:
            self._drain(pool, infos, "drain under way when the controller restarted")

    # ---- membership -----------------------------------------------------------------------------

    def membership(self, known_version: int = -1, wait_s: float = 0.0) -> Membership:
        """The ready workers; waits up to `wait_s` for a version newer than `known_version`."""
        deadline = time.monotonic() + wait_s
        while self.version == known_version and time.monotonic() < deadline:
            time.sleep(0.05)
        with self.lock:
            entries = [WorkerEntry(w.worker_id, w.pool, w.actor, w.healthy, w.draining)
                       for pool in self.pools.pools() for w in list(pool.workers.values()) if w.ready]
            return Membership(self.version, entries)

    def config_dict(self) -> dict:
        return self.config.model_dump()

    # ---- operator actions ---------------------------------------------------------------------

    def scale(self, pool: str, replicas: int, reason: str = "operator") -> ScaleResult:
        """Grow or shrink `pool` to `replicas` workers (draining ones not counted). Returns when the new
        workers are ready and registered, or when the drained ones have finished their requests and left."""
        target = self._check_target(pool, replicas)
        with self.pool_locks[pool]:
            active = self._active(target)
            result = ScaleResult(pool, len(active), replicas)
            self.desired[pool] = replicas
            if replicas == len(active):
                return result
            self._record(pool, "scale_up" if replicas > len(active) else "scale_down", "",
                         f"{reason}: {len(active)} -> {replicas}")
            if replicas > len(active):
                result.added = self._add(target, replicas - len(active), reason)
            else:
                victims = sorted(active, key=self._in_flight)[: len(active) - replicas]
                self._drain(target, victims, reason)
                result.drained = [w.worker_id for w in victims]
            return result

    def scale_pools(self, targets: dict[str, int], reason: str = "operator") -> list[ScaleResult]:
        """Scale several pools at once: every target is checked before any pool changes, then the pools
        scale concurrently."""
        for pool, replicas in targets.items():
            self._check_target(pool, replicas)
        with ThreadPoolExecutor(max_workers=max(len(targets), 1)) as executor:
            return list(executor.map(lambda item: self.scale(*item, reason), targets.items()))

    def drain(self, worker_id: str, reason: str = "operator", timeout_s: float = 600.0) -> str:
        """Stop routing to a worker, let its in-flight requests finish, then remove it; returns its pool.
        The last decode worker cannot be drained: nothing could serve the requests that follow."""
        pool = self._find(worker_id)[0]
        with self.pool_locks[pool.pool]:
            info = self._find(worker_id)[1]
            if pool.pool == "decode" and self._active(pool) == [info]:
                raise ValueError(f"{worker_id} is the last decode worker; scale the decode pool up first")
            self._drain(pool, [info], reason, timeout_s)
            self.desired[pool.pool] = len(self._active(pool))  # a drained worker is not replaced
        return pool.pool

    def status(self) -> dict:
        """Pools and workers with health, load, KV usage, prefix hit rates and (decode workers) KV pulls that
        fell back to local recompute, per reason, for `tandem status`."""
        out = {"version": self.version, "mode": self.config.mode, "model": self.config.model_name,
               "controller_node": ray.util.get_node_ip_address(), "pools": {}}
        for pool in self.pools.pools():
            workers = list(pool.workers.values())
            refs = [w.actor.stats.remote() if w.ready else None for w in workers]
            # Decode workers count the pulls that fell back to local recompute, per reason.
            transfer = [w.actor.transfer_stats.remote() if w.ready and pool.pool == "decode" else None
                        for w in workers]
            rows = []
            for w, ref, transfer_ref in zip(workers, refs, transfer):
                state = "starting" if not w.ready else "draining" if w.draining else \
                    "healthy" if w.healthy else "unhealthy"
                row = {"worker_id": w.worker_id, "state": state}
                if ref is not None:
                    try:
                        s = ray.get(ref, timeout=5)
                        row.update(running=s.num_running, waiting=s.num_waiting,
                                   queued_prefill_tokens=s.queued_prefill_tokens, kv_usage=round(s.kv_usage, 4),
                                   prefix_cache_queries=s.prefix_cache_queries,
                                   prefix_cache_hits=s.prefix_cache_hits,
                                   prefix_hit_rate=round(s.prefix_cache_hits / max(s.prefix_cache_queries, 1), 4))
                        if transfer_ref is not None:
                            failures = ray.get(transfer_ref, timeout=5)["transfer_failures_by_reason"]
                            row.update(kv_transfer_failures=sum(failures.values()),
                                       kv_transfer_failures_by_reason={r: n for r, n in failures.items() if n})
                    except ray.exceptions.RayError as exc:
                        row["error"] = type(exc).__name__
                rows.append(row)
            out["pools"][pool.pool] = {"replicas": len(self._active(pool)), "desired": self.desired[pool.pool],
                                       "min_replicas": pool.pool_config.min_replicas,
                                       "max_replicas": pool.pool_config.max_replicas, "workers": rows}
        return out

    def scaling_events(self, since: float = 0.0) -> list[ScalingEvent]:
        return [e for e in self.events if e.time > since]

    def scaling_report(self) -> ScalingReport:
        with self.lock:
            return ScalingReport(dict(self.event_counts),
                                 {p.pool: len(self._active(p)) for p in self.pools.pools()}, dict(self.desired))

    # ---- latencies the ingress observed, for the autoscaler ------------------------------------

    def report_latencies(self, ttft_s: list[float] = (), itl_s: list[float] = ()) -> None:
        """Ingress replicas send the TTFTs and inter-token gaps of finished requests (batched)."""
        now = time.monotonic()
        self.latency.add("ttft_s", list(ttft_s), now)
        self.latency.add("itl_s", list(itl_s), now)

    def latency_quantiles(self, window_s: float = 60.0, q: float = 0.9) -> dict[str, float | None]:
        since = time.monotonic() - window_s
        return {name: self.latency.quantile(name, q, since) for name in ("ttft_s", "itl_s")}

    def shutdown(self) -> None:
        self._stop.set()
        self.pools.shutdown()

    # ---- internals ------------------------------------------------------------------------------

    def _add(self, pool: WorkerPool, n: int, reason: str) -> list[str]:
        with self.lock:
            infos = pool.scale_up(n)
        try:
            pool.wait_ready(infos)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise RuntimeError(f"{n} new {pool.pool} worker(s) did not start: {exc}") from None
        with self.lock:
            for info in infos:
                self._record(pool.pool, "add", info.worker_id, reason)
            self._bump()
        return [i.worker_id for i in infos]

    def _drain(self, pool: WorkerPool, infos: list[WorkerInfo], reason: str, timeout_s: float = 600.0) -> None:
        with self.lock:
            for info in infos:
                info.draining = True
                self._record(pool.pool, "drain", info.worker_id, reason)
            self._bump()
        time.sleep(self.drain_grace_s)
        for info in infos:
            try:
                ray.get(info.actor.drain.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass  # a dead worker has nothing in flight; a stuck one is waited for below
        deadline = time.monotonic() + timeout_s
        pending = list(infos)
        while pending and time.monotonic() < deadline:
            pending = [info for info in pending if self._in_flight(info) > 0]
            if pending:
                time.sleep(0.1)
        if pending:
            logger.warning("drain timed out after %.0f s; removing %s with requests in flight", timeout_s,
                           [info.worker_id for info in pending])
        with self.lock:
            for info in infos:
                pool.workers.pop(info.worker_id, None)
                self._record(pool.pool, "remove", info.worker_id, reason)
            self._bump()
        for info in infos:
            stop_worker(info)

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for pool in self.pools.pools():
                before = {wid: w.healthy for wid, w in list(pool.workers.items())}
                after = pool.check_health(timeout_s=max(self.health_interval_s, 2.0))
                changed = {wid for wid, ok in after.items() if wid in before and before[wid] != ok}
                if changed:
                    with self.lock:
                        for wid in changed:
                            self._record(pool.pool, "recovered" if after[wid] else "unhealthy", wid, "health check")
                        self._bump()
                for info in [w for w in list(pool.workers.values()) if w.stalled]:
                    self._restart_stalled(pool, info)
                dead = [w for w in list(pool.workers.values()) if w.dead and not w.draining]  # a drain ends its own
                if dead:
                    self._remove_dead(pool, dead)

    def _restart_stalled(self, pool: WorkerPool, info: WorkerInfo) -> None:
        """A worker that answers but whose engine loop is stuck would hold its requests for ever: end its
        process so Ray restarts it in place and its streams migrate."""
        self._record(pool.pool, "stalled", info.worker_id, info.stalled)
        logger.error("restarting %s: %s", info.worker_id, info.stalled)
        info.stalled = None
        try:
            pool.restart(info.worker_id)
        except Exception as exc:  # noqa: BLE001 - already gone: the death path takes over
            logger.warning("could not restart %s: %s", info.worker_id, exc)

    def _remove_dead(self, pool: WorkerPool, infos: list[WorkerInfo]) -> None:
        """Take workers that died for good out of the pool, and (`replace_dead`) start new ones in their
        place, in the background: the pool is back at its desired size once they are ready."""
        with self.lock:
            for info in infos:
                pool.workers.pop(info.worker_id, None)
                self._record(pool.pool, "remove", info.worker_id, "died")
            self._bump()
        for info in infos:
            stop_worker(info)
        if pool.pool_config.replace_dead:
            names = ", ".join(info.worker_id for info in infos)
            threading.Thread(target=self._replace, args=(pool, f"replacing {names}"), daemon=True).start()

    def _replace(self, pool: WorkerPool, reason: str) -> None:
        with self.pool_locks[pool.pool]:  # after any scaling in progress, against the target it leaves
            missing = self.desired[pool.pool] - len(self._active(pool))
            if missing <= 0 or self._stop.is_set():
                return
            try:
                self._add(pool, missing, reason)
            except RuntimeError as exc:  # the next death, or the operator, tries again
                logger.warning("%s %s", reason, exc)

    def _check_target(self, pool: str, replicas: int) -> WorkerPool:
        target = self._pool(pool)
        limit = target.pool_config.max_replicas
        if not 0 <= replicas <= limit:
            raise ValueError(f"{pool} replicas must be in [0, {limit}] (max_replicas), got {replicas}")
        if pool == "decode" and replicas == 0:
            raise ValueError("the decode pool needs at least one worker")
        return target

    def _pool(self, name: str) -> WorkerPool:
        pool = self.pools.prefill if name == "prefill" else self.pools.decode if name == "decode" else None
        if pool is None:
            raise ValueError(f"no {name!r} pool in {self.config.mode} mode (pools: prefill, decode)")
        return pool

    def _find(self, worker_id: str) -> tuple[WorkerPool, WorkerInfo]:
        for pool in self.pools.pools():
            info = pool.workers.get(worker_id)
            if info is not None and info.ready:
                return pool, info
        raise KeyError(f"no worker {worker_id!r}; `tandem status` lists them")

    @staticmethod
    def _active(pool: WorkerPool) -> list[WorkerInfo]:
        return [w for w in list(pool.workers.values()) if not w.draining]

    @staticmethod
    def _in_flight(info: WorkerInfo) -> int:
        try:
            return ray.get(info.actor.num_in_flight.remote(), timeout=10)
        except ray.exceptions.GetTimeoutError:
            return 1  # too busy to answer is not idle
        except ray.exceptions.RayError:
            return 0  # a dead worker has nothing left to finish

    def _record(self, pool: str, action: str, worker_id: str, reason: str) -> None:
        with self.lock:
            self.events.append(ScalingEvent(time.time(), pool, action, worker_id, reason))
            del self.events[:-1000]
            self.event_counts[(pool, action)] += 1
        logger.info("scaling: %s %s %s (%s)", pool, action, worker_id, reason)

    def _bump(self) -> None:
        self.version += 1


def enable_info_logging() -> None:
    """Show INFO logs of this actor process: Ray leaves its root logger unconfigured (warnings only), and
    scaling events and decisions are meant to be seen in the driver's output and the actor's log."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def start_controller(config: ClusterConfig, detached: bool = False, wait: bool = True, **options):
    """Create the named controller actor (which starts the pools), or get the one of that name already
    running; with `wait`, until it is up. `options` go to ClusterController (health_interval_s,
    drain_grace_s)."""
    # Restarted by Ray whenever its process dies: it adopts the workers, which outlive it (detached).
    actor_options = {"name": f"{config.name}-{CONTROLLER_NAME}", "namespace": config.namespace, "num_cpus": 0,
                     "max_concurrency": 32, "get_if_exists": True, "max_restarts": -1, **ON_HEAD}
    if detached:
        actor_options["lifetime"] = "detached"
    options.setdefault("transfer_token", secrets.token_hex(16))
    actor = ray.remote(ClusterController).options(**actor_options).remote(config, **options)
    if wait:
        ray.get(actor.membership.remote())
    return actor


def get_controller(name: str = "tandem", namespace: str = "tandem"):
    return ray.get_actor(f"{name}-{CONTROLLER_NAME}", namespace=namespace)
