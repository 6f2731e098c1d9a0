"""Pull KV blocks over gRPC: parallel streams of large, checksummed chunks written straight into the cache.

The requested blocks are split into up to `num_streams` contiguous groups,
each pulled by its own server-streaming call on its own TCP connection, so
encoding, the network and decoding overlap. Every stream delivers early
layers first, which lets `on_layers` report complete layers while later
ones are still on the way (or still being prefilled).

A stream keeps about one core busy at each end (Python gRPC copies every
message twice on each side, and both ends hash it), so the default is one
stream per four cores: on two cores a second stream only adds thread
hand-offs. Chunks are 2 MiB: smaller messages keep those copies in cache
and pipeline better (bench/HISTORY.md has the A/B runs).
"""
from __future__ import annotations

import logging
import os
import time
import warnings
from concurrent import futures

import grpc
import torch
import xxhash

from engine.kv_cache import KVCache
from kv_transfer.chunks import ChunkSpec, plan_chunks, write_chunk
from kv_transfer.client_base import KVClientBase, LayerProgress, OnLayers, transfer_error
from kv_transfer.handle import (KVChecksumError, KVHandle, KVLayoutMismatchError, KVLeaseNotFoundError, KVTransferError,
                               PullStats)
from kv_transfer.shm import SharedCaches
from kv_transfer.wire import SERVICE, decode_chunk
from protos import kv_transfer_pb2 as pb

# Payloads are read-only views of the received bytes, which torch warns about
# once per process; we only ever copy out of them, so spend that warning here.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)

logger = logging.getLogger(__name__)

MIN_STREAM_BYTES = 8 << 20


