"""The decode worker: imports the KV it lacks, joins the continuous batch, streams token deltas."""
from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing

from engine.config import EngineConfig
from worker_runtime.protocol import DispatchPath, GenerateRequest, PrefillResult
from engine.request import Request
from worker_runtime.request_log import set_request_id
from kv_transfer.prefix_pulls import PrefixPuller
from kv_transfer.worker_server import make_kv_client, start_kv_server
from worker_runtime.serving import EngineServer, WorkerDraining
from worker_runtime.tracing import emit_spans
from engine.step_costs import TransferSpeed
from kv_transfer.config import TransferConfig
from decode_workers.feeds import FeedServer
from kv_transfer.failures import TransferFailures, failure_reason
from kv_transfer.handle import KVHandle, KVTransferError

logger = logging.getLogger(__name__)


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
        self.feeds = FeedServer(worker_id, self.generate)
        # Prefix blocks pulled from peers (issue 41): served to them from here, pulled from them on the router's
        # word; a failed peer pull falls back to computing, counted per reason like a failed import.
        self.pulls_prefixes = transfer.peer_prefix_pulls
        self.kv_server = start_kv_server(self.engine.kv_cache, transfer) if transfer.peer_prefix_pulls else None
        self.prefixes = PrefixPuller(worker_id, self.engine, self.loop, self.kv_client, self.pull_speed)

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
                await self.prefixes.pull_for(engine_req, request)
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
            await self.prefixes.release(prefill.kv_handle)
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
            await self.prefixes.release(handle)
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
            await self.prefixes.release(handle)
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
            self.prefixes.release_later(handle)
        self.counters["remote_prefills"] += 1
        self.counters["blocks_pulled"] += len(indices)
        self.counters["blocks_reused"] += handle.num_blocks - len(indices)
        self.counters["bytes_pulled"] += stats.num_bytes
        self.counters["transfer_seconds"] += stats.seconds
        self.pull_speed.observe(stats.num_bytes, stats.seconds)
        return self.engine.add_imported

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
        await self.prefixes.release(handle)
        await asyncio.wait([pull])
        if not pull.cancelled():
            pull.exception()  # retrieved: its failure is expected here
        await self.loop.run(self.engine.release_import, req)

    def _pull_checked(self, handle: KVHandle, dst: list[int], indices: list[int], lora_key: str | None):
        """Pull a prompt's KV, refusing KV computed with another LoRA adapter than the request runs (counted as a
        layout mismatch; the request computes its prompt here)."""
        if handle.lora_key != lora_key:
            raise KVTransferError(f"LoRA adapter mismatch: the KV of {handle.request_id} was computed with "
                                  f"{handle.lora_key or 'the base model'}, the request runs "
                                  f"{lora_key or 'the base model'}", "layout_mismatch")
        return self.kv_client.pull(handle, dst, indices)

    def transfer_stats(self) -> dict:
        """Transfer counters since start; `transfer_failures_by_reason` counts pulls that fell back to local
        recompute (every reason of kv_transfer.failures.FAILURE_REASONS, zeros included)."""
        failures = self.failures.snapshot()
        return {**self.counters, "shm_unavailable": getattr(self.kv_client, "shm_unavailable", 0),
                "transfer_failures": sum(failures.values()),
                "transfer_failures_by_reason": failures, **self.prefixes.stats(),
                "bytes_served": 0 if self.kv_server is None else self.kv_server.stats.bytes_sent}

    def shutdown(self) -> None:
        if self.kv_server is not None:
            self.kv_server.stop(grace=1.0)
        self.kv_client.close()
        self.loop.stop()
        self.close_engine()
