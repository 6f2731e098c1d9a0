"""Peer prefix pulls (issue 41): one worker pulls the leading blocks of a prompt's hash chain from a peer that holds
them (in its cache or a tier below) into its own prefix cache, where its next prefill finds them, instead of
computing them. Prefill and decode workers both pull (the router names the peer in `prefix_source`) and both
serve (`EngineServer.lease_prefix`). A pull takes the peer's lease and checksummed blocks over the worker's KV
client; a failure leaves the worker to compute, counted per reason (tandem:kv_peer_pull_failures)."""
from __future__ import annotations

import asyncio
import logging

import ray

from kv_transfer.failures import TransferFailures, failure_reason
from kv_transfer.handle import KVHandle, KVTransferError

logger = logging.getLogger(__name__)


class PrefixPuller:
    """Pulls prefix chains from peers into `engine`'s prefix cache. `loop` is the worker's EngineLoop (the block
    manager is touched on its thread only), `client` its KV client, `speed` the TransferSpeed its pulls are
    measured into (the router prices the next pull by it)."""

    def __init__(self, worker_id: str, engine, loop, client, speed):
        self.engine, self.loop, self.client, self.speed = engine, loop, client, speed
        self.counters = {"peer_pulls": 0, "peer_blocks_pulled": 0, "peer_bytes_pulled": 0,
                         "peer_pull_seconds": 0.0, "peer_blocks_had": 0}
        self.failures = TransferFailures(worker_id)
        self._handoff_lock = asyncio.Lock()
        self._releases: set[asyncio.Task] = set()

    def stats(self) -> dict:
        return {**self.counters, "peer_pull_failures_by_reason": self.failures.snapshot()}

    async def pull_for(self, req, request) -> None:
        """Pull the first blocks of `req`'s prompt from the peer the router named (`request.prefix_source`) into
        the prefix cache, where the request's prefill then finds them."""
        source = request.prefix_source
        bs = self.engine.config.block_size
        num_blocks = min(source.num_blocks, (req.num_prompt_tokens - 1) // bs)
        await self.loop.run(self.engine.block_manager.update_block_hashes, req, between_layers=True)
        request.stamp("peer_pull_started")
        await self.pull_chain(source.worker_id, source.actor, req.block_hashes[:num_blocks],
                              req.all_token_ids[:num_blocks * bs])
        request.stamp("peer_pull_done")

    async def hand_over(self, source_id: str, source, block_hashes: list[int], token_ids: list[int]) -> int:
        """`pull_chain`, one at a time: a drained worker's prefixes together may exceed the cache."""
        async with self._handoff_lock:
            return await self.pull_chain(source_id, source, block_hashes, token_ids)

    async def pull_chain(self, source_id: str, source, block_hashes: list[int], token_ids: list[int]) -> int:
        """Pull what this worker lacks of the chain from `source` (the peer's actor); what it has already (tiers
        included) is not pulled. A failure leaves it to compute, counted per reason. Returns the blocks pulled."""
        bm = self.engine.block_manager
        reserved = await self.loop.run(bm.reserve_prefix, block_hashes, token_ids, between_layers=True)
        if reserved is None:
            self.failures.record("no_free_blocks", source_id, "no free KV blocks to pull a prefix into")
            return 0
        have, dst = reserved
        self.counters["peer_blocks_had"] += have
        if not dst:
            return 0
        wanted = have + len(dst)
        bs = self.engine.config.block_size
        handle = None
        try:
            handle = await asyncio.wait_for(source.lease_prefix.remote(block_hashes[:wanted], token_ids[:wanted * bs]),
                                            self.client.timeout_s)
            if handle is None or len(handle.block_hashes) <= have:
                raise KVTransferError(f"{source_id} no longer holds the prefix", reason="lease_expired")
            used = dst[:len(handle.block_hashes) - have]
            stats = await asyncio.to_thread(self.client.pull, handle, used, list(range(have, have + len(used))))
        except (KVTransferError, asyncio.TimeoutError, ray.exceptions.RayError) as exc:
            reason = failure_reason(exc) if isinstance(exc, KVTransferError) else (
                "timeout" if isinstance(exc, asyncio.TimeoutError) else "unreachable")
            self.failures.record(reason, source_id, str(exc) or type(exc).__name__)
            await self._give_back(dst, handle)
            return 0
        except BaseException:
            await self._give_back(dst, handle)
            raise
        await self.loop.run(self._adopt, block_hashes, token_ids, used, have, dst[len(used):], between_layers=True)
        if stats.path != "shm":  # an shm copy released the lease; telling the peer is off the prefill's path
            self.release_later(handle)
        self.counters["peer_pulls"] += 1
        self.counters["peer_blocks_pulled"] += len(used)
        self.counters["peer_bytes_pulled"] += stats.num_bytes
        self.counters["peer_pull_seconds"] += stats.seconds
        self.speed.observe(stats.num_bytes, stats.seconds)
        return len(used)

    def release_later(self, handle: KVHandle) -> None:
        """Release `handle`'s lease in the background (the blocks are copied)."""
        release = asyncio.ensure_future(self.release(handle))
        self._releases.add(release)
        release.add_done_callback(self._releases.discard)

    async def release(self, handle: KVHandle) -> None:
        try:
            await asyncio.to_thread(self.client.release, handle)
        except KVTransferError as exc:  # the lease expires on its own; nothing leaks
            logger.debug("releasing lease %s failed: %s", handle.request_id, exc)

    async def _give_back(self, dst: list[int], handle: KVHandle | None) -> None:
        self.loop.submit(self.engine.block_manager.free_block_ids, list(reversed(dst)))
        if handle is not None:
            await self.release(handle)

    def _adopt(self, block_hashes, token_ids, used: list[int], have: int, unused: list[int]) -> None:
        self.engine.block_manager.adopt_prefix(block_hashes, token_ids, used, have)
        self.engine.block_manager.free_block_ids(unused)
