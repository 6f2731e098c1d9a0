"""Pull KV blocks over torch.distributed: headers over gRPC, payloads by point-to-point recv.

Both ends derive the same chunk plan from the request, so receives are
posted before their data arrives, straight into the cache when the
destination blocks are consecutive, else into a staging buffer that one
`index_copy_` per layer scatters. A coalesced chunk (few blocks: see
chunks.py) is one message into staging. Any failure discards the pair (aborting
its pending receives), and the next pull connects a fresh one; when the
server has discarded an idle pair, the pull itself reconnects once.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist
import xxhash

from engine.kv_cache import KVCache
from kv_transfer.chunks import (ChunkSpec, cache_views, chunk_shape, coalesced, host_bytes, plan_chunks,
                                segments, staging_buffer, write_chunk)
from kv_transfer.client_base import KVClientBase, LayerProgress, OnLayers, transfer_error
from kv_transfer.dist_group import (RECEIVER_RANK, SENDER_RANK, abort_group, local_address_toward, open_store,
                                    pair_group)
from kv_transfer.failures import failure_reason
from kv_transfer.handle import KVChecksumError, KVHandle, KVTransferError, PullStats
from kv_transfer.wire import layout_to_proto
from protos import kv_transfer_pb2 as pb

# Receives are posted ahead of their headers up to this much staging memory;
# receives straight into the cache cost none, so consecutive blocks post all at once.
STAGING_WINDOW_BYTES = 64 << 20


class _PairGone(Exception):
    """The server no longer knows our pair (it discards idle ones)."""


@dataclass(slots=True)
class _Pair:
    pair_id: str
    group: dist.ProcessGroup
    store: dist.TCPStore
    lock: threading.Lock = field(default_factory=threading.Lock)


@dataclass(slots=True)
class _Posted:
    spec: ChunkSpec
    block_ids: list[int]
    buffers: list[torch.Tensor]
    staging: torch.Tensor | None
    works: list[dist.Work]


class _Receives:
    """Posts the receives of a pull's chunks in plan order, ahead of their headers."""

    def __init__(self, group: dist.ProcessGroup, cache: KVCache, plan: list[ChunkSpec], dst_block_ids: list[int]):
        self.group, self.cache = group, cache
        self.plan = deque(plan)
        self.dst_block_ids = dst_block_ids
        self.posted: deque[_Posted] = deque()
        self.spare: list[torch.Tensor] = []  # landed chunks' staging, reused so that no page is touched fresh
        self.tag = self.staged = 0
        self.post_ahead()

    def post_ahead(self) -> None:
        while self.plan and (not self.posted or self.staged < STAGING_WINDOW_BYTES):
            spec = self.plan.popleft()
            ids = self.dst_block_ids[spec.block_start:spec.block_end]
            one_buffer = coalesced(self.cache.layout, spec)  # the sender decides the same way
            views = None if one_buffer else cache_views(self.cache, ids, spec)
            staging = None if views is not None else self._staging(spec)
            buffers = views if views is not None else [staging] if one_buffer else segments(staging)
            works = [self.group.recv([b], SENDER_RANK, self.tag + i) for i, b in enumerate(buffers)]
            self.tag += len(buffers)
            self.staged += 0 if staging is None else spec.num_bytes(self.cache.layout)
            self.posted.append(_Posted(spec, ids, buffers, staging, works))

    def take(self, spec: ChunkSpec, checksum: bool) -> tuple[_Posted, int | None]:
        """The next chunk once its data is in, which must be `spec`, and its XXH3-64 if asked for.

        Each segment is hashed as soon as it lands, while it is still in cache.
        """
        chunk = self.posted.popleft() if self.posted else None
        if chunk is None or chunk.spec != spec:
            raise KVTransferError(f"unexpected chunk {spec}")
        digest = xxhash.xxh3_64() if checksum else None
        for work, buffer in zip(chunk.works, chunk.buffers):
            work.wait()
            if digest is not None:
                digest.update(host_bytes(buffer))
        return chunk, None if digest is None else digest.intdigest()

    def land(self, chunk: _Posted) -> None:
        """Move a verified chunk into the cache (if it went through staging) and post more receives."""
        if chunk.staging is not None:
            write_chunk(self.cache, chunk.block_ids, chunk.spec, chunk.staging)
            self.staged -= chunk.spec.num_bytes(self.cache.layout)
            self.spare.append(chunk.staging)
        self.post_ahead()

    def _staging(self, spec: ChunkSpec) -> torch.Tensor:
        shape = chunk_shape(self.cache.layout, spec)
        for i, buffer in enumerate(self.spare):
            if buffer.shape == shape:
                return self.spare.pop(i)
        return staging_buffer(self.cache, spec)

    @property
    def done(self) -> bool:
        return not self.plan and not self.posted


