"""The KV export server in a prefill worker: a lease table behind an authenticated gRPC service.

Pull streams chunks over gRPC; PullDist streams only their headers and sends
the payloads over the pair's torch.distributed group (see dist_server.py);
both read them through one KVExport (export.py).
Handlers run on a bounded thread pool, and calls beyond its capacity are
refused with RESOURCE_EXHAUSTED instead of queueing without limit.
"""
from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from worker_runtime.auth import bearer_token, token_matches
from engine.kv_cache import KVCache
from kv_transfer.addresses import check_host, host_port
from kv_transfer.chunks import host_bytes
from kv_transfer.dist_server import DistSender
from kv_transfer.export import KVExport
from kv_transfer.faults import corrupted, fail_mid_pull
from kv_transfer.handle import KVHandle
from kv_transfer.lease import LeaseTable, OnRelease
from kv_transfer.server_config import MAX_ID_CHARS, KVServerConfig
from kv_transfer.tls import server_credentials
from kv_transfer.malloc import keep_message_buffers_in_heap
from kv_transfer.shm import source as shm_source
from kv_transfer.wire import SERVICE, encode_chunk, layout_from_proto, layout_to_proto
from protos import kv_transfer_pb2 as pb


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
        self.export = KVExport(cache, self.config, self.leases)
        self.stats = self.export.stats
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
        self.dist = DistSender(self.export, advertise, bind, self.config.dist_timeout_s,
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
              on_release: OnRelease, ttl: float | None = None, layers_ready: int | None = None,
              lora_key: str | None = None) -> KVHandle:
        """Pin a prefilled request's blocks for decode to pull; returns the handle to pass to decode (with the
        LoRA adapter the KV was computed with, which the puller checks against its own)."""
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
                        tuple(block_hashes), self.cache.layout, shm, lora_key)

    def mark_layers_ready(self, request_id: str, num_layers_ready: int) -> None:
        """Layer-wise prefill: layers [0, num_layers_ready) may be streamed now.

        On CUDA, call it once those layers' writes have completed (their stream synchronized).
        """
        self.leases.mark_layers_ready(request_id, num_layers_ready)

    def release(self, request_id: str) -> bool:
        """End a lease from the prefill side (abort); False if it was already gone."""
        return self.leases.release(request_id)

    def _pull(self, request: pb.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        lease, block_ids, fault = self.export.open_pull(request, context)
        try:
            for spec, segments in self.export.chunks(lease, block_ids, request, context, to_host=True):
                header = self.export.chunk_header(spec, segments, checksum=True)
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
