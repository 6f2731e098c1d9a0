"""What prefill and decode workers share: an engine stepping in the background, its KV event log,
its load stats and request streams. Plain asyncio; the Ray actors in prefill_workers/ and
decode_workers/ build on it."""
from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import os
import threading
import time
import uuid
from array import array
from collections import OrderedDict

from engine.config import EngineConfig
from worker_runtime.cpu_cores import PinnedCores, cpu_quota, node_cores, pinning_is_safe, unpin
from worker_runtime.engine_loop import EngineLoop
from engine.errors import WorkerRankLost, WorkerStalled
from engine.kv_events import KVEventLog
from engine.outputs import RequestOutput
from worker_runtime.protocol import GenerateRequest, KVEventsReply, WorkerStats
from engine.request import Request, output_ids
from worker_runtime.request_log import install_request_log_records
from worker_runtime.tracing import configure_worker_tracing

logger = logging.getLogger(__name__)

class WorkerDraining(RuntimeError):
    """The worker is draining and takes no new requests; route elsewhere."""


class EngineServer:
    """One engine behind an async interface, owned by one worker actor."""

    pool = "engine"
    kv_server = None  # its KV export server (kv_transfer/worker_server.py), when it has one
    pulls_prefixes = False  # whether it pulls prefix blocks from peers when the router names one
    prefixes = None  # what pulls them: a kv_transfer.prefix_pulls.PrefixPuller

    def __init__(self, worker_id: str, engine_config: EngineConfig):
        self.worker_id = worker_id
        install_request_log_records()
        configure_worker_tracing(self.pool)
        # The model code (torch, transformers) loads here, in the worker's own process: the modules of the
        # worker classes stay light, so the controller that creates workers does not load it.
        from engine.engine import Engine

        self.cores, engine_config = pin_cores(engine_config)
        self.engine = Engine(engine_config)
        self.engine.warm_up()  # the router places by measured step costs from the first request on
        self.events = KVEventLog(worker_id)
        self.hot = HotPrefixes()  # what a drain hands to the workers that stay
        self.draining = False
        self.in_flight: set[str] = set()
        self.event_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self.event_waiters_lock = threading.Lock()  # added on event loops, woken from the engine thread
        self.loop = EngineLoop(self.engine, on_step=self._after_step, cores=self.cores)
        # The model, tokenizer and libraries are now allocated and live as long as the worker: out of the
        # collector's sight, so that the collections the engine loop's garbage triggers do not walk them
        # (perf: ~3% of a bare CPU decode step's samples were in the cyclic collector). vLLM's engine core
        # does the same.
        gc.collect()
        gc.freeze()

    # ---- requests -------------------------------------------------------------------------------

    def build_request(self, req: GenerateRequest) -> Request:
        # Validation and tokenization only read the engine, so they run here, off the loop thread.
        return self.engine.make_request(req.request_id, req.prompt_token_ids, req.sampling_params, req.cache_salt,
                                        req.output_token_ids, req.timeline, req.queue_priority, req.lora)

    async def stream(self, request: GenerateRequest, engine_req: Request, add=None):
        """Queue `engine_req` (with `add`, default Engine.add) and yield its outputs until it finishes (each
        of its n candidates, when it has several); cancelling the consumer aborts the request and frees
        its blocks. Outputs of several steps that accumulated while the consumer was busy come as one per
        candidate (RequestOutput.extend); none waits for more. The engine stamps the request's timeline
        (`engine_req.timeline` is `request.timeline`): its first scheduling and its prompt's forwards."""
        ids = output_ids(engine_req)
        queue: asyncio.Queue = asyncio.Queue()
        for rid in ids:
            self.loop.subscribe(rid, queue)
        self.in_flight.add(engine_req.request_id)
        running = set(ids)
        try:
            await self.loop.run(add or self.engine.add, engine_req, urgent=True)
            while running:
                batch = [await queue.get()]
                while not queue.empty():  # what else accumulated while the consumer was busy
                    batch.append(queue.get_nowait())
                for out in _coalesce(batch):
                    yield out
                    if out.finished or out.kv_transfer_params is not None:
                        running.discard(out.request_id)
        finally:
            self.in_flight.discard(engine_req.request_id)
            for rid in ids:
                self.loop.unsubscribe(rid)
                self.loop.submit(self.engine.abort, rid)
            self.hot.note(engine_req, self.engine.config.block_size)

    @staticmethod
    def outgoing(out: RequestOutput, request: GenerateRequest) -> RequestOutput:
        """`out` as the router gets it: the last one carries a copy of the request's timeline."""
        if out.finished:
            request.stamp("finished")
            out.timeline = request.timeline.copy()
        return out

    # ---- what the router and operators read ---------------------------------------------------

    async def unload_lora(self, name: str) -> bool:
        """Drop LoRA adapter `name` (the controller no longer serves it) from host memory and from any slot no
        running request uses; on the loop thread, which owns the slots."""
        return await self.loop.run(self.engine.unload_lora, name)

    async def stats(self) -> WorkerStats:
        counters = await self.loop.run(self._counters)
        stats = WorkerStats(self.worker_id, self.pool, draining=self.draining, serves_prefixes=self.kv_server is not None,
                            pulls_prefixes=self.pulls_prefixes, **counters)
        if self.prefixes is not None:  # its KV pulls, measured: the router prices the next one by them
            stats.kv_pull_gbps, stats.kv_pull_latency_s = self.prefixes.speed.gbps, self.prefixes.speed.latency_s
        return stats

    # ---- prefix blocks for peers --------------------------------------------------------------------

    MAX_PREFIX_BLOCKS = 16384

    async def lease_prefix(self, block_hashes: list[int], token_ids: list[int]):
        """Lease to a peer the leading blocks of this prefix chain that this worker holds (in its cache, or in
        a tier below, brought back for it): the KVHandle it pulls them with, or None when it holds none (or
        serves none). `token_ids` are the chain's tokens, one block's worth per hash (hits are confirmed by
        them). The lease ends when the peer releases it, or after transfer.lease_ttl_s."""
        bs = self.engine.config.block_size
        self.check_chain("lease_prefix", block_hashes, token_ids)
        if self.kv_server is None or not block_hashes:
            return None
        block_ids = await self.loop.run(self.engine.block_manager.hold_prefix, block_hashes, token_ids,
                                        between_layers=True)
        if not block_ids:
            return None
        try:
            return self.kv_server.lease(f"prefix-{uuid.uuid4().hex}", block_ids, block_hashes[:len(block_ids)],
                                        len(block_ids) * bs, on_release=self._free_leased)
        except BaseException:
            self._free_leased(block_ids)
            raise

    async def pull_prefix(self, source_id: str, source, block_hashes: list[int], token_ids: list[int]) -> int:
        """Pull the prefix chain `block_hashes` (of `token_ids`) from the worker `source` (its actor) into this
        worker's prefix cache; returns the blocks pulled (a drained worker's prefixes handed over: the
        controller calls it)."""
        self.check_chain("pull_prefix", block_hashes, token_ids)
        if self.prefixes is None:
            return 0
        return await self.prefixes.hand_over(source_id, source, block_hashes, token_ids)

    async def hot_prefixes(self, limit: int = 64) -> list[tuple[list[int], list[int]]]:
        """This worker's most used prompt prefixes (hash chain, tokens) whose first block it still holds, most
        used first: what a drain hands over to the workers that stay (the controller asks)."""
        bm = self.engine.block_manager

        def held(block_hashes, token_ids) -> bool:
            bs = bm.block_size
            tokens = token_ids[:bs]
            return bm.lookup(block_hashes[0], tokens) is not None or (
                bm.tiers is not None and bm.tiers.find(block_hashes[0], tokens) is not None)

        chains = self.hot.hottest(max(0, min(int(limit), HotPrefixes.MAX_CHAINS)))
        return await self.loop.run(lambda: [(list(h), list(t)) for h, t in chains if held(h, t)])

    def check_chain(self, what: str, block_hashes, token_ids) -> None:
        """Refuse a prefix chain from a peer that is not one: lists of non-negative int hashes (at most
        MAX_PREFIX_BLOCKS) and ints, a block's worth of tokens per hash."""
        bs = self.engine.config.block_size
        if (not isinstance(block_hashes, list) or not isinstance(token_ids, list)
                or len(block_hashes) > self.MAX_PREFIX_BLOCKS or len(token_ids) != len(block_hashes) * bs
                or not all(type(h) is int and h >= 0 for h in block_hashes)
                or not all(type(t) is int for t in token_ids)):
            raise ValueError(f"{what}: at most {self.MAX_PREFIX_BLOCKS} block hashes (non-negative ints) and "
                             f"{bs} token ids per hash")

    def _free_leased(self, block_ids: list[int]) -> None:
        # Called from transport threads when a lease ends; the loop thread frees them before its next step.
        self.loop.submit(self.engine.block_manager.free_block_ids, list(reversed(block_ids)))

    def _counters(self) -> dict:
        """The engine's counters and step costs, with the threads a forward would get now (on the loop
        thread, which owns the cores)."""
        counters = self.engine.stats()
        if self.cores is not None:
            costs = counters["step_costs"]
            costs.own_threads = self.cores.own_threads
            costs.borrow_threads = self.cores.threads_if_borrowing_now()
            costs.cpu_node = self.cores.node_key
            costs.lend_threads = self.cores.own_threads if self.cores.binding.lend else 0
            costs.borrows = self.cores.binding.borrow
            counters.update(cpu_busy_lends=self.cores.busy_lends, cpu_busy_lent_s=self.cores.busy_lent_s,
                            cpu_reclaim_timeouts=self.cores.reclaim_timeouts)
        return counters

    async def kv_events(self, after_seq: int, timeout_s: float = 1.0) -> KVEventsReply:
        """New KV event batches after `after_seq`, waiting up to `timeout_s` for some to appear.

        A consumer starts with `after_seq=-1` and gets a snapshot of the cached block hashes and the seq
        it reflects; so does one that fell behind the retained history or is ahead of it (restart)."""
        deadline = time.monotonic() + timeout_s
        while True:
            batches = self.events.since(after_seq)
            if batches is None or after_seq > self.events.seq:
                # Read seq before the snapshot: batches up to it are then in the snapshot, and a batch
                # published meanwhile is applied again on top, which set-like events tolerate.
                seq = self.events.seq
                bm = self.engine.block_manager
                snapshot, tiers = await self.loop.run(lambda: (bm.snapshot(), bm.tier_snapshot()))
                return KVEventsReply(self.worker_id, [], snapshot, seq, tiers or None)
            remaining = deadline - time.monotonic()
            if batches or remaining <= 0:
                return KVEventsReply(self.worker_id, batches, None, self.events.seq)
            await self._next_publish(after_seq, remaining)

    async def _next_publish(self, after_seq: int, timeout_s: float) -> None:
        """Return once a batch after `after_seq` is published, or after `timeout_s`. The engine thread wakes
        the waiter when it publishes: a long poll that sleeps instead of polling every 20 ms (each router
        polls each worker, and the wake-ups preempted the prefill forwards on the worker's core)."""
        loop = asyncio.get_running_loop()
        waiter = (loop, loop.create_future())
        with self.event_waiters_lock:
            self.event_waiters.add(waiter)
        try:
            if self.events.seq > after_seq:  # published before the waiter was registered
                return
            await asyncio.wait_for(waiter[1], timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            with self.event_waiters_lock:
                self.event_waiters.discard(waiter)

    def ping(self, stall_timeout_s: float | None = None) -> str:
        """The worker id; raises WorkerStalled when the engine loop has been stuck in one step or command
        for over `stall_timeout_s` (an actor's event loop answers while its engine thread hangs)."""
        stalled = self.loop.stalled_s()
        if stall_timeout_s is not None and stalled > stall_timeout_s:
            raise WorkerStalled(f"{self.worker_id}: the engine loop has made no progress for {stalled:.0f} s")
        ranks = self.engine.ranks
        if ranks is not None and not ranks.alive():  # the logical worker fails as a unit
            raise WorkerRankLost(f"{self.worker_id}: {ranks.describe()}")
        return self.worker_id

    def close_engine(self) -> None:
        """After the loop has stopped: stop a tensor-parallel engine's other ranks."""
        self.engine.close(graceful=not self.loop.thread.is_alive())

    async def cpu_placement(self) -> dict:
        """The cores this worker owns and borrows now, its affinity, and the torch threads its forwards use."""
        import torch

        placement = self.cores.describe() if self.cores is not None else {"cores": [], "borrowed": [],
                                                                          "affinity": sorted(os.sched_getaffinity(0))}
        placement["torch_threads"] = await self.loop.run(torch.get_num_threads)
        return placement

    def drain(self) -> None:
        """Stop taking new requests; in-flight ones finish."""
        self.draining = True

    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def _after_step(self, outputs: list[RequestOutput]) -> None:
        # Runs on the loop thread right after a step: events leave in the order they happened.
        seq = self.events.seq
        self.events.publish(self.engine.block_manager.take_events())
        if self.events.seq != seq:
            with self.event_waiters_lock:
                waiters = list(self.event_waiters)
            for loop, future in waiters:
                try:
                    loop.call_soon_threadsafe(_wake, future)
                except RuntimeError:  # that event loop has closed: nobody waits on it any more
                    pass


class HotPrefixes:
    """The full-block prompt prefixes of the requests a worker served, counted: the most used ones are what it
    hands over when drained. Bounded (least recently used out); a prompt that extends a counted one replaces it."""

    MAX_CHAINS = 256

    def __init__(self):
        self.chains: OrderedDict[int, list] = OrderedDict()  # last block hash -> [uses, hashes, tokens]

    def note(self, req: Request, block_size: int) -> None:
        num_full = min(req.num_prompt_tokens // block_size, len(req.block_hashes))
        if num_full < 2:
            return
        hashes = tuple(req.block_hashes[:num_full])
        entry = self.chains.pop(hashes[-1], None)
        if entry is None:
            entry = [0, hashes, array("l", req.all_token_ids[:num_full * block_size])]
            for i in range(num_full - 1):  # a shorter prefix of this one is covered by it now
                shorter = self.chains.pop(hashes[i], None)
                if shorter is not None:
                    entry[0] += shorter[0]
        entry[0] += 1
        self.chains[hashes[-1]] = entry
        while len(self.chains) > self.MAX_CHAINS:
            self.chains.popitem(last=False)

    def hottest(self, limit: int) -> list[tuple[tuple[int, ...], array]]:
        ranked = sorted(enumerate(self.chains.values()), key=lambda item: (item[1][0], item[0]), reverse=True)
        return [(entry[1], entry[2]) for _, entry in ranked[:limit]]


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """One output per request id, each folding in its later ones."""
    merged: dict[str, RequestOutput] = {}
    for out in outputs:
        if out.request_id in merged:
            merged[out.request_id].extend(out)
        else:
            merged[out.request_id] = out
    return list(merged.values())


def pin_cores(config: EngineConfig) -> tuple[PinnedCores | None, EngineConfig]:
    """Take the worker's own cores when `config.cpu_binding` asks for them and the engine runs on CPU;
    threads default to the cores taken. A node without free cores leaves the worker unpinned."""
    binding = config.cpu_binding
    if binding is None or binding.cores < 1 or config.torch_device.type != "cpu":
        unpin()
        return None, config
    if not pinning_is_safe(node_cores(), cpu_quota()):
        logger.warning("a CPU quota below the CPUs this container sees: its cores are shared, running unpinned")
        unpin()
        return None, dataclasses.replace(config, num_threads=config.num_threads or binding.cores)
    cores = PinnedCores(binding, config.num_threads)
    if not cores.owned:
        logger.warning("no free cores on this node: running unpinned with %d threads",
                                            config.num_threads or binding.cores)
        cores.close()
        unpin()
        return None, dataclasses.replace(config, num_threads=config.num_threads or binding.cores)
    if len(cores.owned) < binding.cores:
        logger.warning("this node had %d free cores of the %d asked for",
                                            len(cores.owned), binding.cores)
    return cores, dataclasses.replace(config, num_threads=cores.own_threads)
