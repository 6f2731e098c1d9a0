"""Starting, watching and resizing the prefill and decode actor pools on Ray."""
from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import secrets
import time
from dataclasses import dataclass, replace

import ray

from cluster.config import ClusterConfig, PoolConfig
from cluster.health import Ping
from engine.errors import WorkerStalled
from worker_runtime.tracing import tracing_env
from kv_transfer.config import TransferConfig
from worker_runtime.membership import WorkerEntry

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerInfo(WorkerEntry):
    """A pool member as the controller keeps it: its membership entry (what routers see: id, pool, actor,
    health, draining), extended by what only the controller tracks. One record per worker; routers get
    copies of the entry part (`Roster.membership`)."""
    ready: bool = False  # model loaded; only ready workers are routed to or health-checked
    died: int = 0  # health checks in a row that found the actor dead (not restarting); see cluster/health.py
    stalled: str | None = None  # why the last health check found its engine loop stuck


# glibc gives every thread that allocates its own arena, each faulted in anew; KV messages are handled by
# pool threads that rotate, so a fresh worker's first 10-20 pulls paid that again and again (23-65 ms
# instead of 10-13 ms for 11.8 MB between two actors). It is read at process start, hence an env var.
WORKER_ENV = {"MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2")}


def _actor_class(pool: str):
    if pool == "prefill":
        from prefill_workers.worker import PrefillWorker
        return ray.remote(PrefillWorker)
    from decode_workers.worker import DecodeWorker
    return ray.remote(DecodeWorker)


