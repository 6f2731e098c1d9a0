"""The decode worker: imports the KV it lacks, joins the continuous batch, streams token deltas."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

import ray

from engine.config import EngineConfig
from worker_runtime.protocol import DispatchPath, GenerateRequest, PrefillResult, WorkerStats
from engine.request import Request
from worker_runtime.request_log import set_request_id
from kv_transfer.worker_server import start_kv_server
from worker_runtime.serving import EngineServer, WorkerDraining
from worker_runtime.tracing import emit_spans
from engine.step_costs import TransferSpeed
from kv_transfer.config import TransferConfig
from decode_workers.feeds import FeedServer
from kv_transfer.failures import TransferFailures, failure_reason
from kv_transfer.handle import KVHandle, KVTransferError

logger = logging.getLogger(__name__)


def make_kv_client(transfer: TransferConfig, cache):
    if transfer.backend == "torch_dist":
        from kv_transfer.dist_client import DistKVClient
        return DistKVClient(cache, transfer.token, timeout_s=transfer.timeout_s, tls=transfer.tls)
    from kv_transfer.grpc_client import GrpcKVClient
    return GrpcKVClient(cache, transfer.token, timeout_s=transfer.timeout_s, tls=transfer.tls,
                        shared_memory=transfer.shared_memory)


class DecodeWorker(EngineServer):
    """Runs the continuous batch. `generate` streams one request: after a remote prefill it pulls only the
    prompt blocks it does not already cache; without one (conditional disaggregation, or no healthy
    prefill worker) it prefills locally. A failed pull falls back to local recompute, counted per reason.

    An ingress process multiplexes its requests over one feed instead (`open_feed`, `start`, `abort`): a
    step's deltas for all of them cross Ray as one item, not one item per request (router/placement/feeds.py)."""

    pool = "decode"

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(worker_id, engine_config)
        self.kv_client = make_kv_client(transfer, self.engine.kv_cache)
        self.counters = {"remote_prefills": 0, "local_prefills": 0, "blocks_pulled": 0, "blocks_reused": 0,
                         "bytes_pulled": 0, "transfer_seconds": 0.0, "layerwise_pulls": 0, "shm_pulls": 0}
        self.failures = TransferFailures(worker_id)
        self.pull_speed = TransferSpeed()
        self._releases: set[asyncio.Task] = set()
        self.feeds = FeedServer(worker_id, self.generate)
        # Prefix blocks pulled from peers (issue 41): served to them from here, pulled from them on the router's
        # word; a failed peer pull falls back to computing, counted per reason like a failed import.
        self.pulls_prefixes = transfer.peer_prefix_pulls
        self.kv_server = start_kv_server(self.engine.kv_cache, transfer) if transfer.peer_prefix_pulls else None
        self.peer_counters = {"peer_pulls": 0, "peer_blocks_pulled": 0, "peer_bytes_pulled": 0,
                              "peer_pull_seconds": 0.0, "peer_blocks_had": 0}
        self.peer_failures = TransferFailures(worker_id)
        self._handoff_lock = asyncio.Lock()

    async def generate(self, request: GenerateRequest, prefill: PrefillResult | None = None,
                       pending: list | None = None):
        """Yield RequestOutput items until the request finishes; cancel the stream to abort it.

        On the REMOTE dispatch path `pending` (a list holding the ObjectRef of the prefill worker's
        PrefillResult, so that Ray hands it over unresolved) comes instead of `prefill`: the prompt's blocks
        are reserved while the prefill worker computes it, and the pull starts the moment its result arrives.
        If the prefill fails, the reservation is freed and its error ends this stream too.

        Layer-wise, `prefill.first` is None: the pull starts at once, while the prefill worker still
        writes the KV, and the request joins the batch once the first token (`prefill.first_ref`) arrives;
        if that token already finishes the request, the stream ends without yielding."""
        set_request_id(request.timeline.request_id)
        if self.draining:
            raise WorkerDraining(f"decode worker {self.worker_id} is draining")
        engine_req = self.build_request(request)
        # In flight from here on, so a drain waits for the prefill and the KV pull too, not only for decoding.
        self.in_flight.add(request.request_id)
        try:
            reserved = None
            if request.dispatch is DispatchPath.REMOTE:
                prefill, reserved = await self._reserve_during_prefill(engine_req, pending[0])
                if prefill is None:
                    return
            if prefill is not None and prefill.first is not None and prefill.first.finished:
                # The first candidate of several finished on the prefill worker's token: no KV to pull, the
                # others prefill here.
                engine_req = engine_req.pending_forks[0].take_pending(engine_req)
            add = self.engine.add
            if prefill is not None and prefill.kv_handle is not None:
                if prefill.first is not None:
                    engine_req.all_token_ids.extend(prefill.first.new_token_ids)
                add = await self._import(engine_req, prefill, request, reserved)
                if add is None:
                    return
            else:
                self.counters["local_prefills"] += 1
            if request.prefix_source is not None and add == self.engine.add:
                await self._pull_prefix(engine_req, request)
            request.stamp("decode_admitted")
            local = add != self.engine.add_imported  # no KV pulled: the prompt is computed here
            if local:
                request.stamp("prefill_queued")
            async for out in self.stream(request, engine_req, add):
                yield self.outgoing(out, request)
            timeline = request.timeline
            emit_spans(timeline, ("queue", "decode") if local else ("transfer", "decode_admission", "decode"),
                       {"decode": {"tandem.worker": self.worker_id},
                        "transfer": {"tandem.blocks_pulled": timeline.blocks_pulled, "tandem.bytes_pulled":
                                     timeline.bytes_pulled, "tandem.blocks_skipped": timeline.blocks_skipped}})
        finally:
            self.in_flight.discard(request.request_id)

    # ---- feeds (decode_workers/feeds.py): the Ray methods of this worker's FeedServer ------------------

    async def open_feed(self, feed_id: str):
        async with aclosing(self.feeds.open_feed(feed_id)) as items:
            async for item in items:
                yield item

    async def start(self, feed_id: str, key: int, request: GenerateRequest, prefill: PrefillResult | None = None,
                    pending: list | None = None) -> None:
        await self.feeds.start(feed_id, key, request, prefill, pending)

    def abort(self, feed_id: str, key: int) -> None:
        self.feeds.abort(feed_id, key)

    def feed_stats(self) -> dict:
        return self.feeds.stats()

    def feed_error(self, feed_id: str, key: int) -> None:
        self.feeds.error(feed_id, key)

    # ---- requests -------------------------------------------------------------------------------------

    async def _reserve_during_prefill(self, req: Request, result_ref) -> tuple[PrefillResult | None, list | None]:
        """Reserve the prompt's blocks, then wait for the prefill worker's result. Returns the result and
        the reserved block indices (None when the pool was short: the import tries again), or (None, None)
        when the prefill's first token finished the request (nothing to pull)."""
        indices = await self._reserve(req)
        try:
            prefill: PrefillResult = await result_ref
        except BaseException:  # the prefill failed (its caller handles that) or this stream was cancelled
            self.loop.submit(self.engine.release_import, req)
            raise
        if prefill.kv_handle is not None and not prefill.first.finished:
            return prefill, indices
        self.loop.submit(self.engine.release_import, req)  # generate goes on as if called after the prefill
        if not prefill.first.finished or req.pending_forks:
            return prefill, None
        if prefill.kv_handle is not None:
            await self._release_lease(prefill.kv_handle)
        return None, None

    async def _reserve(self, req: Request) -> list[int] | None:
        """`Engine.reserve_for_import` on the loop thread."""
        try:
            return await self.loop.run(self.engine.reserve_for_import, req)
        except asyncio.CancelledError:  # the reservation still happens (EngineLoop.run): undo it after
            self.loop.submit(self.engine.release_import, req)
            raise

    async def _import(self, req: Request, prefill: PrefillResult, request: GenerateRequest,
                      indices: list[int] | None = None):
        """Pull the missing prompt blocks into reserved ones (`indices`, made during the prefill, or reserved
        now); returns how to queue the request (None when its first token finished it)."""
        handle = prefill.kv_handle
        if indices is None:
            indices = await self._reserve(req)
        if indices is None:
            self.failures.record("no_free_blocks", handle.address, f"no free KV blocks for {req.request_id}")
            await self._release_lease(handle)
            if not await self._first_token(req, prefill):
                return None
            self.counters["local_prefills"] += 1
            return self.engine.add
        dst = [req.block_table[i] for i in indices]
        request.stamp("transfer_started")
        pull = asyncio.ensure_future(asyncio.to_thread(self._pull_checked, handle, dst, indices, request.lora_key))
        if prefill.first is None:
            self.counters["layerwise_pulls"] += 1
        try:
            if not await self._first_token(req, prefill):
                await self._abandon(pull, req, handle)
                return None
            stats = await asyncio.shield(pull)
        except KVTransferError as exc:
            self.failures.record(failure_reason(exc), handle.address, str(exc))
            await self.loop.run(self.engine.release_import, req)
            await self._release_lease(handle)
            self.counters["local_prefills"] += 1
            return self.engine.add
        except BaseException:  # cancelled, or the prefill worker failed before its first token
            await self._abandon(pull, req, handle)
            raise
        request.stamp("transfer_done")
        timeline = request.timeline
        timeline.blocks_pulled, timeline.blocks_skipped = len(indices), handle.num_blocks - len(indices)
        timeline.bytes_pulled = stats.num_bytes
        if stats.path == "shm":  # copied from the prefill worker's shared cache; the copy released the lease
            self.counters["shm_pulls"] += 1
        else:  # the blocks are ours now: telling the prefill worker is off the second token's path
            release = asyncio.ensure_future(self._release_lease(handle))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
        self.counters["remote_prefills"] += 1
        self.counters["blocks_pulled"] += len(indices)
        self.counters["blocks_reused"] += handle.num_blocks - len(indices)
        self.counters["bytes_pulled"] += stats.num_bytes
        self.counters["transfer_seconds"] += stats.seconds
        self.pull_speed.observe(stats.num_bytes, stats.seconds)
        return self.engine.add_imported

    async def _pull_prefix(self, req: Request, request: GenerateRequest) -> None:
        """Pull the prompt's first blocks from the peer the router named (`request.prefix_source`) into the prefix
        cache, where the local prefill then finds them."""
        source = request.prefix_source
        bs = self.engine.config.block_size
        num_blocks = min(source.num_blocks, (req.num_prompt_tokens - 1) // bs)
        await self.loop.run(self.engine.block_manager.update_block_hashes, req)
        request.stamp("peer_pull_started")
        await self._pull_chain(source.worker_id, source.actor, req.block_hashes[:num_blocks],
                               req.all_token_ids[:num_blocks * bs])
        request.stamp("peer_pull_done")

    async def pull_prefix(self, source_id: str, source, block_hashes: list[int], token_ids: list[int]) -> int:
        """Pull the prefix chain `block_hashes` (of `token_ids`) from the worker `source` (its actor) into this
        worker's prefix cache; returns the blocks pulled (a drained worker's prefixes handed over: the
        controller calls it)."""
        self.check_chain("pull_prefix", block_hashes, token_ids)
        async with self._handoff_lock:  # one at a time: a handover's prefixes together may exceed the cache
            return await self._pull_chain(source_id, source, block_hashes, token_ids)

    async def _pull_chain(self, source_id: str, source, block_hashes: list[int], token_ids: list[int]) -> int:
        """Pull what this worker lacks of the chain from `source`; what it has already (tiers included) is not
        pulled. A failure leaves it to compute, counted per reason (tandem:kv_peer_pull_failures). Returns the
        blocks pulled."""
        bm = self.engine.block_manager
        reserved = await self.loop.run(bm.reserve_prefix, block_hashes, token_ids)
        if reserved is None:
            self.peer_failures.record("no_free_blocks", source_id, "no free KV blocks to pull a prefix into")
            return 0
        have, dst = reserved
        self.peer_counters["peer_blocks_had"] += have
        if not dst:
            return 0
        wanted = have + len(dst)
        bs = self.engine.config.block_size
        handle = None
        try:
            handle = await asyncio.wait_for(source.lease_prefix.remote(block_hashes[:wanted], token_ids[:wanted * bs]),
                                            self.kv_client.timeout_s)
            if handle is None or len(handle.block_hashes) <= have:
                raise KVTransferError(f"{source_id} no longer holds the prefix", reason="lease_expired")
            used = dst[:len(handle.block_hashes) - have]
            stats = await asyncio.to_thread(self.kv_client.pull, handle, used, list(range(have, have + len(used))))
        except (KVTransferError, asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            reason = failure_reason(exc) if isinstance(exc, KVTransferError) else (
                "timeout" if isinstance(exc, asyncio.TimeoutError) else "unreachable")
            self.peer_failures.record(reason, source_id, str(exc) or type(exc).__name__)
            await self._give_back(dst, handle)
            return 0
        except BaseException:
            await self._give_back(dst, handle)
            raise
        await self.loop.run(self._adopt_prefix, block_hashes, token_ids, used, have, dst[len(used):])
        if stats.path != "shm":
            release = asyncio.ensure_future(self._release_lease(handle))
            self._releases.add(release)
            release.add_done_callback(self._releases.discard)
        self.peer_counters["peer_pulls"] += 1
        self.peer_counters["peer_blocks_pulled"] += len(used)
        self.peer_counters["peer_bytes_pulled"] += stats.num_bytes
        self.peer_counters["peer_pull_seconds"] += stats.seconds
        self.pull_speed.observe(stats.num_bytes, stats.seconds)
        return len(used)

    async def _give_back(self, dst: list[int], handle: KVHandle | None) -> None:
        self.loop.submit(self.engine.block_manager.free_block_ids, list(reversed(dst)))
        if handle is not None:
            await self._release_lease(handle)

    def _adopt_prefix(self, block_hashes, token_ids, used: list[int], have: int, unused: list[int]) -> None:
        self.engine.block_manager.adopt_prefix(block_hashes, token_ids, used, have)
        self.engine.block_manager.free_block_ids(unused)

    async def _first_token(self, req: Request, prefill: PrefillResult) -> bool:
        """Layer-wise: wait for the prefill worker's first token and append it; False if it finished the request."""
        if prefill.first is not None:
            return True
        first = await prefill.first_ref[0]
        if first.finished:
            return False
        req.all_token_ids.extend(first.new_token_ids)
        return True

    async def _abandon(self, pull: asyncio.Future, req: Request, handle: KVHandle) -> None:
        """Stop a pull and free what it reserved. Releasing the lease first ends a pull still waiting
        for layers; the pull thread writes into the reserved blocks until it ends, so wait for that."""
        await self._release_lease(handle)
        await asyncio.wait([pull])
        if not pull.cancelled():
            pull.exception()  # retrieved: its failure is expected here
        await self.loop.run(self.engine.release_import, req)

    async def _release_lease(self, handle: KVHandle) -> None:
        try:
            await asyncio.to_thread(self.kv_client.release, handle)
        except KVTransferError as exc:  # the lease expires on its own; nothing leaks
            logger.debug("%s: releasing lease %s failed: %s", self.worker_id, handle.request_id, exc)

    def _pull_checked(self, handle: KVHandle, dst: list[int], indices: list[int], lora_key: str | None):
        """Pull a prompt's KV, refusing KV computed with another LoRA adapter than the request runs (counted as a
        layout mismatch; the request computes its prompt here)."""
        if handle.lora_key != lora_key:
            raise KVTransferError(f"LoRA adapter mismatch: the KV of {handle.request_id} was computed with "
                                  f"{handle.lora_key or 'the base model'}, the request runs "
                                  f"{lora_key or 'the base model'}", "layout_mismatch")
        return self.kv_client.pull(handle, dst, indices)

    async def stats(self) -> WorkerStats:
        stats = await super().stats()
        stats.kv_pull_gbps, stats.kv_pull_latency_s = self.pull_speed.gbps, self.pull_speed.latency_s
        return stats

    def transfer_stats(self) -> dict:
        """Transfer counters since start; `transfer_failures_by_reason` counts pulls that fell back to local
        recompute (every reason of kv_transfer.failures.FAILURE_REASONS, zeros included)."""
        failures = self.failures.snapshot()
        return {**self.counters, "shm_unavailable": getattr(self.kv_client, "shm_unavailable", 0),
                "transfer_failures": sum(failures.values()),
                "transfer_failures_by_reason": failures, **self.peer_counters,
                "peer_pull_failures_by_reason": self.peer_failures.snapshot(),
                "bytes_served": 0 if self.kv_server is None else self.kv_server.stats.bytes_sent}

    def shutdown(self) -> None:
        if self.kv_server is not None:
            self.kv_server.stop(grace=1.0)
        self.kv_client.close()
        self.loop.stop()
        self.close_engine()
