"""The prefill worker: prefill-only engine, first token, KV leased to decode through the transport."""
from __future__ import annotations

import secrets

from engine.config import EngineConfig
from engine.protocol import GenerateRequest, PrefillResult
from engine.serving import EngineServer, WorkerDraining
from engine.transfer_config import TransferConfig
from kv_transfer.server import KVServerConfig, KVTransferServer


class PrefillWorker(EngineServer):
    """Batches and chunks the prompts of concurrent requests, samples each one's first token, and keeps
    its blocks pinned under a lease until the decode worker pulls them (or the lease expires)."""

    pool = "prefill"

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(worker_id, engine_config)
        server_config = KVServerConfig(host=transfer.host, lease_ttl_s=transfer.lease_ttl_s,
                                       max_workers=transfer.max_workers, dist=transfer.backend == "torch_dist")
        self.kv_server = KVTransferServer(self.engine.kv_cache, transfer.token or secrets.token_hex(16),
                                          server_config).start()

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Compute the prompt's KV and its first token; the returned handle lets decode pull the KV."""
        if self.draining:
            raise WorkerDraining(f"prefill worker {self.worker_id} is draining")
        request.stamp("prefill_queued")
        engine_req = self.build_request(request)
        engine_req.do_remote_decode = True
        last = None
        async for out in self.stream(request, engine_req):
            last = out
        request.stamp("prefill_done")
        handle = None
        if last.kv_transfer_params is not None:
            params = last.kv_transfer_params
            num_full = params["num_tokens"] // self.engine.config.block_size
            handle = self.kv_server.lease(request.request_id, params["block_ids"],
                                          engine_req.block_hashes[:num_full], params["num_tokens"],
                                          on_release=self._free_blocks)
        first = self.to_delta(last, request)
        first.times = dict(request.times)
        return PrefillResult(first, handle)

    def release(self, request_id: str) -> bool:
        """Drop a request's lease (the decode side aborted before pulling)."""
        return self.kv_server.release(request_id)

    def num_leases(self) -> int:
        return len(self.kv_server.leases)

    def transfer_stats(self) -> dict:
        return {"bytes_sent": self.kv_server.stats.bytes_sent, "chunks_sent": self.kv_server.stats.chunks_sent}

    def num_in_flight(self) -> int:
        return len(self.in_flight) + self.num_leases()

    def shutdown(self) -> None:
        self.kv_server.stop(grace=1.0)
        self.loop.stop()

    def _free_blocks(self, block_ids: list[int]) -> None:
        # Called from transport threads when a lease ends; the loop thread frees them before its next step.
        self.loop.submit(self.engine.block_manager.free_block_ids, list(reversed(block_ids)))