class WorkerPool:
    """The actors of one pool. Worker ids are never reused, so a route to a removed worker cannot
    silently land on its replacement."""

    def __init__(self, pool: str, config: ClusterConfig, pool_config: PoolConfig, transfer: TransferConfig):
        self.pool = pool
        self.config = config
        self.pool_config = pool_config
        self.transfer = transfer
        self.workers: dict[str, WorkerInfo] = {}
        self._ids = itertools.count()
        self._cls = _actor_class(pool)

    def actor_options(self) -> dict:
        pc = self.pool_config
        num_gpus = pc.num_gpus
        if num_gpus is None:
            num_gpus = 1.0 if self.config.device in ("auto", "cuda") and _cluster_has_gpus() else 0.0
        # Detached and named in the cluster's namespace: a worker outlives the controller that started it,
        # and a restarted controller finds it by name (`adopt`).
        # A tensor-parallel worker's ranks run in processes it starts on its node: a GPU (set) each.
        num_gpus *= pc.tensor_parallel_size
        return {"num_cpus": pc.num_cpus, "num_gpus": num_gpus, "resources": dict(pc.resources),
                "max_restarts": pc.max_restarts, "max_task_retries": 0, "max_concurrency": 1000,
                "namespace": self.config.namespace, "lifetime": "detached",
                "runtime_env": {"env_vars": {**WORKER_ENV, **tracing_env(self.config.tracing.otlp_endpoint,
                                                                        self.config.tracing.service_name)}}}

    def add_worker(self) -> WorkerInfo:
        worker_id = f"{self.pool}-{next(self._ids)}"
        # Distinct seeds per worker: unseeded requests must not draw the same samples everywhere.
        engine_config = replace(self.config.engine_config(self.pool_config, self.pool),
                                seed=self.config.seed + stable_hash(worker_id))
        actor = self._cls.options(name=f"{self.config.name}-{worker_id}", **self.actor_options()).remote(
            worker_id, engine_config, self.transfer)
        info = WorkerInfo(worker_id, self.pool, actor)
        self.workers[worker_id] = info
        return info

    def adopt(self, timeout_s: float = 120.0) -> list[WorkerInfo]:
        """Take over the live workers of this pool that an earlier controller of the cluster started (this
        one is its restart): each answers a ping and says whether it is draining. New ids continue after
        the highest one found, so none is reused. Workers that do not answer in time are stopped."""
        found = {}
        for entry in ray.util.list_named_actors(all_namespaces=True):
            match = re.fullmatch(rf"{re.escape(self.config.name)}-({self.pool}-(\d+))", entry["name"])
            if match and entry["namespace"] == self.config.namespace:
                found[match.group(1)] = int(match.group(2))
        if not found:
            return []
        self._ids = itertools.count(max(found.values()) + 1)
        infos = []
        for worker_id in sorted(found, key=found.get):
            try:
                actor = ray.get_actor(f"{self.config.name}-{worker_id}", namespace=self.config.namespace)
            except ValueError:  # gone since it was listed
                continue
            infos.append(self.workers.setdefault(worker_id, WorkerInfo(worker_id, self.pool, actor)))
        refs = {info.worker_id: info.actor.stats.remote() for info in infos}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        adopted = []
        for info in infos:
            try:
                stats = ray.get(refs[info.worker_id], timeout=0) if refs[info.worker_id] in ready else None
            except ray.exceptions.RayError:
                stats = None
            if stats is None:
                logger.warning("%s did not answer the restarted controller; stopping it", info.worker_id)
                self.remove(info.worker_id)
                continue
            info.ready = info.healthy = True
            info.draining = stats.draining
            adopted.append(info)
        return adopted

    def scale_up(self, n: int) -> list[WorkerInfo]:
        return [self.add_worker() for _ in range(n)]

    def wait_ready(self, infos: list[WorkerInfo] | None = None, timeout_s: float = 600.0) -> None:
        """Block until the given workers (default: all) answer a ping: their model is loaded. Workers that
        fail to start are removed and the error is raised."""
        infos = list(self.workers.values()) if infos is None else infos
        try:
            ray.get([info.actor.ping.remote() for info in infos], timeout=timeout_s)
        except (ray.exceptions.RayError, TimeoutError):
            for info in infos:
                self.remove(info.worker_id)
            raise
        for info in infos:
            info.ready = info.healthy = True

    def ping(self, timeout_s: float = 5.0) -> dict[str, Ping]:
        """Ping every ready worker (asking whether its engine loop has stalled past the pool's
        `stall_timeout_s`); a ping that times out or fails is not `ok`."""
        # A snapshot: the controller may add or remove workers while the pings are out.
        stall = self.pool_config.stall_timeout_s
        refs = {wid: info.actor.ping.remote(stall) for wid, info in list(self.workers.items()) if info.ready}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        ready = set(ready)
        return {wid: _ping_outcome(ref) if ref in ready else Ping(False) for wid, ref in refs.items()}

    def active(self) -> list[WorkerInfo]:
        """The workers not draining (starting ones included)."""
        return [w for w in list(self.workers.values()) if not w.draining]

    def drain_and_wait(self, infos: list[WorkerInfo], timeout_s: float) -> None:
        """Make the workers refuse new requests, then wait (up to `timeout_s`) until none has any in flight."""
        for info in infos:
            try:
                ray.get(info.actor.drain.remote(), timeout=10)
            except ray.exceptions.RayError:
                pass  # a dead worker has nothing in flight; a stuck one is waited for below
        deadline = time.monotonic() + timeout_s
        pending = list(infos)
        while pending and time.monotonic() < deadline:
            pending = [info for info in pending if in_flight(info) > 0]
            if pending:
                time.sleep(0.1)  # polling the workers: they have no call that waits for their last request
        if pending:
            logger.warning("drain timed out after %.0f s; removing %s with requests in flight", timeout_s,
                           [info.worker_id for info in pending])

    def restart(self, worker_id: str) -> None:
        """End a worker's process so Ray starts it again in place (counts against its `max_restarts`); its
        streams fail over as after a crash."""
        if (info := self.workers.get(worker_id)) is not None:
            ray.kill(info.actor, no_restart=False)

    def remove(self, worker_id: str) -> None:
        info = self.workers.pop(worker_id, None)
        if info is not None:
            stop_worker(info)

    def shutdown(self) -> None:
        for worker_id in list(self.workers):
            self.remove(worker_id)


