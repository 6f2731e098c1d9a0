"""Helpers shared by the tests that drive real prefill/decode actors through router.dispatch.run_request."""
from __future__ import annotations

import asyncio
import time

from router.dispatch import run_request


def only(pool):
    """The actor of a one-worker pool."""
    return next(iter(pool.workers.values())).actor


async def collect(request, decode, prefill=None, layerwise=False):
    """(all token ids, the deltas) of one request."""
    deltas = [d async for d in run_request(request, decode, prefill, layerwise=layerwise)]
    return [t for d in deltas for t in d.new_token_ids], deltas


def run_all(reqs, decode, prefill=None, layerwise=False):
    """Run requests concurrently to the end; one (tokens, deltas) per request."""
    async def main():
        return await asyncio.gather(*(collect(r, decode, prefill, layerwise) for r in reqs))
    return asyncio.run(main())


def wait_for(predicate, timeout_s=10.0, interval_s=0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
