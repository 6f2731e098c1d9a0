"""The decode worker: imports the KV it lacks, joins the continuous batch, streams token deltas."""
from __future__ import annotations

import asyncio
import logging

from engine.config import EngineConfig
from engine.protocol import GenerateRequest, PrefillResult
from engine.request import Request
from engine.serving import EngineServer, WorkerDraining
from engine.transfer_config import TransferConfig
from kv_transfer.handle import KVHandle, KVTransferError

logger = logging.getLogger(__name__)


def make_kv_client(transfer: TransferConfig, cache):
    if transfer.backend == "torch_dist":
        from kv_transfer.dist_client import DistKVClient
        return DistKVClient(cache, transfer.token, timeout_s=transfer.timeout_s)
    from kv_transfer.grpc_client import GrpcKVClient
    return GrpcKVClient(cache, transfer.token, timeout_s=transfer.timeout_s)


class DecodeWorker(EngineServer):
    """Runs the continuous batch. `generate` streams one request: after a remote prefill it pulls only the
    prompt blocks it does not already cache; without one (conditional disaggregation, or no healthy
    prefill worker) it prefills locally. A failed pull falls back to local recompute."""

    pool = "decode"

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(worker_id, engine_config)
        self.kv_client = make_kv_client(transfer, self.engine.kv_cache)
        self.counters = {"remote_prefills": 0, "local_prefills": 0, "blocks_pulled": 0, "blocks_reused": 0,
                         "bytes_pulled": 0, "transfer_seconds": 0.0, "transfer_failures": 0}

    async def generate(self, request: GenerateRequest, prefill: PrefillResult | None = None):
        """Yield TokenDelta items until the request finishes; cancel the stream to abort it."""
        if self.draining:
            raise WorkerDraining(f"decode worker {self.worker_id} is draining")
        engine_req = self.build_request(request)
        # In flight from here on, so a drain waits for the KV pull too, not only for decoding.
        self.in_flight.add(request.request_id)
        try:
            add = self.engine.add
            if prefill is not None and prefill.kv_handle is not None:
                engine_req.all_token_ids.extend(prefill.first.token_ids)
                add = await self._import(engine_req, prefill.kv_handle, request)
            else:
                self.counters["local_prefills"] += 1
            request.stamp("decode_admitted")
            async for out in self.stream(request, engine_req, add):
                yield self.to_delta(out, request)
        finally:
            self.in_flight.discard(request.request_id)

    async def _import(self, req: Request, handle: KVHandle, request: GenerateRequest):
        """Pull the missing prompt blocks into freshly reserved ones; returns how to queue the request."""
        indices = await self.loop.run(self.engine.reserve_for_import, req)
        if indices is None:
            logger.warning("%s: no free blocks to import %s; recomputing locally", self.worker_id, req.request_id)
            await self._release_lease(handle)
            self.counters["local_prefills"] += 1
            return self.engine.add
        dst = [req.block_table[i] for i in indices]
        request.stamp("transfer_started")
        pull = asyncio.ensure_future(asyncio.to_thread(self.kv_client.pull, handle, dst, indices))
        try:
            stats = await asyncio.shield(pull)
        except asyncio.CancelledError:
            # The pull thread still writes into the reserved blocks: let it end before freeing them.
            await asyncio.wait([pull])
            await self.loop.run(self.engine.release_import, req)
            await self._release_lease(handle)
            raise
        except KVTransferError as exc:
            logger.warning("%s: KV pull for %s failed (%s); recomputing locally", self.worker_id,
                           req.request_id, exc)
            await self.loop.run(self.engine.release_import, req)
            await self._release_lease(handle)
            self.counters["transfer_failures"] += 1
            self.counters["local_prefills"] += 1
            return self.engine.add
        request.stamp("transfer_done")
        await self._release_lease(handle)
        self.counters["remote_prefills"] += 1
        self.counters["blocks_pulled"] += len(indices)
        self.counters["blocks_reused"] += handle.num_blocks - len(indices)
        self.counters["bytes_pulled"] += stats.num_bytes
        self.counters["transfer_seconds"] += stats.seconds
        return self.engine.add_imported

    async def _release_lease(self, handle: KVHandle) -> None:
        try:
            await asyncio.to_thread(self.kv_client.release, handle)
        except KVTransferError as exc:  # the lease expires on its own; nothing leaks
            logger.info("%s: releasing lease %s failed: %s", self.worker_id, handle.request_id, exc)

    def transfer_stats(self) -> dict:
        return dict(self.counters)

    def shutdown(self) -> None:
        self.kv_client.close()
        self.loop.stop()