class DistKVClient(KVClientBase):
    """Pulls leased KV blocks over a process group per prefill server (Gloo on CPU, NCCL on CUDA)."""

    def __init__(self, cache: KVCache, token: str, **options):
        super().__init__(cache, token, **options)
        self.device = cache.k[0].device
        self._pairs: dict[str, _Pair] = {}

    def pull(self, handle: KVHandle, dst_block_ids: list[int], indices: list[int],
             on_layers: OnLayers | None = None) -> PullStats:
        """Same contract as GrpcKVClient.pull."""
        request = self.pull_request(handle, dst_block_ids, indices)
        start = time.perf_counter()
        for attempt in range(2):
            pair = self._pair(handle)
            with pair.lock:
                request.pair_id = pair.pair_id
                try:
                    num_bytes, num_chunks = self._pull_over(pair.group, handle, request, dst_block_ids, on_layers)
                    return PullStats(num_bytes, num_chunks, time.perf_counter() - start)
                except _PairGone:
                    self._drop(handle.address, pair)
                    if attempt == 1:
                        raise KVTransferError(f"KV pull of {handle.request_id!r}: the server keeps "
                                              "discarding our process group", "peer_gone") from None
                except BaseException:
                    self._drop(handle.address, pair)
                    raise

    def _pull_over(self, group: dist.ProcessGroup, handle: KVHandle, request: pb.PullRequest,
                   dst_block_ids: list[int], on_layers: OnLayers | None) -> tuple[int, int]:
        plan = plan_chunks(self.cache.layout, len(dst_block_ids), request.layer_start, request.layer_end,
                           request.max_chunk_bytes)
        progress = LayerProgress(request.layer_start, request.layer_end, len(dst_block_ids), on_layers)
        # Start the call first: the server opens the lease and gathers while we post the receives.
        call = self.stub(handle.address).PullDist(request, **self.call_options())
        num_bytes = 0
        try:
            try:
                receives = _Receives(group, self.cache, plan, dst_block_ids)
            except RuntimeError:  # the group broke while idle (the server discarded it); nothing landed yet
                raise _PairGone from None
            for header in call:
                # The server's KVServerConfig.dist_checksums decides whether there is a checksum.
                chunk, checksum = receives.take(ChunkSpec(header.layer_start, header.layer_end, header.block_start,
                                                          header.block_end), header.HasField("xxh3_64"))
                if checksum != (header.xxh3_64 if header.HasField("xxh3_64") else None):
                    raise KVChecksumError(f"chunk {chunk.spec} failed its XXH3-64 checksum")
                receives.land(chunk)
                num_bytes += header.num_bytes
                progress.done(chunk.spec)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.ABORTED and num_bytes == 0:
                raise _PairGone from None  # discarded by the server (idle): nothing landed, so connect again
            raise transfer_error(err, handle.request_id) from None
        except KVTransferError as err:
            raise type(err)(f"KV pull of {handle.request_id!r}: {err}", err.reason) from None
        except RuntimeError as err:  # from the process group: the peer is gone or timed out
            raise KVTransferError(f"KV pull of {handle.request_id!r}: receive failed: {err}",
                                  failure_reason(err)) from None
        finally:
            call.cancel()  # stops the server if we failed; nothing once the call has ended
        if not receives.done or not progress.complete:
            raise KVTransferError(f"KV pull of {handle.request_id!r} ended after {num_bytes} bytes")
        return num_bytes, len(plan)

    def _pair(self, handle: KVHandle) -> _Pair:
        """The process group with `handle`'s server, connected on first use."""
        with self._lock:
            pair = self._pairs.get(handle.address)
        if pair is not None:
            return pair
        pair_id = uuid.uuid4().hex
        stub = self.stub(handle.address)
        try:
            reply = stub.Connect(pb.ConnectRequest(pair_id=pair_id, layout=layout_to_proto(self.cache.layout)),
                                 **self.call_options())
        except grpc.RpcError as err:
            raise transfer_error(err, handle.request_id) from None
        timeout_s = reply.timeout_ms / 1000
        try:
            store = open_store(reply.store_host, reply.store_port, False, timeout_s)
            group = pair_group(reply.backend, store, pair_id, RECEIVER_RANK, timeout_s,
                               local_address_toward(reply.store_host), self.device)
        except (RuntimeError, OSError) as err:
            self._disconnect(handle.address, pair_id)
            raise KVTransferError(f"could not join a process group with {handle.address}: {err}",
                                  failure_reason(err)) from None
        pair = _Pair(pair_id, group, store)
        with self._lock:
            self._pairs[handle.address] = pair
        return pair

    def _drop(self, address: str, pair: _Pair) -> None:
        abort_group(pair.group)
        with self._lock:
            if self._pairs.get(address) is pair:
                del self._pairs[address]
        self._disconnect(address, pair.pair_id)

    def _disconnect(self, address: str, pair_id: str) -> None:
        try:
            self.stub(address).Disconnect(pb.DisconnectRequest(pair_id=pair_id), **self.call_options())
        except grpc.RpcError:
            pass  # the server may be gone, which is often why we disconnect

    def close(self) -> None:
        with self._lock:
            pairs = list(self._pairs.items())
        for address, pair in pairs:
            self._drop(address, pair)
        super().close()
