"""One ingress replica's view of the cluster: who the workers are, what they cache, how loaded they are.

Each replica follows the controller's membership (long-poll on its version), and for every worker
follows its KV events into a `PrefixIndex` (a long-poll starting from a snapshot) and polls its stats
into a `WorkerLoad`. Replicas do all of this independently, so each holds an exact index of its own.

A worker whose calls fail is dropped from the index at once and not chosen again until a call made after
the failure succeeds (a restarted actor resyncs from a fresh snapshot); one that leaves the membership is
forgotten. A pool whose workers are all unschedulable can still heal while one of them is not draining (Ray
restarts it in place) or none is known (the controller is replacing the dead): `can_heal` says so.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import ray

from router.metrics import Metrics
from worker_runtime.engine_loop import EngineStopped
from worker_runtime.membership import Membership, WorkerEntry
from worker_runtime.protocol import PrefixSource, WorkerLoad, WorkerStats
from router.placement.cost_model import peer_pull_pays
from router.placement.index import PrefixIndex
from router.placement.routing import EXPECTED_OUTPUT_TOKENS, NoDecodeWorker, RouteDecision, Router

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerState:
    """What this replica knows of one worker: its membership entry and its reported stats as they came,
    and the router's own bookkeeping (reachability, the requests it routed there since those stats)."""
    entry: WorkerEntry  # as the controller's membership last listed it
    reachable: bool = True  # False from a failed call until one made after it succeeds
    lost_at: float = float("-inf")  # monotonic time of the last failed call
    stats: WorkerStats | None = None
    stats_asked_at: float = 0.0  # monotonic time the current stats were asked for
    pending: dict[str, tuple[float, int]] = field(default_factory=dict)  # request id -> (routed at, prefill tokens)
    ended: list[float] = field(default_factory=list)  # when requests the current stats may count ended
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def worker_id(self) -> str:
        return self.entry.worker_id

    @property
    def pool(self) -> str:
        return self.entry.pool

    @property
    def schedulable(self) -> bool:
        return self.entry.healthy and self.reachable and not self.leaving

    @property
    def leaving(self) -> bool:
        """Draining, as the controller or the worker itself says: it will not take requests again."""
        return self.entry.draining or (self.stats is not None and self.stats.draining)

    def load(self) -> WorkerLoad:
        """The last reported load plus what this replica routed here since that report was asked for,
        so a burst does not pile onto one worker between two stats polls, less the decode requests that
        ended since, so a worker that just finished does not look busy until the next poll."""
        load = WorkerLoad.reported(self.worker_id, self.stats, healthy=self.schedulable)
        for routed_at, prefill_tokens in self.pending.values():
            if routed_at >= self.stats_asked_at:
                load.queued_prefill_tokens += prefill_tokens
                if self.pool == "decode":
                    load.num_running += 1
                else:
                    load.num_waiting += 1
        ended = sum(1 for t in self.ended if t >= self.stats_asked_at)
        load.num_running = max(0, load.num_running - ended)
        return load

    def report(self, stats: WorkerStats, asked_at: float) -> None:
        """Take stats asked for at `asked_at`; requests that ended before then are no longer in them."""
        self.stats, self.stats_asked_at = stats, asked_at
        self.ended = [t for t in self.ended if t >= asked_at]


