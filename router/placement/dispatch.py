"""Runs one placed request across its workers: prefill on P (first token at once), then decode on D."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import ray

from engine.outputs import RequestOutput
from worker_runtime.protocol import DispatchPath, GenerateRequest, PrefillResult
from router.placement import feeds
from router.placement.feeds import FedStream

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Run:
    """What one dispatch has started so far, for the cleanup when it ends early."""
    running: int  # candidates still generating
    result: PrefillResult | None = None
    stream: FedStream | None = None
    finished: bool = False


async def run_request(request: GenerateRequest, decode, prefill=None) -> AsyncIterator[RequestOutput]:
    """Yield the request's token deltas along its dispatch path (`request.dispatch`, set when it was placed;
    `prefill` is the prefill worker's actor on every path but LOCAL). With a prefill worker, its first token
    is yielded before decode's. Closing the iterator (client gone) aborts the request on the decode worker and
    frees its blocks on both workers. Decode's deltas come over this process's feed from that worker
    (router/placement/feeds.py).

    REMOTE: decode starts with the prefill: it reserves the prompt's blocks meanwhile and receives the
    prefill's result (the first token and the KV handle) straight from the prefill worker, so neither a hop
    through this process nor a wait for a decode step boundary lies between the first token and the pull.

    LAYERWISE: the prefill worker answers before the first token exists: decode then starts from that
    answer, pulling at once, and both this function and decode await the first token's ObjectRef.

    SEQUENTIAL: decode starts from the prefill worker's first token. A request with n candidates (or n
    best beams) yields each one's deltas under its `index`; the prefill worker's first token is the first
    candidate's, and decode forks the others."""
    if (prefill is None) != (request.dispatch is DispatchPath.LOCAL):
        raise ValueError(f"the {request.dispatch.value} dispatch path "
                         f"{'needs' if prefill is None else 'takes no'} prefill worker")
    run = _Run(request.num_outputs)
    try:
        if prefill is not None:
            await _prefill_first(request, decode, prefill, run)
            run.running -= run.result.first.finished
            if not run.running:  # a layer-wise decode sees it too, and ends without pulling further
                run.finished = True
                yield run.result.first
                return
        if run.stream is None:
            # Decode starts pulling KV before the first token reaches the client.
            run.stream = feeds.start(decode, request, run.result)
        if run.result is not None:
            yield run.result.first
        # Deltas that arrived while this consumer was busy come as one (router/placement/feeds.py).
        async for delta in run.stream:
            run.running -= delta.finished
            run.finished = not run.running
            yield delta
    finally:
        if not run.finished:
            if run.stream is not None:
                run.stream.close()
            # Decode aborted, failed or never pulled: the lease must not wait for its TTL.
            if run.result is not None and run.result.kv_handle is not None:
                await _release(prefill, request.request_id)


async def _prefill_first(request: GenerateRequest, decode, prefill, run: _Run) -> None:
    """Run the prompt on the prefill worker to its first token (`run.result`), starting decode beside it
    (`run.stream`) when the path says so: REMOTE at once, LAYERWISE once the KV is leased."""
    request.stamp("prefill_dispatched")
    result_ref = prefill.prefill.remote(request)
    if request.dispatch is DispatchPath.REMOTE:
        run.stream = feeds.start(decode, request, None, [result_ref])
    run.result = result = await _prefill(result_ref, prefill, request)
    if result.first is None:  # leased before the first token was sampled
        result.first_ref = [prefill.first_token.remote(request.request_id)]
        run.stream = feeds.start(decode, request, result)
        result.first = await result.first_ref[0]


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
