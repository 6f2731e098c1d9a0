"""bench/soak.py's view of the workers: their processes, counters that survive kills, injected KV transfer
faults, the kills themselves, and what must return to baseline once the cluster is idle.

A worker's counters live in its process and restart from zero when Ray restarts it, so they are tallied
per process (worker id, pid): the sum over processes is the run's total, as long as each process was read
shortly before it died (every refresh, and once more right before a kill). Faults are armed in each
prefill process as it appears (the injector lives in the KV server: kv_transfer/faults.py).

Everything here blocks on Ray; the soak calls it from threads.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import sys
import threading
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import psutil
import ray

from kv_transfer.faults import FAULTS

logger = logging.getLogger(__name__)

CALL_TIMEOUT_S = 10.0
# What a call to a worker that is down or restarting raises; anything else is logged.
GONE = (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError)

# The functions below run inside workers (`__ray_call__`): ship them by value, so a worker need not import
# this module (bench/ is not on its path).
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass(slots=True)
class Kill:
    time: float
    worker_id: str
    pool: str
    pid: int


@dataclass(slots=True)
class Accounting:
    """What must be back at baseline on an idle worker. `used_blocks` counts blocks some request or lease
    references (a cached block nobody holds sits in the free list and is not counted)."""
    worker_id: str
    pool: str
    pid: int
    used_blocks: int
    num_running: int
    num_waiting: int
    in_flight: int
    leases: int = 0

    def settled(self, baseline_blocks: int = 0) -> bool:
        """Idle and holding no more blocks than at baseline."""
        return self.used_blocks <= baseline_blocks and not (self.num_running or self.num_waiting or self.in_flight
                                                            or self.leases)


def _pid(worker) -> int:
    return os.getpid()


def _arm(worker, rates: dict, seed: int) -> None:
    """A fresh injector in the worker's KV server, counting the pulls it sees (`pulls`)."""
    from kv_transfer.faults import FaultInjector
    injector = FaultInjector(rates, seed)
    injector.pulls = 0
    pick = injector.pick

    def counted_pick():
        injector.pulls += 1
        return pick()

    injector.pick = counted_pick
    worker.kv_server.config.faults = injector


def _disarm(worker) -> None:
    """No more faults; the injector stays, with its counts."""
    if worker.kv_server.config.faults is not None:
        worker.kv_server.config.faults.rates = {}


def _requests(worker) -> tuple[int, int, int]:
    """pid, requests in flight, KV leases held."""
    leases = len(worker.kv_server.leases) if hasattr(worker, "kv_server") else 0
    return os.getpid(), len(worker.in_flight), leases


def _injected(worker) -> dict:
    faults = worker.kv_server.config.faults
    return {**faults.injected, "pulls": getattr(faults, "pulls", 0)} if faults is not None else {}


