"""Hostile callers of the KV endpoint: a real gRPC channel to a real server on 127.0.0.1 gets a clear status
for unauthenticated, oversized and malformed messages and for pulls whose plan would explode; the server
keeps serving afterwards."""
from __future__ import annotations

import grpc
import pytest

from kv_transfer import KVServerConfig, KVTransferServer
from kv_transfer.wire import SERVICE, layout_to_proto
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub
from tests.test_kv_transfer import LAYOUT, TOKEN, Released, random_cache

AUTH = (("authorization", f"Bearer {TOKEN}"),)


@pytest.fixture
def server():
    server = KVTransferServer(random_cache(), TOKEN, KVServerConfig(max_blocks_per_pull=16)).start()
    server.lease("req", list(range(8)), [], 8 * 16, Released())
    yield server
    server.stop()


@pytest.fixture
def channel(server):
    with grpc.insecure_channel(server.address) as channel:
        yield channel


def pull(channel, **fields) -> grpc.RpcError:
    request = dict(request_id="req", layout=layout_to_proto(LAYOUT), block_indices=[0, 1], layer_start=0,
                   layer_end=LAYOUT.num_layers, max_chunk_bytes=1 << 20)
    request.update(fields)
    with pytest.raises(grpc.RpcError) as err:
        list(KVTransferStub(channel).Pull(pb.PullRequest(**request), metadata=AUTH, timeout=10))
    return err.value


def raw_call(channel, method: str, payload: bytes, metadata=AUTH) -> grpc.RpcError:
    call = channel.unary_stream(f"/{SERVICE}/{method}", request_serializer=None, response_deserializer=None)
    with pytest.raises(grpc.RpcError) as err:
        list(call(payload, metadata=metadata, timeout=10))
    return err.value


def assert_still_serving(server, channel) -> None:
    chunks = list(KVTransferStub(channel).Pull(pb.PullRequest(
        request_id="req", layout=layout_to_proto(LAYOUT), block_indices=[2, 3], layer_start=0,
        layer_end=LAYOUT.num_layers, max_chunk_bytes=1 << 20), metadata=AUTH, timeout=10))
    assert sum(c.header.num_bytes for c in chunks) == 2 * 2 * LAYOUT.num_layers * LAYOUT.bytes_per_block_per_layer
    assert len(server.leases) == 1


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),),
                                      (("authorization", "Basic " + TOKEN),)])
def test_calls_without_the_token_are_unauthenticated_even_when_malformed(server, channel, metadata):
    for payload in [pb.PullRequest(request_id="req").SerializeToString(), b"\xff\xff\xff"]:
        err = raw_call(channel, "Pull", payload, metadata)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
    assert_still_serving(server, channel)


@pytest.mark.parametrize("payload", [b"\xff\xff\xff", b"garbage here", b"\x0a\x05ab", b"\x0a\x02\xff\xfe"])
def test_malformed_messages_are_invalid_arguments(server, channel, payload):
    err = raw_call(channel, "Pull", payload)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "malformed PullRequest" in err.details()
    assert_still_serving(server, channel)


def test_an_oversized_request_is_refused_by_size(server, channel):
    err = pull(channel, request_id="r" * (2 << 20))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    assert_still_serving(server, channel)


@pytest.mark.parametrize("fields,field", [
    ({"block_indices": [0, 1, 0]}, "block_indices"),  # a duplicate would send (and plan) a block twice
    ({"block_indices": [0] * 100_000}, "block_indices"),  # ... or a million times
    ({"block_indices": list(range(17))}, "block_indices"),  # more than max_blocks_per_pull
    ({"block_indices": [0, 8]}, "block_indices"),  # beyond the lease
    ({"block_indices": [2 ** 32 - 1]}, "block_indices"),
    ({"max_chunk_bytes": 1}, "max_chunk_bytes"),  # one message per block and layer
    ({"max_chunk_bytes": 0}, "max_chunk_bytes"),
    ({"max_chunk_bytes": 1 << 40}, "max_chunk_bytes"),
    ({"layer_start": 3, "layer_end": 1}, "layer_start, layer_end"),
    ({"layer_end": 2 ** 31}, "layer_start, layer_end"),
    ({"request_id": ""}, "request_id"),
    ({"request_id": "x" * 10_000}, "request_id"),
    ({"pair_id": "p" * 10_000}, "pair_id"),
])
def test_pulls_whose_plan_could_explode_are_invalid_arguments_naming_the_field(server, channel, fields, field):
    err = pull(channel, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    assert err.details().startswith(field), err.details()
    assert server.leases.num_active_pulls == 0
    assert_still_serving(server, channel)


def test_a_missing_layout_is_a_layout_mismatch(server, channel):
    err = pull(channel, layout=pb.KVLayout())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert_still_serving(server, channel)


def test_an_unknown_method_is_unimplemented(server, channel):
    err = raw_call(channel, "Explode", b"")
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert_still_serving(server, channel)
