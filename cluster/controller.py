"""The cluster controller: one named Ray actor that owns the pools, watches health, scales and drains.

Ingress replicas, the CLI, the admin API and the autoscaler all go through it. Membership carries a
version number; every change that affects routing (a worker ready, draining, unhealthy or removed)
bumps it, and ingress replicas long-poll for a newer one.

The actor is the Ray front: the decisions and the state live in plain objects, each testable without Ray —
`Roster` (versioned membership, a long poll woken by a condition), `EventLog` (events and counts),
`cluster.health.observe` (health, dead and stalled workers), `ScalingPlan` (targets, drains, replacements),
`LatencyWindow` (latencies the ingress observed). What talks to workers is in cluster/pools.py.
"""
from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ray

from cluster.config import ClusterConfig
from cluster.event_log import EventLog
from cluster.health import observe
from cluster.pool_status import pool_status
from cluster.pools import Pools, WorkerInfo, WorkerPool, in_flight, stop_named_workers, stop_worker
from cluster.roster import Roster
from cluster.scaling_plan import ScalingPlan
from cluster.scaling_policy import LatencyWindow
from engine.lora_request import LoRAError, LoRARequest
from worker_runtime.membership import Membership, ScaleResult, ScalingEvent, ScalingReport

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
        self.health_interval_s = health_interval_s
        self.pools = Pools(config, transfer_token)
        self.roster = Roster()
        self.events = EventLog()
        self.plan = ScalingPlan({pool.pool: pool.pool_config for pool in self.pools.pools()})
        self.latency = LatencyWindow()
        self.pool_locks = {pool.pool: threading.Lock() for pool in self.pools.pools()}
        self._stop = threading.Event()
        self.adapters = self._adapters(config)  # LoRA adapters served by name (engine/lora.py), in membership
        if ray.get_runtime_context().was_current_actor_reconstructed:
            self._adopt()
        else:
            stop_named_workers(config.name, config.namespace)  # left by a controller that was killed for good
            self.pools.start()
        threading.Thread(target=self._health_loop, name="health", daemon=True).start()

    def _adopt(self) -> None:
        """After a crash: take over the live workers, keeping each pool at the size it had; finish the
        drains that were under way; start the pools that lost every worker afresh."""
        adopted = self.pools.adopt()
        for pool in self.pools.pools():
            infos = adopted[pool.pool]
            for info in infos:
                self.events.record(pool.pool, "adopt", info.worker_id, "controller restarted")
            if missing := self.plan.adopted(pool.pool, [info for info in infos if not info.draining]):
                self._add(pool, missing, "controller restarted without workers")
            if draining := [info for info in infos if info.draining]:
                threading.Thread(target=self._drain_in_turn, daemon=True,
                                 args=(pool, draining, "drain under way when the controller restarted")).start()
        logger.info("controller restarted: adopted %s",
                    {pool: [info.worker_id for info in infos] for pool, infos in adopted.items()})

    def _adapters(self, config: ClusterConfig) -> dict[str, LoRARequest]:
        """The config's adapters, then those loaded through the API before a crash (kept in Ray's GCS, which a
        restarted controller reads back; one whose files changed or went is dropped, logged)."""
        adapters = {name: LoRARequest.from_dir(name, path) for name, path in config.lora.modules.items()}
        for name, (path, digest) in self._stored_adapters().items():
            try:
                adapter = LoRARequest.from_dir(name, path)
            except LoRAError as exc:
                logger.warning("dropping LoRA adapter %s loaded before the restart: %s", name, exc)
                continue
            if adapter.digest != digest:
                logger.warning("dropping LoRA adapter %s loaded before the restart: its files changed", name)
                continue
            adapters.setdefault(name, adapter)
        return adapters

    def _adapters_key(self) -> bytes:
        return f"tandem/{self.config.name}/lora_adapters".encode()

    def _stored_adapters(self) -> dict[str, list[str]]:
        from ray.experimental import internal_kv
        if not internal_kv._internal_kv_initialized():
            return {}
        raw = internal_kv._internal_kv_get(self._adapters_key(), namespace=self.config.namespace)
        return {} if raw is None else json.loads(raw)

    def _store_adapters(self) -> None:
        from ray.experimental import internal_kv
        loaded = {n: [a.path, a.digest] for n, a in self.adapters.items() if n not in self.config.lora.modules}
        internal_kv._internal_kv_put(self._adapters_key(), json.dumps(loaded).encode(), overwrite=True,
                                     namespace=self.config.namespace)

    # ---- what routers, the CLI, the admin API and the autoscaler call ---------------------------

    def membership(self, known_version: int = -1, wait_s: float = 0.0) -> Membership:
        """The ready workers and the LoRA adapters served; waits up to `wait_s` for a version newer than
        `known_version`."""
        membership = self.roster.membership(
            lambda: [w for pool in self.pools.pools() for w in list(pool.workers.values()) if w.ready],
            known_version, wait_s)
        membership.adapters = dict(self.adapters)
        return membership

    def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter at `path` as model `name` (vLLM's /v1/load_lora_adapter). ValueError: LoRA
        is off, the name is taken, or the directory is no adapter; workers read it when a request needs it."""
        if not self.config.lora.enabled:
            raise ValueError("LoRA is not enabled on this server: start it with --enable-lora (or lora.enabled)")
        if name in self.config.model_names:
            raise ValueError(f"{name!r} is the base model's name")
        if name in self.adapters:
            raise ValueError(f"The lora adapter '{name}' has already been loaded.")
        adapter = LoRARequest.from_dir(name, path)
        with self.roster.change():
            self.adapters[name] = adapter
        self._store_adapters()
        logger.info("LoRA adapter %s loaded from %s", name, adapter.path)
        return adapter

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter `name` (KeyError when not served); workers drop it from host memory and from
        any slot no running request uses."""
        if name not in self.adapters:
            raise KeyError(f"The lora adapter '{name}' cannot be found.")
        with self.roster.change():
            del self.adapters[name]
        self._store_adapters()
        logger.info("LoRA adapter %s unloaded", name)
        for pool in self.pools.pools():
            for info in list(pool.workers.values()):
                info.actor.unload_lora.remote(name)  # best effort: a worker that misses it drops it by LRU

    def config_dict(self) -> dict:
        return self.config.model_dump()

    def scale(self, pool: str, replicas: int, reason: str = "operator") -> ScaleResult:
        """Grow or shrink `pool` to `replicas` workers (draining ones not counted). Returns when the new
        workers are ready and registered, or when the drained ones have finished their requests and left."""
        target = self.pools.get(pool)
        self.plan.check_target(pool, replicas)
        with self.pool_locks[pool]:
            step = self.plan.scale(pool, target.active(), replicas, in_flight)
            if step.event is not None:
                self.events.record(pool, step.event, "", f"{reason}: {step.result.replicas_before} -> {replicas}")
            if step.add:
                step.result.added = self._add(target, step.add, reason)
            if step.drain:
                self._drain(target, step.drain, reason)
                step.result.drained = [w.worker_id for w in step.drain]
            return step.result

    def scale_pools(self, targets: dict[str, int], reason: str = "operator") -> list[ScaleResult]:
        """Scale several pools at once: every target is checked before any pool changes, then the pools
        scale concurrently."""
        for pool, replicas in targets.items():
            self.pools.get(pool)
            self.plan.check_target(pool, replicas)
        with ThreadPoolExecutor(max_workers=max(len(targets), 1)) as executor:
            return list(executor.map(lambda item: self.scale(*item, reason), targets.items()))

    def drain(self, worker_id: str, reason: str = "operator", timeout_s: float = 600.0) -> str:
        """Stop routing to a worker, let its in-flight requests finish, then remove it; returns its pool.
        The last decode worker cannot be drained: nothing could serve the requests that follow."""
        pool = self.pools.find(worker_id)[0]
        with self.pool_locks[pool.pool]:
            info = self.pools.find(worker_id)[1]
            self.plan.check_drain(pool.pool, info, pool.active())
            self._drain(pool, [info], reason, timeout_s)
            self.plan.drained(pool.pool, pool.active())
        return pool.pool

    def status(self) -> dict:
        """Pools and workers with health, load, KV usage, prefix hit rates and (decode workers) KV pulls that
        fell back to local recompute, per reason, for `tandem status`."""
        return {"version": self.roster.version, "mode": self.config.mode, "model": self.config.model_name,
                "controller_node": ray.util.get_node_ip_address(),
                "pools": {pool.pool: pool_status(pool, self.plan.desired[pool.pool]) for pool in self.pools.pools()}}

    def scaling_events(self, since: float = 0.0) -> list[ScalingEvent]:
        return self.events.since(since)

    def scaling_report(self) -> ScalingReport:
        return ScalingReport(self.events.totals(), {p.pool: len(p.active()) for p in self.pools.pools()},
                             dict(self.plan.desired))

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

    # ---- carrying out the plan on the pools ----------------------------------------------------

    def _add(self, pool: WorkerPool, n: int, reason: str) -> list[str]:
        infos = pool.scale_up(n)
        try:
            pool.wait_ready(infos)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            raise RuntimeError(f"{n} new {pool.pool} worker(s) did not start: {exc}") from None
        with self.roster.change():
            for info in infos:
                self.events.record(pool.pool, "add", info.worker_id, reason)
        return [i.worker_id for i in infos]

    def _drain(self, pool: WorkerPool, infos: list[WorkerInfo], reason: str, timeout_s: float = 600.0) -> None:
        with self.roster.change():
            for info in infos:
                info.draining = True
                self.events.record(pool.pool, "drain", info.worker_id, reason)
        time.sleep(self.drain_grace_s)  # requests routed just before the membership changed still arrive
        pool.drain_and_wait(infos, timeout_s)
        self._hand_off(pool, infos)
        self._remove(pool, infos, reason)

    HANDOFF_PREFIXES = 64  # per drained worker, its most used

    def _hand_off(self, pool: WorkerPool, infos: list[WorkerInfo]) -> None:
        """Before drained workers leave: the workers of their pool that stay pull their most used prefixes
        (EngineServer.pull_prefix), spread over them in turn, within transfer.handoff_budget_s; what did not
        make it in time stays behind. Recorded as a `handoff` event with the blocks moved (none when it held none)."""
        budget = self.config.transfer.handoff_budget_s
        if not self.config.transfer.peer_prefix_pulls or not budget:
            return
        leaving = {info.worker_id for info in infos}
        stayers = [info for info in pool.workers.values()
                   if info.worker_id not in leaving and not info.draining and info.ready and info.healthy]
        if not stayers:
            return
        deadline = time.monotonic() + budget
        for info in infos:
            try:
                chains = ray.get(info.actor.hot_prefixes.remote(self.HANDOFF_PREFIXES),
                                 timeout=max(0.0, deadline - time.monotonic()))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                logger.info("no prefixes handed over from %s: %s", info.worker_id, exc)
                continue
            if not chains:
                continue
            refs = [stayers[k % len(stayers)].actor.pull_prefix.remote(info.worker_id, info.actor, hashes, tokens)
                    for k, (hashes, tokens) in enumerate(chains)]
            done, late = ray.wait(refs, num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
            for ref in late:
                ray.cancel(ref)
            blocks = 0
            for ref in done:
                try:
                    blocks += ray.get(ref)
                except ray.exceptions.RayError as exc:
                    logger.info("a prefix handed over from %s did not arrive: %s", info.worker_id, exc)
            self.events.record(pool.pool, "handoff", info.worker_id,
                               f"{blocks} prefix blocks of {len(done)}/{len(chains)} prefixes to "
                               f"{', '.join(s.worker_id for s in stayers)}")

    def _drain_in_turn(self, pool: WorkerPool, infos: list[WorkerInfo], reason: str) -> None:
        with self.pool_locks[pool.pool]:
            self._drain(pool, infos, reason)

    def _remove(self, pool: WorkerPool, infos: list[WorkerInfo], reason: str) -> None:
        with self.roster.change():
            for info in infos:
                pool.workers.pop(info.worker_id, None)
                self.events.record(pool.pool, "remove", info.worker_id, reason)
        for info in infos:
            stop_worker(info)

    def _health_loop(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            for pool in self.pools.pools():
                self._check_health(pool)

    def _check_health(self, pool: WorkerPool) -> None:
        """One round of pings: log health flips, restart stalled workers, remove (and replace) dead ones."""
        changes = observe(list(pool.workers.values()), pool.ping(timeout_s=max(self.health_interval_s, 2.0)))
        if changes.flipped:
            with self.roster.change():
                for wid, ok in changes.flipped.items():
                    self.events.record(pool.pool, "recovered" if ok else "unhealthy", wid, "health check")
        for info in changes.stalled:
            self._restart_stalled(pool, info)
        if changes.dead:
            self._remove(pool, changes.dead, "died")
            if pool.pool_config.replace_dead:
                names = ", ".join(info.worker_id for info in changes.dead)
                threading.Thread(target=self._replace, args=(pool, f"replacing {names}"), daemon=True).start()

    def _restart_stalled(self, pool: WorkerPool, info: WorkerInfo) -> None:
        """A worker that answers but whose engine loop is stuck would hold its requests for ever: end its
        process so Ray restarts it in place and its streams migrate."""
        self.events.record(pool.pool, "stalled", info.worker_id, info.stalled)
        logger.error("restarting %s: %s", info.worker_id, info.stalled)
        info.stalled = None
        try:
            pool.restart(info.worker_id)
        except Exception as exc:  # noqa: BLE001 - already gone: the death path takes over
            logger.warning("could not restart %s: %s", info.worker_id, exc)

    def _replace(self, pool: WorkerPool, reason: str) -> None:
        """Start workers in place of dead ones, in the background: the pool is back at its desired size once
        they are ready."""
        with self.pool_locks[pool.pool]:  # after any scaling in progress, against the target it leaves
            missing = self.plan.missing(pool.pool, pool.active())
            if missing == 0 or self._stop.is_set():
                return
            try:
                self._add(pool, missing, reason)
            except RuntimeError as exc:  # the next death, or the operator, tries again
                logger.warning("%s %s", reason, exc)


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
