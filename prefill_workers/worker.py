"""The prefill worker: prefill-only engine, first token, KV leased to decode through the transport.

By default a request's blocks are leased once its first token is sampled. Layer-wise
(`TransferConfig.layerwise`) they are leased when the engine schedules the prompt's last chunk, with
no layer ready yet, and each decoder layer is marked ready as the forward passes it: `prefill` then
returns the handle before the first token exists, so decode pulls while this worker still computes,
and `first_token` answers once the token is sampled.
"""
from __future__ import annotations

import asyncio
import logging

from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.outputs import RequestOutput
from worker_runtime.protocol import DispatchPath, GenerateRequest, PrefillResult
from engine.request import Request
from worker_runtime.request_log import set_request_id
from engine.step_costs import TransferSpeed
from kv_transfer.prefix_pulls import PrefixPuller
from kv_transfer.worker_server import make_kv_client, start_kv_server
from worker_runtime.serving import EngineServer, WorkerDraining
from worker_runtime.tracing import emit_spans
from kv_transfer.config import TransferConfig
from kv_transfer.handle import KVHandle

logger = logging.getLogger(__name__)


class PrefillWorker(EngineServer):
    """Batches and chunks the prompts of concurrent requests, samples each one's first token, and keeps
    its blocks pinned under a lease until the decode worker pulls them (or the lease expires)."""

    pool = "prefill"

    def __init__(self, worker_id: str, engine_config: EngineConfig, transfer: TransferConfig):
        super().__init__(worker_id, engine_config)
        from engine.layer_progress import LayerProgress  # here, with the model (see EngineServer.__init__)
        self.kv_server = start_kv_server(self.engine.kv_cache, transfer)
        # Prefix blocks another worker holds are pulled from it, on the router's word, instead of computed
        # (issue 41); without a prefix source nothing is pulled.
        self.pulls_prefixes = transfer.peer_prefix_pulls
        self.kv_client = make_kv_client(transfer, self.engine.kv_cache) if self.pulls_prefixes else None
        if self.pulls_prefixes:
            self.prefixes = PrefixPuller(worker_id, self.engine, self.loop, self.kv_client, TransferSpeed())
        self.lease_ttl_s = transfer.lease_ttl_s
        self.counters = {"layerwise_leases": 0, "forwards_ended_with_pull_open": 0}
        # Layer-wise requests waiting for their last chunk to be scheduled (read and written on the loop thread).
        self.awaiting_lease: dict[str, asyncio.Future] = {}
        # Layer-wise requests whose `prefill` returned early, until `first_token` claims them.
        self.first_tokens: dict[str, asyncio.Task] = {}
        self.layer_progress = None
        if transfer.layerwise:
            self.layer_progress = LayerProgress(self.engine.runner.model, self.engine.runner.device,
                                                self._layers_ready)
            self.loop.step_context.on_scheduled = self._lease_last_chunks

    async def prefill(self, request: GenerateRequest) -> PrefillResult:
        """Compute the prompt's KV and its first token; the returned handle lets decode pull the KV.

        On the LAYERWISE dispatch path the result may come back before the first token (`first` None): see
        `first_token`."""
        if self.draining:
            raise WorkerDraining(f"prefill worker {self.worker_id} is draining")
        if request.output_token_ids:
            raise InvalidRequestError("a prefill worker hands over prompt KV only; a migrated request "
                                      "prefills on its decode worker", field="output_token_ids")
        set_request_id(request.timeline.request_id)
        request.stamp("prefill_queued")
        engine_req = self.build_request(request)
        engine_req.do_remote_decode = True
        if request.prefix_source is not None and self.prefixes is not None:
            await self.prefixes.pull_for(engine_req, request)
        if request.dispatch is not DispatchPath.LAYERWISE:
            return PrefillResult(*await self._run_to_first_token(request, engine_req))
        return await self._prefill_layerwise(request, engine_req)

    def build_request(self, req: GenerateRequest) -> Request:
        """The n candidates of a prompt are prefilled as their first one, under the request's id (its lease);
        decode forks the others from the pulled prompt."""
        params = req.candidate_params(0) if req.num_outputs > 1 else req.sampling_params
        return self.engine.make_request(req.request_id, req.prompt_token_ids, params, req.cache_salt,
                                        timeline=req.timeline, priority=req.queue_priority, lora=req.lora)

    async def first_token(self, request_id: str) -> RequestOutput:
        """Layer-wise: the first token of a request whose `prefill` returned before it was sampled."""
        task = self.first_tokens.get(request_id)
        if task is None:
            return _aborted(request_id)
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self.first_tokens.pop(request_id, None)  # claimed; until now `release` could still abort it
        if task.cancelled():
            return _aborted(request_id)
        first, _ = task.result()
        return first

    async def release(self, request_id: str) -> bool:
        """Abort a request whose first token is still pending and drop its lease (the client went away,
        or decode will not pull); False if there was no lease."""
        task = self.first_tokens.pop(request_id, None)
        if task is not None:
            task.cancel()
        return self.kv_server.release(request_id)

    def num_leases(self) -> int:
        return len(self.kv_server.leases)

    def transfer_stats(self) -> dict:
        return {"bytes_sent": self.kv_server.stats.bytes_sent, "chunks_sent": self.kv_server.stats.chunks_sent,
                **self.counters, **(self.prefixes.stats() if self.prefixes is not None else {})}

    def num_in_flight(self) -> int:
        return len(self.in_flight) + self.num_leases()

    def shutdown(self) -> None:
        if self.layer_progress is not None:
            self.layer_progress.close()
        self.kv_server.stop(grace=1.0)
        if self.kv_client is not None:
            self.kv_client.close()
        self.loop.stop()
        self.close_engine()

    # ---- prefill to the first token -----------------------------------------------------------------

    async def _prefill_layerwise(self, request: GenerateRequest, engine_req: Request) -> PrefillResult:
        leased = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._run_to_first_token(request, engine_req, leased))
        try:
            await asyncio.wait([leased, task], return_when=asyncio.FIRST_COMPLETED)
            if task.done() or leased.result() is None:  # done before its last chunk ran, or no early lease
                return PrefillResult(*await task)
        except asyncio.CancelledError:
            task.cancel()
            raise
        rid = request.request_id
        self.first_tokens[rid] = task

        def forget_unclaimed() -> None:  # the caller vanished without claiming the token or releasing
            if self.first_tokens.get(rid) is task:
                del self.first_tokens[rid]

        task.add_done_callback(lambda _: asyncio.get_running_loop().call_later(self.lease_ttl_s, forget_unclaimed))
        return PrefillResult(None, leased.result())

    async def _run_to_first_token(self, request: GenerateRequest, engine_req: Request,
                                  leased: asyncio.Future | None = None) -> tuple[RequestOutput, KVHandle | None]:
        """Run the prompt to its first token. The lease is `leased`'s when one was taken early (layer-wise),
        else a new one; None when the request finished on its first token."""
        rid = request.request_id
        add = self.engine.add
        if leased is not None:
            def add(req: Request) -> None:
                self.awaiting_lease[rid] = leased
                self.engine.add(req)
        last = None
        try:
            async for out in self.stream(request, engine_req, add):
                last = out
        except BaseException:
            # Queued after the stream's abort, so no early lease can follow it.
            self.loop.submit(self._drop, engine_req)
            raise
        self.loop.submit(self.awaiting_lease.pop, rid, None)
        request.stamp("prefill_done")
        emit_spans(request.timeline, ("queue", "prefill"), {"prefill": {"tandem.worker": self.worker_id}})
        handle = leased.result() if leased is not None and leased.done() else None
        params = last.kv_transfer_params
        if params is None and handle is not None:
            self.kv_server.release(rid)
            handle = None
        elif params is not None and handle is not None:
            # The early lease holds its own references to the blocks: drop the engine's.
            self.loop.submit(self.engine.block_manager.free, engine_req)
        elif params is not None:
            handle = self._lease(engine_req, params["block_ids"])
        first = self.outgoing(last, request)
        first.timeline = request.timeline.copy()
        return first, handle

    def _lease(self, req: Request, block_ids: list[int], layers_ready: int | None = None) -> KVHandle:
        num_full = req.num_prompt_tokens // self.engine.config.block_size
        return self.kv_server.lease(req.request_id, block_ids, req.block_hashes[:num_full], req.num_prompt_tokens,
                                    on_release=self._free_leased, layers_ready=layers_ready,
                                    lora_key=req.lora and req.lora.key)

    # ---- loop thread: leasing early and marking layers ready ------------------------------------------

    def _lease_last_chunks(self, scheduled: list[tuple[Request, int]]) -> None:
        """StepContext.on_scheduled: lease the blocks of layer-wise requests whose last prompt chunk runs now."""
        leased = []
        for req, num_new in scheduled:
            if req.request_id not in self.awaiting_lease or req.num_computed_tokens + num_new < req.num_tokens:
                continue
            future = self.awaiting_lease.pop(req.request_id)
            handle = None
            try:
                handle = self._lease(req, list(req.block_table), layers_ready=0)
                self.engine.block_manager.add_references(req.block_table)
                self.counters["layerwise_leases"] += 1
                leased.append(req.request_id)
            except Exception:  # the request still completes; it is leased the default way, after sampling
                logger.exception("%s: early KV lease of %s failed", self.worker_id, req.request_id)
            future.get_loop().call_soon_threadsafe(_resolve, future, handle)
        self.layer_progress.watch(leased)

    def _layers_ready(self, request_ids: list[str], num_layers: int) -> None:
        if num_layers == self.layer_progress.num_layers and self.kv_server.leases.num_active_pulls:
            self.counters["forwards_ended_with_pull_open"] += 1
        for rid in request_ids:
            self.kv_server.mark_layers_ready(rid, num_layers)

    def _drop(self, req: Request) -> None:
        """After an abort: end the request's early lease, and free blocks the engine handed over with a
        first token that nobody received (the request completed in the step that ran while aborting)."""
        self.awaiting_lease.pop(req.request_id, None)
        self.kv_server.release(req.request_id)
        if req.finished and req.block_table:
            self.engine.block_manager.free(req)



def _resolve(future: asyncio.Future, handle: KVHandle | None) -> None:
    if not future.done():  # the prefill call may have been cancelled meanwhile
        future.set_result(handle)


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(request_id, [], "", finished=True, finish_reason="abort")
