"""Runs one placed request across its workers: prefill on P (first token at once), then decode on D."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import ray

from engine.outputs import RequestOutput
from worker_runtime.protocol import GenerateRequest, PrefillResult
from router import feeds

logger = logging.getLogger(__name__)


async def run_request(request: GenerateRequest, decode, prefill=None, *,
                      layerwise: bool = False) -> AsyncIterator[RequestOutput]:
    """Yield the request's token deltas. With a prefill worker, its first token is yielded before decode's.
    Closing the iterator (client gone) aborts the request on the decode worker and frees its blocks on both
    workers. Decode's deltas come over this process's feed from that worker (router/feeds.py).

    Decode starts with the prefill: it reserves the prompt's blocks meanwhile and receives the prefill's
    result (the first token and the KV handle) straight from the prefill worker, so neither a hop through
    this process nor a wait for a decode step boundary lies between the first token and the pull.

    A layer-wise prefill worker (`layerwise`) answers before the first token exists: decode then starts
    from that answer, pulling at once, and both this function and decode await the first token's ObjectRef.

    A request with n candidates (or n best beams) yields each one's deltas under its `index`; the prefill
    worker's first token is the first candidate's, and decode forks the others."""
    result: PrefillResult | None = None
    stream = None
    finished = False
    running = request.num_outputs  # candidates still generating
    try:
        if prefill is not None:
            request.stamp("prefill_dispatched")
            result_ref = prefill.prefill.remote(request)
            if not layerwise and request.num_outputs == 1 and request.sampling_params.max_tokens != 1:
                stream = feeds.start(decode, request, None, [result_ref])
            result = await _prefill(result_ref, prefill, request)
            if result.first is None:
                result.first_ref = [prefill.first_token.remote(request.request_id)]
                stream = feeds.start(decode, request, result)
                result.first = await result.first_ref[0]
            running -= result.first.finished
            if not running:  # a layer-wise decode sees it too, and ends without pulling further
                finished = True
                yield result.first
                return
        if stream is None:
            # Decode starts pulling KV before the first token reaches the client.
            stream = feeds.start(decode, request, result)
        if result is not None:
            yield result.first
        # Deltas that arrived while this consumer was busy come as one (router/feeds.py).
        async for delta in stream:
            running -= delta.finished
            finished = not running
            yield delta
    finally:
        if not finished:
            if stream is not None:
                stream.close()
            # Decode aborted, failed or never pulled: the lease must not wait for its TTL.
            if result is not None and result.kv_handle is not None:
                await _release(prefill, request.request_id)


async def _prefill(ref, prefill, request: GenerateRequest) -> PrefillResult:
    try:
        return await ref
    except asyncio.CancelledError:  # the client left during prefill: stop it, and drop a lease it made
        ray.cancel(ref)
        await _release(prefill, request.request_id)
        raise


async def _release(prefill, request_id: str) -> None:
    try:
        await asyncio.wait_for(prefill.release.remote(request_id), timeout=5)
    except Exception as exc:  # the lease also expires on its own
        logger.info("releasing the lease of %s failed: %s", request_id, exc)