def default_num_streams() -> int:
    """One stream per four cores available to this process, from 1 to 4."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores // 4))


class GrpcKVClient(KVClientBase):
    """Pulls leased KV blocks from prefill workers' KV servers over gRPC."""

    default_chunk_bytes = 2 << 20

    def __init__(self, cache: KVCache, token: str, *, num_streams: int | None = None, shared_memory: bool = True,
                 **options):
        super().__init__(cache, token, **options)
        self.shared = SharedCaches(cache) if shared_memory else None
        self.shm_unavailable = 0  # same-host pulls that could not map the prefill worker's cache (went by network)
        self.num_streams = num_streams or default_num_streams()
        if self.num_streams < 1:
            raise ValueError("num_streams must be at least 1")
        self._pool = futures.ThreadPoolExecutor(4 * self.num_streams, "kv-pull")

    def pull(self, handle: KVHandle, dst_block_ids: list[int], indices: list[int],
             on_layers: OnLayers | None = None) -> PullStats:
        """Copy blocks `indices` of the handle's request into our blocks `dst_block_ids` (same order).

        Raises a KVTransferError subclass on any failure; the destination
        blocks then hold partial data and must not be registered. From a prefill worker on this host (and
        not layer-wise) the blocks are copied out of its shared cache and the lease is released here.
        """
        request = self.pull_request(handle, dst_block_ids, indices)
        if on_layers is None and self.shared is not None and self.shared.usable(handle.shm):
            stats = self._copy_shared(handle, dst_block_ids, indices)
            if stats is not None:
                return stats
        start = time.perf_counter()
        layout = self.cache.layout
        progress = LayerProgress(0, layout.num_layers, len(indices), on_layers)
        total = 2 * layout.num_layers * len(indices) * layout.bytes_per_block_per_layer
        streams = max(1, min(self.num_streams, len(indices), total // MIN_STREAM_BYTES))
        if streams == 1:  # on this thread: no hand-off for the common, small pull
            call = self._pull_method(handle.address, 0)(request, **self.call_options())
            try:
                num_bytes, num_chunks = self._consume(call, request, dst_block_ids, progress)
            except grpc.RpcError as err:
                raise transfer_error(err, handle.request_id) from None
            finally:
                call.cancel()  # stops the stream if we failed; nothing once it has ended
            return PullStats(num_bytes, num_chunks, time.perf_counter() - start)
        bounds = [len(indices) * i // streams for i in range(streams + 1)]
        calls, jobs = [], []
        for s, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            part = pb.PullRequest()
            part.CopyFrom(request)
            del part.block_indices[:]
            part.block_indices.extend(indices[lo:hi])
            calls.append(self._pull_method(handle.address, s)(part, **self.call_options()))
            jobs.append(self._pool.submit(self._consume, calls[-1], part, dst_block_ids[lo:hi], progress))
        futures.wait(jobs, return_when=futures.FIRST_EXCEPTION)
        for call in calls:  # a failed stream stops the others ...
            call.cancel()
        futures.wait(jobs)  # ... and none may still write into blocks the caller is about to free
        errors = [job.exception() for job in jobs if job.exception() is not None]
        first = next((e for e in errors if not _is_cancelled(e)), errors[0] if errors else None)
        if isinstance(first, grpc.RpcError):
            raise transfer_error(first, handle.request_id) from None
        if first is not None:
            raise first
        received = [job.result() for job in jobs]
        return PullStats(sum(b for b, _ in received), sum(c for _, c in received), time.perf_counter() - start)

    def _copy_shared(self, handle: KVHandle, dst_block_ids: list[int], indices: list[int]) -> PullStats | None:
        """Copy from the prefill worker's shared cache, then release the lease: the copy is good only if the
        lease still held the blocks when it ended. None (counted) when the cache cannot be mapped."""
        if handle.layout != self.cache.layout:
            raise KVLayoutMismatchError(f"KV pull of {handle.request_id!r}: the prefill worker's layout "
                                        f"{handle.layout} is not ours, {self.cache.layout}")
        start = time.perf_counter()
        try:
            num_bytes = self.shared.copy(handle.shm, indices, dst_block_ids)
        except OSError as err:  # another pod, /proc hidden, or the worker just died: the network path decides
            self.shared.forget(handle.shm)
            self.shm_unavailable += 1
            logger.warning("KV pull of %r: the prefill worker's shared cache cannot be mapped here (%s); "
                           "pulling over gRPC", handle.request_id, err)
            return None
        try:
            released = self.release(handle)
        except KVTransferError:  # the prefill worker is gone (or unreachable): its cache is of no further use
            self.shared.forget(handle.shm)
            raise
        if not released:
            raise KVLeaseNotFoundError(f"KV pull of {handle.request_id!r}: the lease ended during the copy")
        return PullStats(num_bytes, 1, time.perf_counter() - start, "shm")

    def _pull_method(self, address: str, stream: int):
        return self.channel(address, stream).unary_stream(
            f"/{SERVICE}/Pull", request_serializer=pb.PullRequest.SerializeToString,
            response_deserializer=decode_chunk)

    def _consume(self, call, request: pb.PullRequest, dst_block_ids: list[int],
                 progress: LayerProgress) -> tuple[int, int]:
        """Receive one stream's chunks in plan order, verify and write each; (bytes, chunks)."""
        cache = self.cache
        plan = plan_chunks(cache.layout, len(request.block_indices), request.layer_start,
                           request.layer_end, request.max_chunk_bytes)
        num_bytes = 0
        for i, (header, payload) in enumerate(call):
            spec = ChunkSpec(header.layer_start, header.layer_end, header.block_start, header.block_end)
            if i >= len(plan) or spec != plan[i] or len(payload) != spec.num_bytes(cache.layout):
                raise KVTransferError(f"KV pull of {request.request_id!r}: unexpected chunk {spec}")
            if not header.HasField("xxh3_64") or xxhash.xxh3_64_intdigest(payload) != header.xxh3_64:
                raise KVChecksumError(f"KV pull of {request.request_id!r}: chunk {spec} failed its checksum")
            write_chunk(cache, dst_block_ids[spec.block_start:spec.block_end], spec,
                        torch.frombuffer(payload, dtype=cache.k[0].dtype))
            num_bytes += len(payload)
            progress.done(spec)
        if num_bytes != sum(s.num_bytes(cache.layout) for s in plan):
            raise KVTransferError(f"KV pull of {request.request_id!r} ended after {num_bytes} bytes")
        return num_bytes, len(plan)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        super().close()


def _is_cancelled(err: BaseException) -> bool:
    return isinstance(err, grpc.RpcError) and err.code() == grpc.StatusCode.CANCELLED