class WorkerView:
    """Membership, prefix index and loads for one ingress replica; `route` places a request on them."""

    def __init__(self, controller, router: Router, metrics: Metrics, *, colocated: bool,
                 stats_interval_s: float = 0.25, events_timeout_s: float = 1.0, membership_wait_s: float = 5.0,
                 retry_s: float = 0.5):
        self.controller = controller
        self.router = router
        self.index: PrefixIndex = router.index
        self.block_size = router.decode_policy.block_size
        self.metrics = metrics
        self.colocated = colocated
        self.stats_interval_s = stats_interval_s
        self.events_timeout_s = events_timeout_s
        self.membership_wait_s = membership_wait_s
        self.retry_s = retry_s
        self.workers: dict[str, WorkerState] = {}
        self.version = -1
        self.adapters: dict = {}  # LoRA adapters served, by name (the controller's, with the membership)
        self._membership_task: asyncio.Task | None = None
        self._loads_changed = asyncio.Event()  # set (and replaced) whenever a load may have dropped

    async def start(self) -> None:
        """Read the membership once, then follow it (and every worker) in the background."""
        self._apply(await self.controller.membership.remote(-1, 0.0))
        self._membership_task = asyncio.create_task(self._follow_membership())

    async def close(self) -> None:
        tasks = [t for w in self.workers.values() for t in w.tasks]
        if self._membership_task is not None:
            tasks.append(self._membership_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the request path ---------------------------------------------------------------------

    def route(self, block_hashes: Sequence[int], prompt_tokens: int, exclude: Collection[str] = (),
              remote_prefill: bool = True, elapsed_s: float = 0.0,
              output_tokens: int = EXPECTED_OUTPUT_TOKENS,
              prefill_backlog: Mapping[str, tuple[int, int]] | None = None, ahead: bool = False,
              lora_key: str | None = None) -> RouteDecision:
        """Place a request that arrived `elapsed_s` ago and will generate about `output_tokens`; raises NoDecodeWorker when no decode worker is
        schedulable. Without `remote_prefill` the decode worker prefills, whatever the policy says. A
        decision to wait for a prefill slot (`wait`) is not counted: the caller routes again. A request that
        goes `ahead` of the prompts queued on its workers (GenerateRequest.ahead) sees no prefill queue. One that
        runs LoRA adapter `lora_key` prefers workers whose slots hold it (Router.route)."""
        local_only = self.colocated or not remote_prefill
        loads = {"prefill": [], "decode": []}
        for w in self.workers.values():
            if w.worker_id not in exclude and not (local_only and w.pool == "prefill"):
                load = w.load()
                if ahead and w.pool == "prefill":
                    load.num_waiting = 0
                loads[w.pool].append(load)
        decision = self.router.route(block_hashes, prompt_tokens, loads["prefill"], loads["decode"], elapsed_s,
                                     output_tokens, prefill_backlog, lora_key=lora_key)
        if local_only:
            decision.reason = "colocated" if self.colocated else "migration"
        if decision.wait:
            return decision
        for pool, placement in (("decode", decision.decode), ("prefill", decision.prefill)):
            if placement is not None:
                self.metrics.routing.labels(pool, placement.worker_id, decision.reason).inc()
                self.metrics.routing_hits.labels(pool, placement.worker_id).inc(
                    placement.cached_tokens // self.block_size)
                if lora_key is not None:
                    held = any(lora_key in load.lora_keys for load in loads[pool] if load.worker_id == placement.worker_id)
                    self.metrics.routing_lora.labels(pool, placement.worker_id, "hit" if held else "load").inc()
        return decision

    def preview(self, block_hashes: Sequence[int], prompt_tokens: int, elapsed_s: float = 0.0,
                output_tokens: int = EXPECTED_OUTPUT_TOKENS,
                prefill_backlog: Mapping[str, tuple[int, int]] | None = None,
                ingress_backlog: tuple[int, int] | None = None) -> RouteDecision | None:
        """The placement the request would get now (the placement's cost model), without placing it or
        counting anything; None when no decode worker is schedulable."""
        loads = {"prefill": [], "decode": []}
        for w in self.workers.values():
            if not (self.colocated and w.pool == "prefill"):
                loads[w.pool].append(w.load())
        try:
            return self.router.route(block_hashes, prompt_tokens, loads["prefill"], loads["decode"], elapsed_s,
                                     output_tokens, prefill_backlog, record=False, ingress_backlog=ingress_backlog)
        except NoDecodeWorker:
            return None

    def predict_ttft(self, block_hashes: Sequence[int], prompt_tokens: int, elapsed_s: float = 0.0,
                     output_tokens: int = EXPECTED_OUTPUT_TOKENS,
                     prefill_backlog: Mapping[str, tuple[int, int]] | None = None,
                     ingress_backlog: tuple[int, int] | None = None) -> float | None:
        """The first token's predicted seconds from arrival if the request were placed now (behind
        `ingress_backlog`, see Router.route); None when no decode worker is schedulable."""
        decision = self.preview(block_hashes, prompt_tokens, elapsed_s, output_tokens, prefill_backlog,
                                ingress_backlog)
        return None if decision is None else decision.predicted_ttft_s

    def some_prefill_queue_full(self) -> bool:
        """Whether a schedulable prefill worker has `max_prefill_queue_size` prompts waiting: the only state in
        which placement makes a request wait for a slot."""
        if self.colocated:
            return False
        full = self.router.disagg.max_prefill_queue_size
        return any(w.load().num_waiting >= full for w in self.workers.values()
                   if w.pool == "prefill" and w.schedulable)

    def saturated(self) -> bool:
        """Whether every path a new prompt could take already has prompts queued on it: each schedulable
        decode worker holds prompts it has not begun (its engine's waiting queue: local prefills behind
        others, requests short of KV blocks), and each schedulable prefill worker's queue is full
        (`max_prefill_queue_size` waiting; a colocated cluster has no such path). Placing more then only
        lengthens queues the ingress does not order. False with no schedulable decode worker: routing waits
        for one, or refuses, on its own terms."""
        decode = [w.load() for w in self.workers.values() if w.pool == "decode" and w.schedulable]
        if not decode or not all(load.num_waiting for load in decode):
            return False
        if self.colocated:
            return True
        full = self.router.disagg.max_prefill_queue_size
        return all(w.load().num_waiting >= full for w in self.workers.values()
                   if w.pool == "prefill" and w.schedulable)

    def begin(self, decision: RouteDecision, request_id: str, prompt_tokens: int,
              block_hashes: Sequence[int] = ()) -> None:
        """Count a routed request against its workers until `end`; a prompt its prefill worker computes
        counts as cached there for requests sharing its prefix meanwhile (`PrefixIndex.begin_prompt`)."""
        now = time.monotonic()
        if decision.prefill is not None and decision.prefill.worker_id in self.workers:
            self.index.begin_prompt(decision.prefill.worker_id, request_id, block_hashes)
        computes_prompt = decision.prefill or decision.decode
        for placement in (decision.decode, decision.prefill):
            if placement is not None and placement.worker_id in self.workers:
                tokens = prompt_tokens - placement.cached_tokens if placement is computes_prompt else 0
                self.workers[placement.worker_id].pending[request_id] = (now, tokens)

    def end(self, decision: RouteDecision, request_id: str) -> None:
        now = time.monotonic()
        if decision.prefill is not None:
            self.index.end_prompt(decision.prefill.worker_id, request_id)
        for placement in (decision.decode, decision.prefill):
            if placement is not None and (w := self.workers.get(placement.worker_id)) is not None:
                routed_at, _ = w.pending.pop(request_id, (now, 0))
                # Only a decode worker's batch holds the request to its end; its current stats,
                # asked for after the request was routed, may still count it.
                if w.pool == "decode" and routed_at < w.stats_asked_at:
                    w.ended.append(now)
        self._notify_loads()

    async def wait_for_loads(self, timeout_s: float) -> None:
        """Return when a worker's load may have dropped (a stats report, a request's end), or after
        `timeout_s`."""
        try:
            await asyncio.wait_for(self._loads_changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _notify_loads(self) -> None:
        self._loads_changed.set()
        self._loads_changed = asyncio.Event()

    def actor(self, worker_id: str):
        return self.workers[worker_id].entry.actor

    def peer_prefix(self, worker_id: str, block_hashes: Sequence[int], prompt_tokens: int) -> PrefixSource | None:
        """The peer the worker computing the prompt (`worker_id`: its prefill worker, or its decode worker
        prefilling locally) should pull its prefix from: the live worker (either pool) holding the longest run of
        the prompt's leading blocks beyond what `worker_id` holds, in its cache or a tier below, when pulling them
        is predicted faster than computing them (cost_model.peer_pull_pays); None otherwise."""
        target = self.workers.get(worker_id)
        if target is None:
            return None
        puller = target.load()
        usable = block_hashes[:max(0, (prompt_tokens - 1) // self.block_size)]
        if not puller.pulls_prefixes or not usable:
            return None
        peers = {w.worker_id: w for w in self.workers.values()
                 if w.worker_id != worker_id and w.entry.healthy and w.reachable and w.stats is not None
                 and w.stats.serves_prefixes}
        if not peers:
            return None
        overlaps = self.index.tier_overlap(usable, [worker_id, *peers])
        have = overlaps[worker_id][1]
        best = max(peers, key=lambda worker_id: overlaps[worker_id][1])
        on_device, anywhere = overlaps[best]
        pays, pull_s, compute_s = peer_pull_pays(anywhere - have, have * self.block_size, prompt_tokens, puller,
                                                 peers[best].load(), anywhere - max(on_device, have),
                                                 self.block_size)
        if not pays:
            return None
        self.metrics.peer_prefix.labels(best, worker_id).inc()
        return PrefixSource(best, peers[best].entry.actor, anywhere)

    def lost(self, worker_id: str, reason: object = "") -> None:
        """A call to the worker failed: drop its index entries now and route around it."""
        w = self.workers.get(worker_id)
        if w is None:
            return
        if w.reachable:
            logger.warning("worker %s is unreachable (%s); routing around it", worker_id, reason)
        w.reachable = False
        w.lost_at = time.monotonic()
        w.stats = None
        self.index.remove_worker(worker_id)
        self.metrics.workers.forget(worker_id)

    def num_schedulable(self, pool: str) -> int:
        return sum(1 for w in self.workers.values() if w.pool == pool and w.schedulable)

    def can_heal(self, pool: str) -> bool:
        """Whether `pool` may get a schedulable worker without an operator: one of its workers is unhealthy
        or unreachable but not draining (Ray restarts it in place), or it has no worker at all (the controller
        replaces dead ones). Not when every worker it has is draining."""
        members = [w for w in self.workers.values() if w.pool == pool]
        return not members or any(not w.leaving for w in members)

    # ---- following the cluster ----------------------------------------------------------------

    def _apply(self, membership: Membership) -> None:
        self.version = membership.version
        self.adapters = membership.adapters
        current = set()
        for entry in membership.workers:
            current.add(entry.worker_id)
            w = self.workers.get(entry.worker_id)
            if w is None:
                w = self.workers[entry.worker_id] = WorkerState(entry)
                w.tasks = [asyncio.create_task(self._follow_events(w)), asyncio.create_task(self._poll_stats(w))]
            else:
                w.entry = entry
        for worker_id in set(self.workers) - current:
            self._forget(worker_id)
        self._notify_loads()  # a worker may have become schedulable

    def _forget(self, worker_id: str) -> None:
        w = self.workers.pop(worker_id)
        for task in w.tasks:
            task.cancel()
        self.index.remove_worker(worker_id)
        self.metrics.workers.forget(worker_id)

    async def _follow_membership(self) -> None:
        while True:
            try:
                membership = await self.controller.membership.remote(self.version, self.membership_wait_s)
            except ray.exceptions.RayActorError as exc:
                logger.warning("the cluster controller is unreachable (%s); retrying", exc)
                await asyncio.sleep(1.0)
                continue
            self._apply(membership)

    async def _follow_events(self, w: WorkerState) -> None:
        """Snapshot first (after_seq=-1), then every batch in order; a gap or a restart resyncs."""
        after = -1
        while True:
            asked = time.monotonic()
            try:
                reply = await w.entry.actor.kv_events.remote(after, self.events_timeout_s)
            except Exception as exc:
                self._failed(w, exc)
                after = -1
                await asyncio.sleep(self.retry_s)
                continue
            if not self._answered(w, asked):
                after = -1
                continue
            if reply.snapshot is not None:
                self.index.resync(w.worker_id, reply.snapshot, reply.seq, reply.tiers)
                after = reply.seq
                continue
            for batch in reply.batches:
                if not self.index.apply(batch):  # also after `lost` dropped the worker's entries
                    after = -1
                    break
                after = batch.seq

    async def _poll_stats(self, w: WorkerState) -> None:
        while True:
            asked = time.monotonic()
            try:
                actor = w.entry.actor
                stats, transfer = await asyncio.gather(actor.stats.remote(), actor.transfer_stats.remote())
            except Exception as exc:
                self._failed(w, exc)
                await asyncio.sleep(self.retry_s)
                continue
            if not self._answered(w, asked):
                continue
            w.report(stats, asked)
            self._notify_loads()
            self.metrics.workers.update(stats, transfer)
            await asyncio.sleep(self.stats_interval_s)

    def _answered(self, w: WorkerState, asked: float) -> bool:
        """A call made at `asked` succeeded: the worker is reachable, unless it was lost after the call went
        out (an answer from before a crash says nothing about the restarted process)."""
        if asked < w.lost_at:
            return False
        if not w.reachable:
            logger.info("worker %s is reachable again", w.worker_id)
            self._notify_loads()
        w.reachable = True
        return True

    def _failed(self, w: WorkerState, exc: Exception) -> None:
        if isinstance(exc, ray.exceptions.RayActorError):
            self.lost(w.worker_id, type(exc).__name__)
        elif isinstance(exc, EngineStopped):  # being removed; membership will say so shortly
            self.lost(w.worker_id, "shutting down")
        else:  # a bug, not a dead worker: keep its entries, say so, retry
            logger.exception("polling worker %s failed", w.worker_id, exc_info=exc)