@dataclass
class WorkerWatch:
    """The cluster's workers as the soak sees them, through the controller's membership."""
    controller: object
    fault_rates: dict[str, float] = field(default_factory=dict)
    seed: int = 0
    processes: dict[tuple[str, int], dict] = field(default_factory=dict)  # (worker, pid) -> its counters
    armed: set[tuple[str, int]] = field(default_factory=set)
    kills: list[Kill] = field(default_factory=list)
    pids: dict[str, int] = field(default_factory=dict)  # worker -> pid, as last seen
    lock: threading.Lock = field(default_factory=threading.Lock)

    def workers(self) -> list:
        return ray.get(self.controller.membership.remote(), timeout=CALL_TIMEOUT_S).workers

    def refresh(self) -> dict[str, int]:
        """Find each worker's process, arm faults in new prefill processes, tally counters. Returns
        worker id -> pid for the workers that answered (a killed one does not until Ray restarted it)."""
        pids = {}
        for w in self.workers():
            try:
                pids[w.worker_id] = self._tally(w)
            except GONE:
                continue
            except ray.exceptions.RayError as exc:
                logger.warning("soak: reading %s failed: %s", w.worker_id, exc)
        self.pids = pids
        return pids

    def _tally(self, w) -> int:
        pid = ray.get(w.actor.__ray_call__.remote(_pid), timeout=CALL_TIMEOUT_S)
        key = (w.worker_id, pid)
        if w.pool == "prefill":
            if key not in self.armed and self.fault_rates:
                seed = zlib.crc32(f"{self.seed}/{w.worker_id}/{len(self.armed)}".encode())
                ray.get(w.actor.__ray_call__.remote(_arm, self.fault_rates, seed), timeout=CALL_TIMEOUT_S)
                self.armed.add(key)
            counters = {f"fault_{k}": v for k, v in
                        ray.get(w.actor.__ray_call__.remote(_injected), timeout=CALL_TIMEOUT_S).items()}
        else:
            t = ray.get(w.actor.transfer_stats.remote(), timeout=CALL_TIMEOUT_S)
            counters = {"remote_prefills": t["remote_prefills"], "local_prefills": t["local_prefills"],
                        **{f"recompute_{k}": v for k, v in t["transfer_failures_by_reason"].items()}}
        with self.lock:
            self.processes[key] = counters
        return pid

    def totals(self) -> dict[str, int]:
        with self.lock:
            total = Counter()
            for counters in self.processes.values():
                total.update(counters)
        return dict(total)

    def disarm(self) -> None:
        """No more faults (the counts so far stay)."""
        self.fault_rates = {}
        for w in self.workers():
            if w.pool == "prefill":
                try:
                    self._tally(w)
                    ray.get(w.actor.__ray_call__.remote(_disarm), timeout=CALL_TIMEOUT_S)
                except GONE:
                    pass

    def kill_one(self, rng: random.Random, expected: int) -> Kill | None:
        """SIGKILL one worker, once all `expected` workers answer (at most one is ever down because of the
        soak); None when they do not. The pool is drawn first, so the lone prefill worker dies as often as
        the decode pool loses one."""
        workers = sorted(self.workers(), key=lambda w: w.worker_id)
        if len(workers) < expected:
            return None
        pool = rng.choice(sorted({w.pool for w in workers}))
        victim = rng.choice([w for w in workers if w.pool == pool])
        try:
            pids = {w.worker_id: self._tally(w) for w in workers}
        except GONE:
            return None
        pid = pids[victim.worker_id]
        os.kill(pid, signal.SIGKILL)
        kill = Kill(time.time(), victim.worker_id, victim.pool, pid)
        self.kills.append(kill)
        logger.warning("soak: killed %s (pid %d)", victim.worker_id, pid)
        return kill

    def accounting(self) -> list[Accounting]:
        """Every answering worker's block, request and lease counts right now."""
        out = []
        for w in self.workers():
            try:
                stats = ray.get(w.actor.stats.remote(), timeout=CALL_TIMEOUT_S)
                pid, in_flight, leases = ray.get(w.actor.__ray_call__.remote(_requests), timeout=CALL_TIMEOUT_S)
            except GONE:
                continue
            except ray.exceptions.RayError as exc:
                logger.warning("soak: reading %s failed: %s", w.worker_id, exc)
                continue
            out.append(Accounting(w.worker_id, w.pool, pid, stats.num_active_blocks, stats.num_running,
                                  stats.num_waiting, in_flight, leases))
        return out


def ingress_pids() -> dict[str, int]:
    """Serve's ingress replicas (actor name -> pid)."""
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == "serve" and entry["name"].startswith("SERVE_REPLICA::") and "#ingress#" in entry["name"]:
            try:
                actor = ray.get_actor(entry["name"], namespace="serve")
                out[entry["name"].rsplit("#", 1)[-1]] = ray.get(actor.__ray_call__.remote(_pid), timeout=CALL_TIMEOUT_S)
            except (ValueError, *GONE):
                continue
    return out


def rss_mib(pid: int) -> float | None:
    try:
        return psutil.Process(pid).memory_info().rss / 2**20
    except psutil.Error:
        return None


def fault_rates(total: float) -> dict[str, float]:
    """`total` split evenly over the injectable faults."""
    return {fault: total / len(FAULTS) for fault in FAULTS} if total > 0 else {}
