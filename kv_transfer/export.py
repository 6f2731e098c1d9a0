"""What both data planes of the KV export server share: a pull checked and pinned to its lease, its chunk
plan, each chunk read out of the cache and described by a header.

server.py streams the chunks over gRPC; dist_server.py sends their payloads over a torch.distributed pair
and streams only the headers.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
import torch

from engine.kv_cache import KVCache
from kv_transfer.chunks import MIN_CHUNK_BYTES, ChunkSpec, payload_checksum, plan_chunks, read_chunk
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.server_config import MAX_ID_CHARS, KVServerConfig
from kv_transfer.wire import layout_from_proto
from protos import kv_transfer_pb2 as pb


@dataclass(slots=True)
class ServerStats:
    """Payload bytes and chunks sent since start, over both data planes."""
    bytes_sent: int = 0
    chunks_sent: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_sent += num_bytes
            self.chunks_sent += 1


class KVExport:
    """Reads the leased blocks of `cache` out for pulls, one chunk at a time, counting what it sends."""

    def __init__(self, cache: KVCache, config: KVServerConfig, leases: LeaseTable):
        self.cache = cache
        self.config = config
        self.leases = leases
        self.stats = ServerStats()

    def export_chunk(self, block_ids: list[int], spec: ChunkSpec, to_host: bool) -> list[torch.Tensor]:
        """A chunk's payload segments (K, V per layer): cache views when possible, on the host if asked."""
        segments = read_chunk(self.cache, block_ids, spec)
        return [s.cpu() for s in segments] if to_host else segments

    def chunk_header(self, spec: ChunkSpec, segments: list[torch.Tensor], checksum: bool) -> pb.ChunkHeader:
        """The chunk's header, with the payload's XXH3-64 if asked for and the payload is on the host."""
        header = pb.ChunkHeader(layer_start=spec.layer_start, layer_end=spec.layer_end,
                                block_start=spec.block_start, block_end=spec.block_end,
                                num_bytes=spec.num_bytes(self.cache.layout))
        if checksum and segments[0].device.type == "cpu":
            header.xxh3_64 = payload_checksum(segments)
        self.stats.add(header.num_bytes)
        return header

    def open_pull(self, request: pb.PullRequest,
                  context: grpc.ServicerContext) -> tuple[Lease, list[int], str | None]:
        """Check a pull and pin its lease; aborts the call with a precise status when it is refused.
        Also returns the fault to inject into this pull (tests only; None)."""
        self.check_pull(request, context)
        fault = self.config.faults.pick() if self.config.faults is not None else None
        if fault == "expire":
            self.leases.release(request.request_id)
        lease = self.leases.begin_pull(request.request_id)
        if lease is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no KV lease for request {request.request_id!r}")
        if request.block_indices and max(request.block_indices) >= len(lease.block_ids):
            self.leases.end_pull(lease)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"block_indices: index beyond the request's {len(lease.block_ids)} blocks")
        return lease, [lease.block_ids[i] for i in request.block_indices], fault

    def check_pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> None:
        """Refuse, with INVALID_ARGUMENT naming the field, a pull whose plan could exceed what its lease
        holds (duplicate or too many block indices, tiny chunks) or that is malformed otherwise."""
        if layout_from_proto(request.layout) != self.cache.layout:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"KV layout mismatch: server has {self.cache.layout}, "
                          f"client has {layout_from_proto(request.layout)}")
        max_chunk = self.config.max_message_bytes - (64 << 10)
        problems = [
            ("request_id", not 0 < len(request.request_id) <= MAX_ID_CHARS, f"1 to {MAX_ID_CHARS} characters"),
            ("pair_id", len(request.pair_id) > MAX_ID_CHARS, f"at most {MAX_ID_CHARS} characters"),
            ("layer_start, layer_end", not 0 <= request.layer_start < request.layer_end <= self.cache.layout.num_layers,
             f"a layer range within [0, {self.cache.layout.num_layers}]"),
            ("max_chunk_bytes", not MIN_CHUNK_BYTES <= request.max_chunk_bytes <= max_chunk,
             f"in [{MIN_CHUNK_BYTES}, {max_chunk}]"),
            ("block_indices", len(request.block_indices) > self.config.max_blocks_per_pull,
             f"at most {self.config.max_blocks_per_pull} per pull"),
            ("block_indices", len(set(request.block_indices)) != len(request.block_indices), "without duplicates"),
        ]
        for name, bad, rule in problems:
            if bad:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{name} must be {rule}")

    def chunk_plan(self, lease: Lease, num_blocks: int, request: pb.PullRequest,
                   context: grpc.ServicerContext) -> tuple[list[ChunkSpec], Callable[[ChunkSpec], None]]:
        """The pull's chunks in send order, and a function that blocks until a chunk's layers are ready
        (aborting the call when the lease goes away or the deadline passes first)."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else self.config.lease_ttl_s)
        context.add_callback(self.leases.wake)

        def wait_ready(spec: ChunkSpec) -> None:
            if not self.leases.wait_layers(lease, spec.layer_end, deadline, context.is_active):
                if lease.released:
                    context.abort(grpc.StatusCode.NOT_FOUND, f"lease of {request.request_id!r} was released")
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "KV layers were not ready in time")

        plan = plan_chunks(self.cache.layout, num_blocks, request.layer_start, request.layer_end,
                           request.max_chunk_bytes)
        return plan, wait_ready

    def chunks(self, lease: Lease, block_ids: list[int], request: pb.PullRequest,
               context: grpc.ServicerContext, to_host: bool) -> Iterator[tuple[ChunkSpec, list[torch.Tensor]]]:
        """Export the pull's chunks in plan order, each once the producer has marked its layers ready."""
        plan, wait_ready = self.chunk_plan(lease, len(block_ids), request, context)
        for spec in plan:
            wait_ready(spec)
            yield spec, self.export_chunk(block_ids[spec.block_start:spec.block_end], spec, to_host)
