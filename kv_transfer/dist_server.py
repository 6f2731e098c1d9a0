"""The prefill side of the torch.distributed data plane.

A decode client calls Connect with a fresh pair id; we start joining a
two-rank group over our TCPStore in the background (rank 0) and answer at
once with the store's address, so the client can join as rank 1. PullDist
then streams each chunk's header over gRPC, followed by the chunk's K/V
segments sent point-to-point, straight from the cache when its blocks are
consecutive. Any failure on a group (peer gone, timeout) discards the pair;
the client reconnects with a new one.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc
import torch
import torch.distributed as dist

from kv_transfer.dist_group import RECEIVER_RANK, SENDER_RANK, abort_group, backend_for, open_store, pair_group
from protos import kv_transfer_pb2 as pb

if TYPE_CHECKING:
    from kv_transfer.server import KVTransferServer

logger = logging.getLogger(__name__)

SEND_WINDOW_BYTES = 64 << 20  # payload in flight per pull (it may sit in staging buffers)


@dataclass(slots=True)
class _Pair:
    group: futures.Future  # of dist.ProcessGroup, joined in the background
    lock: threading.Lock = field(default_factory=threading.Lock)


class DistSender:
    """Process groups with connected decode clients, and the PullDist send loop."""

    def __init__(self, server: KVTransferServer, host: str, timeout_s: float):
        self.server = server
        self.device = server.cache.k[0].device
        self.backend = backend_for(self.device)
        self.host = host
        self.timeout_s = timeout_s
        self.store = open_store(host, 0, True, timeout_s)
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._joiner = futures.ThreadPoolExecutor(4, "kv-pair-join")

    def connect(self, pair_id: str) -> pb.ConnectResponse:
        self.disconnect(pair_id)
        pair = _Pair(self._joiner.submit(pair_group, self.backend, self.store, pair_id, SENDER_RANK,
                                         self.timeout_s, self.host, self.device))
        with self._lock:
            self._pairs[pair_id] = pair
        return pb.ConnectResponse(store_host=self.host, store_port=self.store.port, backend=self.backend,
                                  timeout_ms=int(self.timeout_s * 1000))

    def disconnect(self, pair_id: str) -> None:
        with self._lock:
            pair = self._pairs.pop(pair_id, None)
        if pair is not None:
            pair.group.add_done_callback(lambda f: f.exception() is None and abort_group(f.result()))

    def close(self) -> None:
        with self._lock:
            pair_ids = list(self._pairs)
        for pair_id in pair_ids:
            self.disconnect(pair_id)
        self._joiner.shutdown(wait=False, cancel_futures=True)

    def serve_pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.ChunkHeader]:
        with self._lock:
            pair = self._pairs.get(request.pair_id)
        if pair is None:
            context.abort(grpc.StatusCode.ABORTED, f"pair {request.pair_id!r} is not connected")
        try:
            group = pair.group.result(timeout=self.timeout_s)
        except Exception as err:
            self.disconnect(request.pair_id)
            context.abort(grpc.StatusCode.UNAVAILABLE, f"pair {request.pair_id!r} never joined: {err}")
        lease, block_ids = self.server.open_pull(request, context)
        pending: deque[tuple[dist.Work, int]] = deque()
        with pair.lock:
            try:
                tag = in_flight = 0
                for header, segments in self.server.chunks(lease, block_ids, request, context, to_host=False):
                    yield header
                    for segment in segments:
                        size = segment.numel() * segment.element_size()
                        pending.append((group.send([segment], RECEIVER_RANK, tag), size))
                        tag, in_flight = tag + 1, in_flight + size
                    while in_flight > SEND_WINDOW_BYTES:
                        work, size = pending.popleft()
                        work.wait()
                        in_flight -= size
                while pending:
                    pending.popleft()[0].wait()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the blocks may be reused once the lease ends
            except RuntimeError as err:
                logger.warning("KV send to pair %s failed: %s", request.pair_id, err)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"torch.distributed send failed: {err}")
            finally:
                if pending:  # stopped early: fail the sends still reading our blocks, then give up the pair
                    abort_group(group)
                    self.disconnect(request.pair_id)
                self.server.leases.end_pull(lease)
