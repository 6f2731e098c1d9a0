"""The prefill side of the torch.distributed data plane.

A decode client calls Connect with a fresh pair id; we start joining a
two-rank group over our TCPStore in the background (rank 0) and answer at
once with the store's address, so the client can join as rank 1. PullDist
then posts each chunk's K/V segments as point-to-point sends, straight from
the cache when its blocks are consecutive, and streams the chunk's header
over gRPC while they go out. Any failure on a group (peer gone, timeout)
discards the pair; the client reconnects with a new one. A client that
vanishes without Disconnect leaves a pair nobody pulls on: pairs idle for
longer than `idle_s` (and groups that never joined) are discarded too, so
their Gloo threads and sockets do not pile up.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
import torch.distributed as dist

from kv_transfer.chunks import ChunkSpec
from kv_transfer.dist_group import RECEIVER_RANK, SENDER_RANK, abort_group, backend_for, host_store, pair_group
from kv_transfer.export import KVExport
from kv_transfer.faults import corrupted, fail_mid_pull
from kv_transfer.lease import Lease
from protos import kv_transfer_pb2 as pb

logger = logging.getLogger(__name__)

# Gathered payload in flight per pull (sends straight from cache views cost no memory and are not held back).
# Gathered chunks sit in staging buffers that the gRPC handler thread allocates from its own malloc arena,
# whose heaps are at most 64 MiB: a window that fits one heap keeps freed buffers mapped, where a 64 MiB
# window had glibc unmap and re-fault them (~20 ms CPU per 94 MB pull).
SEND_WINDOW_BYTES = 24 << 20


@dataclass(slots=True)
class _Pair:
    group: futures.Future  # of dist.ProcessGroup, joined in the background
    sender: futures.ThreadPoolExecutor  # posts the pair's sends, one pull at a time
    lock: threading.Lock = field(default_factory=threading.Lock)  # held by the pull in progress
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False

    def failed(self) -> bool:
        return self.group.done() and self.group.exception() is not None


_Chunk = tuple[ChunkSpec, list[torch.Tensor]]  # a chunk's spec and its payload segments


class _Sends:
    """A pull's point-to-point sends, posted in plan order on the pair's send thread.

    Gloo writes a send's bytes in the thread that posts it, so posting them
    elsewhere lets the gRPC handler checksum a chunk and stream its header
    while the chunk's bytes are on their way.
    """

    def __init__(self, group: dist.ProcessGroup, thread: futures.ThreadPoolExecutor):
        self.group, self.thread = group, thread
        self.pending: deque[tuple[futures.Future, int]] = deque()
        self.tag = self.in_flight = 0

    def post(self, batch: list[_Chunk], staged: int) -> None:
        """Post the sends of a batch of chunks, in one hand-off to the send thread; `staged` of their bytes
        are gathered copies (the rest are views of the cache), and count toward the window."""
        segments = [s for _, chunk in batch for s in chunk]
        self.pending.append((self.thread.submit(self._send, segments, self.tag), staged))
        self.tag, self.in_flight = self.tag + len(segments), self.in_flight + staged

    def _send(self, segments: list[torch.Tensor], tag: int) -> list[dist.Work]:
        return [self.group.send([s], RECEIVER_RANK, tag + i) for i, s in enumerate(segments)]

    def wait_below(self, limit: int) -> None:
        """Wait for the oldest sends until at most `limit` staged bytes are in flight (all sends if negative)."""
        while self.pending and self.in_flight > limit:
            posted, size = self.pending.popleft()
            for work in posted.result():
                work.wait()
            self.in_flight -= size

    def stop(self) -> None:
        """After the group was aborted: drop the sends not posted yet, wait out the one being posted."""
        for posted, _ in self.pending:
            posted.cancel()
        futures.wait([posted for posted, _ in self.pending])
        self.pending.clear()


class DistSender:
    """Process groups with connected decode clients, and the PullDist send loop."""

    def __init__(self, export: KVExport, host: str, bind_host: str, timeout_s: float, idle_s: float):
        self.export = export
        self.device = export.cache.k[0].device
        self.backend = backend_for(self.device)
        self.host = host  # advertised: in every ConnectResponse, and our Gloo device's address
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self.store = host_store(host, bind_host, timeout_s)
        self._pairs: dict[str, _Pair] = {}
        self._lock = threading.Lock()
        self._joiner = futures.ThreadPoolExecutor(4, "kv-pair-join")
        self._closed = threading.Event()
        self._reaper = threading.Thread(target=self._reap, name="kv-pair-reaper", daemon=True)
        self._reaper.start()

    @property
    def num_pairs(self) -> int:
        """Connected decode clients (process groups joined or joining)."""
        with self._lock:
            return len(self._pairs)

    def connect(self, pair_id: str) -> pb.ConnectResponse:
        self.disconnect(pair_id)
        pair = _Pair(self._joiner.submit(pair_group, self.backend, self.store, pair_id, SENDER_RANK,
                                         self.timeout_s, self.host, self.device),
                     futures.ThreadPoolExecutor(1, "kv-dist-send"))
        with self._lock:
            self._pairs[pair_id] = pair
        return pb.ConnectResponse(store_host=self.host, store_port=self.store.port, backend=self.backend,
                                  timeout_ms=int(self.timeout_s * 1000))

    def disconnect(self, pair_id: str) -> None:
        with self._lock:
            pair = self._pairs.pop(pair_id, None)
        if pair is not None:
            pair.closed = True
            pair.sender.shutdown(wait=False)
            pair.group.add_done_callback(lambda f: f.exception() is None and abort_group(f.result()))

    def close(self) -> None:
        self._closed.set()
        self._reaper.join()
        with self._lock:
            pair_ids = list(self._pairs)
        for pair_id in pair_ids:
            self.disconnect(pair_id)
        self._joiner.shutdown(wait=False, cancel_futures=True)

    def _reap(self) -> None:
        while not self._closed.wait(min(self.idle_s / 2, 10.0)):
            self._discard_stale_pairs()

    def _discard_stale_pairs(self) -> None:
        """Discard pairs whose group never joined, and idle ones whose client may be gone."""
        with self._lock:
            pairs = list(self._pairs.items())
        for pair_id, pair in pairs:
            if pair.failed() or self._close_if_idle(pair):
                logger.info("discarding KV pair %s: its group failed or it saw no pull for %.0f s",
                            pair_id, self.idle_s)
                self.disconnect(pair_id)

    def _close_if_idle(self, pair: _Pair) -> bool:
        if not pair.lock.acquire(blocking=False):
            return False  # a pull is running
        try:
            pair.closed = time.monotonic() - pair.last_used > self.idle_s
            return pair.closed
        finally:
            pair.lock.release()

    def _ready_batches(self, lease: Lease, block_ids: list[int], request: pb.PullRequest,
                       context: grpc.ServicerContext) -> Iterator[tuple[list[_Chunk], int]]:
        """The pull's exported chunks in plan order, in batches, each with its gathered (staged) bytes.

        A batch holds every chunk whose layers are ready, up to half the send window of gathered bytes
        (sends straight from cache views cost no memory). Posting a batch in one hand-off lets the send
        thread write back to back: a whole pull of consecutive blocks, once prefill is done.
        """
        plan, wait_ready = self.export.chunk_plan(lease, len(block_ids), request, context)
        cache = self.export.cache.kv.untyped_storage().data_ptr()
        i = 0
        while i < len(plan):
            wait_ready(plan[i])
            batch, staged = [], 0
            while i < len(plan) and lease.layers_ready >= plan[i].layer_end and staged < SEND_WINDOW_BYTES // 2:
                spec = plan[i]
                segments = self.export.export_chunk(block_ids[spec.block_start:spec.block_end], spec, False)
                batch.append((spec, segments))
                if segments[0].untyped_storage().data_ptr() != cache:
                    staged += sum(s.numel() * s.element_size() for s in segments)
                i += 1
            yield batch, staged

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
        checksum = self.export.config.dist_checksums
        with pair.lock:
            if pair.closed:  # discarded while we waited for it: the client reconnects
                context.abort(grpc.StatusCode.ABORTED, f"pair {request.pair_id!r} is not connected")
            lease, block_ids, fault = self.export.open_pull(request, context)
            sends, finished = _Sends(group, pair.sender), False
            try:
                for batch, staged in self._ready_batches(lease, block_ids, request, context):
                    if fault == "corrupt":  # sent with a bit flipped, checksummed as it was
                        (spec, segments), fault = batch[0], None
                        sends.post([(spec, corrupted(segments)), *batch[1:]], staged)
                    else:
                        sends.post(batch, staged)
                    for spec, segments in batch:
                        yield self.export.chunk_header(spec, segments, checksum)  # hashed while the bytes go out
                    sends.wait_below(SEND_WINDOW_BYTES // 2)
                    if fault in ("stall", "drop"):
                        sends.wait_below(-1)
                        if fault == "drop":  # the data connection breaks under the receiver
                            abort_group(group)
                        fail_mid_pull(fault, context)
                        return
                sends.wait_below(-1)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the blocks may be reused once the lease ends
                finished = True
            except RuntimeError as err:
                logger.warning("KV send to pair %s failed: %s", request.pair_id, err)
                context.abort(grpc.StatusCode.UNAVAILABLE, f"torch.distributed send failed: {err}")
            finally:
                if not finished:  # failed or cancelled: fail the sends still reading our blocks, give up the pair
                    abort_group(group)
                    sends.stop()
                    self.disconnect(request.pair_id)
                pair.last_used = time.monotonic()
                self.export.leases.end_pull(lease)
