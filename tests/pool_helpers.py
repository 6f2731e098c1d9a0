"""Helpers shared by the tests that drive real prefill/decode actors through router.placement.dispatch.run_request or a
RequestRouter."""
from __future__ import annotations

import asyncio

from router.placement.dispatch import run_request
from router.placement.pool_policy import Placement
from router.placement.routing import RouteDecision, dispatch_path


def only(pool):
    """The actor of a one-worker pool."""
    return next(iter(pool.workers.values())).actor


def placed(request, remote, layerwise=False):
    """`request` with the dispatch path the router gives it when placed with (`remote`) or without a
    prefill worker."""
    request.dispatch = dispatch_path(request, remote, layerwise)
    return request


async def collect(request, decode, prefill=None, layerwise=False):
    """(all token ids, the deltas) of one request."""
    deltas = [d async for d in run_request(placed(request, prefill is not None, layerwise), decode, prefill)]
    return [t for d in deltas for t in d.new_token_ids], deltas


async def close_after(stream, num_tokens: int) -> None:
    """Read a request's deltas until `num_tokens` tokens came, then close the stream (the client goes away)."""
    got = 0
    async for delta in stream:
        got += len(delta.new_token_ids)
        if got >= num_tokens:
            break
    await stream.aclose()


def run_all(reqs, decode, prefill=None, layerwise=False):
    """Run requests concurrently to the end; one (tokens, deltas) per request."""
    async def main():
        return await asyncio.gather(*(collect(r, decode, prefill, layerwise) for r in reqs))
    return asyncio.run(main())


class OneWorkerView:
    """Just enough of a WorkerView for a RequestRouter over one decode worker."""
    block_size = 16

    def __init__(self, actor):
        self.decode = actor

    def route(self, block_hashes, num_tokens, excluded, **options):
        return RouteDecision(Placement("decode-0", 0, 0.0), None, "only worker")

    def preview(self, block_hashes, num_tokens, *options):  # what `route` would say: never a wait
        return self.route(block_hashes, num_tokens, ())

    def some_prefill_queue_full(self):  # one decode worker, no prefill queue
        return False

    def saturated(self):
        return False

    def begin(self, decision, request_id, num_tokens, block_hashes=()):
        pass

    def end(self, decision, request_id):
        pass

    def actor(self, worker_id):
        return self.decode

    def peer_prefix(self, decode_id, block_hashes, prompt_tokens):  # one worker: no peer to pull from
        return None