class Pools:
    """Both pools of one cluster; in colocated mode only the decode pool exists and prefills locally."""

    def __init__(self, config: ClusterConfig, transfer_token: str | None = None):
        """`transfer_token`: the KV servers' shared token when the config sets none (default: a new random
        one). A restarted controller passes the one its workers were started with."""
        self.config = config
        transfer = config.transfer_config()
        transfer = replace(transfer, token=transfer.token or transfer_token or secrets.token_hex(16))
        self.decode = WorkerPool("decode", config, config.decode, transfer)
        self.prefill = WorkerPool("prefill", config, config.prefill, transfer) if config.mode == "disaggregated" \
            else None

    def adopt(self) -> dict[str, list[WorkerInfo]]:
        """Take over the live workers an earlier controller of this cluster started, per pool."""
        return {pool.pool: pool.adopt() for pool in self.pools()}

    def start(self, timeout_s: float = 600.0) -> None:
        started = self.decode.scale_up(self.config.decode.replicas)
        if self.prefill is not None:
            self.prefill.scale_up(self.config.prefill.replicas)
            self.prefill.wait_ready(timeout_s=timeout_s)
        self.decode.wait_ready(started, timeout_s=timeout_s)

    def pools(self) -> list[WorkerPool]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def get(self, name: str) -> WorkerPool:
        pool = self.prefill if name == "prefill" else self.decode if name == "decode" else None
        if pool is None:
            raise ValueError(f"no {name!r} pool in {self.config.mode} mode (pools: prefill, decode)")
        return pool

    def find(self, worker_id: str) -> tuple[WorkerPool, WorkerInfo]:
        """The pool and record of a ready worker; KeyError naming the command that lists them."""
        for pool in self.pools():
            info = pool.workers.get(worker_id)
            if info is not None and info.ready:
                return pool, info
        raise KeyError(f"no worker {worker_id!r}; `tandem status` lists them")

    def shutdown(self) -> None:
        for pool in self.pools():
            pool.shutdown()


def _ping_outcome(ref) -> Ping:
    try:
        ray.get(ref)
    except ray.exceptions.ActorDiedError:
        return Ping(False, died=True)
    except ray.exceptions.RayTaskError as exc:
        return Ping(False, stalled=str(exc.cause) if isinstance(exc.cause, WorkerStalled) else None)
    except ray.exceptions.RayError:
        return Ping(False)
    return Ping(True)


def in_flight(info: WorkerInfo) -> int:
    """The requests a worker has in flight; one that is too busy to answer counts as busy, a dead one as idle."""
    try:
        return ray.get(info.actor.num_in_flight.remote(), timeout=10)
    except ray.exceptions.GetTimeoutError:
        return 1
    except ray.exceptions.RayError:
        return 0


def stop_worker(info: WorkerInfo) -> None:
    """Let the worker close its transfer endpoints, then end its actor (also when it does not answer)."""
    try:
        ray.get(info.actor.shutdown.remote(), timeout=10)
    except ray.exceptions.RayError:
        pass
    ray.kill(info.actor, no_restart=True)


def stop_named_workers(name: str, namespace: str) -> list[str]:
    """Stop every worker of the cluster `name` still alive in `namespace` (workers are detached: they outlive
    a controller that was killed for good). Returns their actor names."""
    stopped = []
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and re.fullmatch(rf"{re.escape(name)}-(prefill|decode)-\d+", entry["name"]):
            try:
                actor = ray.get_actor(entry["name"], namespace=namespace)
            except ValueError:
                continue
            stop_worker(WorkerInfo(entry["name"], "", actor))
            stopped.append(entry["name"])
    return stopped


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def _cluster_has_gpus() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0
