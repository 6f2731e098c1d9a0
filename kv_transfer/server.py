"""The KV export server in a prefill worker: a lease table behind an authenticated gRPC service.

Pull streams chunks over gRPC; PullDist streams only their headers and sends
the payloads over the pair's torch.distributed group (see dist_server.py).
Handlers run on a bounded thread pool, and calls beyond its capacity are
refused with RESOURCE_EXHAUSTED instead of queueing without limit.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch
from google.protobuf.message import DecodeError

from worker_runtime.auth import bearer_token, token_matches
from engine.kv_cache import KVCache
from kv_transfer.config import TLSFiles
from kv_transfer.addresses import check_host, host_port
from kv_transfer.chunks import MIN_CHUNK_BYTES, ChunkSpec, host_bytes, payload_checksum, plan_chunks, read_chunk
from kv_transfer.dist_server import DistSender
from kv_transfer.faults import FaultInjector, corrupted, fail_mid_pull
from kv_transfer.handle import KVHandle
from kv_transfer.lease import Lease, LeaseTable, OnRelease
from kv_transfer.tls import server_credentials
from kv_transfer.malloc import keep_message_buffers_in_heap
from kv_transfer.shm import source as shm_source
from kv_transfer.wire import SERVICE, encode_chunk, layout_from_proto, layout_to_proto
from protos import kv_transfer_pb2 as pb

@dataclass(slots=True)
class KVServerConfig:
    """Where the server listens and how much it accepts; `dist` adds the torch.distributed data plane.

    `advertise_host` goes into every handle (and the TCPStore's address into every ConnectResponse), so it
    must be an address decode workers can reach; `bind_host` (default: the advertised address) is where the
    gRPC server and the TCPStore listen. A prefill worker resolves both on its node (addresses.py).

    gRPC chunks always carry a checksum. Over torch.distributed, host payloads
    carry one unless `dist_checksums` is off (TCP already checks the bytes;
    hashing them costs about a fifth of Gloo's throughput on a 2-core box);
    device payloads (NCCL) never do. A decode client's process group that
    sees no pull for `dist_pair_idle_s` is discarded (the client reconnects).

    What a caller may ask for is bounded, so that no request can make the server plan or hold more than
    its lease: requests are at most `max_request_bytes`, a pull names at most `max_blocks_per_pull`
    distinct block indices, and chunks are at least MIN_CHUNK_BYTES. `faults` is for tests only
    (faults.py); by default it comes from TANDEM_KV_FAULTS, unset in production.
    """
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    port: int = 0
    max_workers: int = 16
    max_message_bytes: int = 16 << 20
    max_request_bytes: int = 1 << 20
    max_blocks_per_pull: int = 1 << 16
    lease_ttl_s: float = 30.0
    dist: bool = False
    dist_timeout_s: float = 30.0
    dist_checksums: bool = True
    dist_pair_idle_s: float = 600.0
    tls: TLSFiles | None = None  # serve TLS only (kv_transfer/tls.py)
    # Handles name the cache's memfd when it has one (a CPU prefill worker's): a decode worker on the same
    # host copies from it (kv_transfer/shm.py). Off with torch_dist, and while faults are injected, which
    # act on the network path.
    shared_memory: bool = True
    faults: FaultInjector | None = field(default_factory=FaultInjector.from_env)


MAX_ID_CHARS = 256  # request and pair ids; theirs are uuid-sized


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


class _BearerTokenAuth(grpc.ServerInterceptor):
    """Refuses every call whose `authorization` metadata is not `Bearer <token>` (constant-time compare)."""

    def __init__(self, token: str):
        self._token = token

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        given = bearer_token(dict(details.invocation_metadata).get("authorization"))
        if handler is None or token_matches(given, self._token):
            return handler

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid KV transfer token")

        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny, handler.request_deserializer)
        return grpc.unary_unary_rpc_method_handler(deny, handler.request_deserializer)


class KVTransferServer:
    """Serves the leased KV blocks of `cache` to decode workers that present `token`."""

    def __init__(self, cache: KVCache, token: str, config: KVServerConfig | None = None):
        if not token:
            raise ValueError("a KV transfer server needs a non-empty shared token")
        self.cache = cache
        self.config = config or KVServerConfig()
        self.leases = LeaseTable(cache.layout.num_layers, self.config.lease_ttl_s)
        self.stats = ServerStats()
        self._layout_proto = layout_to_proto(cache.layout)
        keep_message_buffers_in_heap(self.config.max_message_bytes)
        limits = [("grpc.max_send_message_length", self.config.max_message_bytes),
                  ("grpc.max_receive_message_length", self.config.max_request_bytes)]
        self._server = grpc.server(futures.ThreadPoolExecutor(self.config.max_workers, "kv-export"),
                                   interceptors=[_BearerTokenAuth(token)], options=limits,
                                   maximum_concurrent_rpcs=self.config.max_workers)
        self._server.add_generic_rpc_handlers([self._handlers()])
        advertise = check_host(self.config.advertise_host, "advertise_host", wildcard_ok=False)
        bind = check_host(self.config.bind_host or advertise, "bind_host", wildcard_ok=True)
        try:
            target = host_port(bind, self.config.port)
            self.port = (self._server.add_secure_port(target, server_credentials(self.config.tls)) if self.config.tls
                         else self._server.add_insecure_port(target))
        except RuntimeError as err:  # e.g. an address that is not this host's
            raise OSError(f"the KV transfer server cannot listen on {host_port(bind, self.config.port)} "
                          f"(transfer.bind_host / TANDEM_KV_BIND_HOST): {err}") from None
        self.address = host_port(advertise, self.port)
        self.dist = DistSender(self, advertise, bind, self.config.dist_timeout_s,
                               self.config.dist_pair_idle_s) if self.config.dist else None

    def start(self) -> KVTransferServer:
        self._server.start()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Stop serving, then release every lease (running `on_release` for each)."""
        self._server.stop(grace).wait()
        if self.dist is not None:
            self.dist.close()
        self.leases.close()

    def lease(self, request_id: str, block_ids: list[int], block_hashes: list[int], num_tokens: int,
              on_release: OnRelease, ttl: float | None = None, layers_ready: int | None = None) -> KVHandle:
        """Pin a prefilled request's blocks for decode to pull; returns the handle to pass to decode."""
        if len(block_ids) != -(-num_tokens // self.cache.layout.block_size):
            raise ValueError(f"{len(block_ids)} blocks do not hold exactly {num_tokens} tokens")
        if len(block_hashes) > len(block_ids):
            raise ValueError("more block hashes than blocks")
        self.leases.add(request_id, block_ids, block_hashes, num_tokens, on_release, ttl, layers_ready)
        # A layer-wise lease (layers_ready given) is pulled while the forward still writes it: network only.
        shared = self.config.shared_memory and not self.dist and self.config.faults is None and (
            layers_ready is None or layers_ready >= self.cache.layout.num_layers)
        shm = shm_source(self.cache, block_ids) if shared else None
        return KVHandle("torch_dist" if self.dist else "grpc", self.address, request_id, num_tokens,
                        tuple(block_hashes), self.cache.layout, shm)

    def mark_layers_ready(self, request_id: str, num_layers_ready: int) -> None:
        """Layer-wise prefill: layers [0, num_layers_ready) may be streamed now.

        On CUDA, call it once those layers' writes have completed (their stream synchronized).
        """
        self.leases.mark_layers_ready(request_id, num_layers_ready)

    def release(self, request_id: str) -> bool:
        """End a lease from the prefill side (abort); False if it was already gone."""
        return self.leases.release(request_id)

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

    def _pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        lease, block_ids, fault = self.open_pull(request, context)
        try:
            for spec, segments in self.chunks(lease, block_ids, request, context, to_host=True):
                header = self.chunk_header(spec, segments, checksum=True)
                if fault == "corrupt":
                    segments, fault = corrupted(segments), None
                yield encode_chunk(header, [host_bytes(s) for s in segments])
                if fault in ("stall", "drop"):
                    fail_mid_pull(fault, context)
                    return
        finally:
            self.leases.end_pull(lease)

    def _pull_dist(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[pb.ChunkHeader]:
        if self.dist is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no torch.distributed data plane")
        yield from self.dist.serve_pull(request, context)

    def _release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        return pb.ReleaseResponse(released=self.leases.release(request.request_id))

    def _health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        backend = self.dist.backend if self.dist else ""
        return pb.HealthResponse(layout=self._layout_proto, num_leases=len(self.leases), dist_backend=backend)

    def _connect(self, request: pb.ConnectRequest, context) -> pb.ConnectResponse:
        if self.dist is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this server has no torch.distributed data plane")
        if not 0 < len(request.pair_id) <= MAX_ID_CHARS:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"pair_id must be 1 to {MAX_ID_CHARS} characters")
        if layout_from_proto(request.layout) != self.cache.layout:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"KV layout mismatch: server has {self.cache.layout}")
        return self.dist.connect(request.pair_id)

    def _disconnect(self, request: pb.DisconnectRequest, context) -> pb.DisconnectResponse:
        if self.dist is not None:
            self.dist.disconnect(request.pair_id)
        return pb.DisconnectResponse()

    def _handlers(self) -> grpc.GenericRpcHandler:
        def unary(fn, request_type):
            return grpc.unary_unary_rpc_method_handler(_parsed(fn), _parser(request_type),
                                                       lambda m: m.SerializeToString())

        return grpc.method_handlers_generic_handler(SERVICE, {
            # Pull's handler yields pre-encoded KVChunk bytes (see wire.py), hence no serializer.
            "Pull": grpc.unary_stream_rpc_method_handler(_parsed(self._pull), _parser(pb.PullRequest), None),
            "PullDist": grpc.unary_stream_rpc_method_handler(
                _parsed(self._pull_dist), _parser(pb.PullRequest), pb.ChunkHeader.SerializeToString),
            "Release": unary(self._release, pb.ReleaseRequest),
            "Health": unary(self._health, pb.HealthRequest),
            "Connect": unary(self._connect, pb.ConnectRequest),
            "Disconnect": unary(self._disconnect, pb.DisconnectRequest),
        })


@dataclass(slots=True)
class _Malformed:
    """A request whose bytes did not parse; its handler answers INVALID_ARGUMENT (gRPC's own answer to a
    deserializer that raises is INTERNAL, which reads like a server bug)."""
    detail: str


def _parser(request_type):
    def parse(data: bytes):
        try:
            return request_type.FromString(data)
        except DecodeError as err:
            return _Malformed(f"malformed {request_type.DESCRIPTOR.name}: {err}")
    return parse


def _parsed(handler):
    def checked(request, context):
        if isinstance(request, _Malformed):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.detail)
        return handler(request, context)
    return checked
