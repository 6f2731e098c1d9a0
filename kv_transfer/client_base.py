"""What both pull clients share: channels, auth metadata, deadlines, errors, layer progress."""
from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from engine.kv_cache import KVCache
from kv_transfer.config import TLSFiles
from kv_transfer.chunks import MIN_CHUNK_BYTES, ChunkSpec
from kv_transfer.failures import failure_reason
from kv_transfer.handle import (KVAuthError, KVHandle, KVLayoutMismatchError, KVLeaseNotFoundError,
                                KVTransferError)
from kv_transfer.malloc import keep_message_buffers_in_heap
from kv_transfer.tls import channel_credentials
from kv_transfer.wire import layout_to_proto
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub

OnLayers = Callable[[int, int], None]

_ERRORS = {
    grpc.StatusCode.UNAUTHENTICATED: KVAuthError,
    grpc.StatusCode.FAILED_PRECONDITION: KVLayoutMismatchError,
    grpc.StatusCode.NOT_FOUND: KVLeaseNotFoundError,
}


def transfer_error(err: grpc.RpcError, request_id: str) -> KVTransferError:
    """The KVTransferError subclass that says what went wrong with a request's RPC."""
    kind = _ERRORS.get(err.code(), KVTransferError)
    return kind(f"KV pull of request {request_id!r}: {err.code().name}: {err.details()}", failure_reason(err))


class LayerProgress:
    """Counts received blocks per layer and reports each newly complete prefix of layers.

    `on_layers(lo, hi)` means layers [lo, hi) now hold every pulled block; it
    runs on a transport thread, in layer order, never concurrently.
    """

    def __init__(self, layer_start: int, layer_end: int, num_blocks: int, on_layers: OnLayers | None):
        self._missing = {layer: num_blocks for layer in range(layer_start, layer_end)}
        self._next = layer_start
        self._end = layer_end
        self._on_layers = on_layers
        self._lock = threading.Lock()

    def done(self, spec: ChunkSpec) -> None:
        with self._lock:
            for layer in range(spec.layer_start, spec.layer_end):
                self._missing[layer] -= spec.num_blocks
            start = self._next
            while self._next < self._end and self._missing[self._next] == 0:
                self._next += 1
            if self._next > start and self._on_layers is not None:
                self._on_layers(start, self._next)

    @property
    def complete(self) -> bool:
        return self._next == self._end


class KVClientBase:
    """A decode worker's side of KV transfer into its own `cache`."""

    default_chunk_bytes = 4 << 20

    def __init__(self, cache: KVCache, token: str, *, timeout_s: float = 30.0,
                 max_message_bytes: int = 16 << 20, max_chunk_bytes: int | None = None, tls: TLSFiles | None = None):
        max_chunk_bytes = max_chunk_bytes or self.default_chunk_bytes
        if max_chunk_bytes > max_message_bytes - (64 << 10):
            raise ValueError("max_chunk_bytes must leave 64 KiB of max_message_bytes for framing")
        if max_chunk_bytes < MIN_CHUNK_BYTES:
            raise ValueError(f"max_chunk_bytes must be at least {MIN_CHUNK_BYTES} (servers refuse smaller chunks)")
        self.cache = cache
        self.timeout_s = timeout_s
        self.max_message_bytes = max_message_bytes
        self.max_chunk_bytes = max_chunk_bytes
        self.tls = tls
        self._credentials = channel_credentials(tls) if tls is not None else None
        self._metadata = (("authorization", f"Bearer {token}"),)
        self._channels: dict[tuple[str, int], grpc.Channel] = {}
        self._stubs: dict[str, KVTransferStub] = {}
        self._lock = threading.Lock()
        keep_message_buffers_in_heap(max_message_bytes)  # messages and staging buffers: chunk-sized

    def channel(self, address: str, index: int = 0) -> grpc.Channel:
        """Channel `index` to `address`; distinct indices get distinct TCP connections."""
        with self._lock:
            key = (address, index)
            if key not in self._channels:
                options = [("grpc.max_send_message_length", self.max_message_bytes),
                           ("grpc.max_receive_message_length", self.max_message_bytes),
                           ("grpc.use_local_subchannel_pool", 1)]
                if self._credentials is None:
                    self._channels[key] = grpc.insecure_channel(address, options=options)
                else:
                    if self.tls.server_name:
                        options.append(("grpc.ssl_target_name_override", self.tls.server_name))
                    self._channels[key] = grpc.secure_channel(address, self._credentials, options=options)
            return self._channels[key]

    def stub(self, address: str) -> KVTransferStub:
        stub = self._stubs.get(address)
        if stub is None:  # two threads may both build one; either will do
            stub = self._stubs.setdefault(address, KVTransferStub(self.channel(address)))
        return stub

    def call_options(self) -> dict:
        return {"timeout": self.timeout_s, "metadata": self._metadata}

    def pull_request(self, handle: KVHandle, dst_block_ids: list[int], indices: list[int],
                     pair_id: str = "") -> pb.PullRequest:
        if len(dst_block_ids) != len(indices):
            raise ValueError(f"{len(indices)} block indices but {len(dst_block_ids)} destination blocks")
        if any(not 0 <= i < handle.num_blocks for i in indices):
            raise ValueError(f"block indices must be in [0, {handle.num_blocks})")
        return pb.PullRequest(request_id=handle.request_id, layout=layout_to_proto(self.cache.layout),
                              block_indices=indices, layer_start=0, layer_end=self.cache.layout.num_layers,
                              max_chunk_bytes=self.max_chunk_bytes, pair_id=pair_id)

    def release(self, handle: KVHandle) -> bool:
        """Tell the prefill worker we are done with the request's blocks; False if its lease was gone."""
        try:
            reply = self.stub(handle.address).Release(pb.ReleaseRequest(request_id=handle.request_id),
                                                      **self.call_options())
        except grpc.RpcError as err:
            raise transfer_error(err, handle.request_id) from None
        return reply.released

    def health(self, address: str) -> pb.HealthResponse:
        try:
            return self.stub(address).Health(pb.HealthRequest(), **self.call_options())
        except grpc.RpcError as err:
            raise transfer_error(err, "") from None

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()
            self._stubs.clear()
