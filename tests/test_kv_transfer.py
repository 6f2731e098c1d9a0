"""KV transfer between two paged caches: one suite, run against the gRPC and the torch.distributed transport.

Real gRPC servers on 127.0.0.1, real Gloo process groups, real separate
processes where a peer dies. Caches hold random data, so equality is bit-exact.
"""
from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
from concurrent import futures

import grpc
import pytest
import torch

from engine.block_manager import BlockManager
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (KVAuthError, KVChecksumError, KVLayoutMismatchError, KVLeaseNotFoundError,
                         KVServerConfig, KVTransferError, KVTransferServer)
from kv_transfer.dist_client import DistKVClient
from kv_transfer.faults import FaultInjector
from kv_transfer import chunks, grpc_client
from kv_transfer.grpc_client import GrpcKVClient
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub
from tests.helpers import wait_for

TOKEN = "test-token"
LAYOUT = KVLayout("tiny", "float32", 16, 4, 2, 8)
BLOCK_BYTES = 2 * LAYOUT.num_layers * LAYOUT.bytes_per_block_per_layer  # K+V of one block, all layers
CLIENTS = {"grpc": GrpcKVClient, "torch_dist": DistKVClient}
SMALL_CHUNKS = {"max_chunk_bytes": 4096, "max_message_bytes": 1 << 20}  # several chunks per pull
LAYER_CHUNKS = {"max_chunk_bytes": 8 * BLOCK_BYTES // LAYOUT.num_layers}  # 8 blocks: one layer per chunk


def random_cache(layout: KVLayout = LAYOUT, num_blocks: int = 64, seed: int = 0) -> KVCache:
    cache = KVCache(layout, num_blocks)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k + cache.v:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return cache


def assert_blocks_equal(src: KVCache, src_ids: list[int], dst: KVCache, dst_ids: list[int]) -> None:
    for layer in range(src.layout.num_layers):
        assert torch.equal(dst.k[layer][dst_ids], src.k[layer][src_ids])
        assert torch.equal(dst.v[layer][dst_ids], src.v[layer][src_ids])


class Released:
    """An on_release callback that remembers what it was given."""

    def __init__(self):
        self.calls: list[list[int]] = []
        self.event = threading.Event()

    def __call__(self, block_ids: list[int]) -> None:
        self.calls.append(block_ids)
        self.event.set()


@pytest.fixture(params=["grpc", "torch_dist"])
def transport(request) -> str:
    return request.param


@pytest.fixture
def peers(transport):
    """Builds servers and clients for `transport`, and stops them all after the test."""
    made = []

    class Peers:
        def server(self, cache=None, token=TOKEN, cls=KVTransferServer, **config):
            config.setdefault("dist", transport == "torch_dist")
            server = cls(cache if cache is not None else random_cache(), token, KVServerConfig(**config)).start()
            made.append(server)
            return server

        def client(self, cache=None, token=TOKEN, **options):
            client = CLIENTS[transport](cache if cache is not None else KVCache(LAYOUT, 64), token, **options)
            made.append(client)
            return client

    yield Peers()
    for peer in reversed(made):
        peer.close() if hasattr(peer, "close") else peer.stop()


@pytest.mark.parametrize("coalesce", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("src_ids,dst_ids", [
    (list(range(8, 13)), list(range(20, 25))),  # consecutive: sent from and received into cache slices
    ([3, 7, 8, 30, 21], [0, 17, 2, 9, 40]),  # scattered: gathered and scattered per layer
    (list(range(8, 13)), [0, 17, 2, 9, 40]),  # each end decides on its own
])
def test_pulled_blocks_are_bit_identical(peers, transport, dtype, src_ids, dst_ids, coalesce, monkeypatch):
    monkeypatch.setattr(chunks, "COALESCE_BELOW_BYTES", 1 << 40 if coalesce else 0)
    layout = KVLayout("tiny", dtype, 16, 4, 2, 8)
    src = random_cache(layout)
    server = peers.server(src)
    handle = server.lease("req", src_ids, [101, 102, 103, 104], 5 * 16 - 3, Released())
    dst = KVCache(layout, 64)
    stats = peers.client(dst, **SMALL_CHUNKS).pull(handle, dst_ids, list(range(5)))
    assert_blocks_equal(src, src_ids, dst, dst_ids)
    assert stats.num_bytes == 5 * 2 * layout.num_layers * layout.bytes_per_block_per_layer
    assert stats.num_chunks > 1
    assert handle.transport == transport


@pytest.mark.parametrize("transport", ["torch_dist"])  # gRPC chunks always carry a checksum
def test_collective_pull_without_checksums_is_still_exact(peers):
    src = random_cache()
    handle = peers.server(src, dist_checksums=False).lease("req", [5, 9, 2], [], 40, Released())
    dst = KVCache(LAYOUT, 64)
    peers.client(dst, **SMALL_CHUNKS).pull(handle, [1, 2, 3], [0, 1, 2])
    assert_blocks_equal(src, [5, 9, 2], dst, [1, 2, 3])


class CountingServer(KVTransferServer):
    """Records how many blocks each gRPC Pull call asked for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pulls: list[int] = []

    def _pull(self, request, context):
        self.pulls.append(len(request.block_indices))
        return super()._pull(request, context)


@pytest.mark.parametrize("transport", ["grpc"])
def test_a_grpc_pull_split_over_parallel_streams_is_exact(peers, monkeypatch):
    monkeypatch.setattr(grpc_client, "MIN_STREAM_BYTES", 1)  # tiny test layout: split even a few blocks
    src, src_ids, dst_ids = random_cache(), [3, 7, 8, 30, 21, 40, 41], list(range(10, 17))
    server = peers.server(src, cls=CountingServer)
    handle = server.lease("req", src_ids, [], 7 * 16, Released())
    dst = KVCache(LAYOUT, 64)
    stats = peers.client(dst, num_streams=3, **SMALL_CHUNKS).pull(handle, dst_ids, list(range(7)))
    assert_blocks_equal(src, src_ids, dst, dst_ids)
    assert sorted(server.pulls) == [2, 2, 3]  # three calls, each on its own connection
    assert stats.num_bytes == 7 * BLOCK_BYTES


@pytest.mark.parametrize("cores,streams", [(1, 1), (2, 1), (4, 1), (8, 2), (16, 4), (96, 4)])
def test_default_grpc_streams_follow_the_cores(monkeypatch, cores, streams):
    monkeypatch.setattr(grpc_client.os, "sched_getaffinity", lambda pid: set(range(cores)))
    assert grpc_client.default_num_streams() == streams


def test_wrong_or_missing_token_is_unauthenticated(peers):
    server = peers.server()
    handle = server.lease("req", [0, 1], [], 20, Released())
    with pytest.raises(KVAuthError) as refused:
        peers.client(token="not-the-token").pull(handle, [0, 1], [0, 1])
    assert refused.value.reason == "unauthenticated"
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as err:
        KVTransferStub(channel).Health(pb.HealthRequest(), timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(server.leases) == 1  # refused callers cannot touch leases


def test_corrupted_chunk_fails_the_pull_and_the_client_recovers(peers):
    src, faults = random_cache(), FaultInjector()
    faults.inject("corrupt")  # one bit of the first chunk flips after its checksum was taken
    server = peers.server(src, faults=faults)
    handle = server.lease("req", [0, 1, 2], [1, 2, 3], 48, Released())
    dst = KVCache(LAYOUT, 64)
    client = peers.client(dst, **SMALL_CHUNKS)
    with pytest.raises(KVChecksumError) as failed:
        client.pull(handle, [0, 1, 2], [0, 1, 2])
    assert failed.value.reason == "checksum"
    client.pull(handle, [0, 1, 2], [0, 1, 2])  # the lease survives; the same server sends it intact now
    assert_blocks_equal(src, [0, 1, 2], dst, [0, 1, 2])


def test_mismatched_layout_is_refused_and_the_lease_survives(peers):
    src = random_cache()
    server = peers.server(src)
    handle = server.lease("req", [4, 5], [7, 8], 32, Released())
    other = KVCache(KVLayout("tiny", "float32", 16, 4, 2, 16), 8)  # head_dim differs
    before = [t.clone() for t in other.k]
    with pytest.raises(KVLayoutMismatchError) as refused:
        peers.client(other).pull(handle, [0, 1], [0, 1])
    assert refused.value.reason == "layout_mismatch"
    assert all(torch.equal(a, b) for a, b in zip(before, other.k))
    dst = KVCache(LAYOUT, 64)
    peers.client(dst).pull(handle, [0, 1], [0, 1])
    assert_blocks_equal(src, [4, 5], dst, [0, 1])


def test_unpulled_lease_expires_and_frees_the_senders_blocks(peers):
    server = peers.server()
    released = Released()
    handle = server.lease("req", [9, 3, 4], [1, 2, 3], 48, released, ttl=0.2)
    assert released.event.wait(10)
    assert released.calls == [[9, 3, 4]]
    assert len(server.leases) == 0
    with pytest.raises(KVLeaseNotFoundError) as gone:
        peers.client().pull(handle, [0, 1, 2], [0, 1, 2])
    assert gone.value.reason == "lease_expired"


def test_release_after_pull_frees_the_blocks_exactly_once(peers):
    server = peers.server()
    released = Released()
    handle = server.lease("req", [1, 2], [5, 6], 32, released)
    client = peers.client()
    client.pull(handle, [0, 1], [0, 1])
    assert client.release(handle) is True
    assert client.release(handle) is False
    assert released.calls == [[1, 2]]
    with pytest.raises(KVLeaseNotFoundError):
        client.pull(handle, [0, 1], [0, 1])


def test_layers_stream_as_the_producer_marks_them_ready(peers):
    src = random_cache()
    server = peers.server(src)
    handle = server.lease("req", list(range(6)), [], 6 * 16, Released(), layers_ready=0)
    dst = KVCache(LAYOUT, 64)
    client = peers.client(dst, max_chunk_bytes=6 * BLOCK_BYTES // LAYOUT.num_layers)  # one layer per chunk
    seen, first_two = [], threading.Event()

    def on_layers(lo: int, hi: int) -> None:
        seen.append((lo, hi))
        if hi >= 2:
            first_two.set()

    with futures.ThreadPoolExecutor(1) as pool:
        pull = pool.submit(client.pull, handle, list(range(6)), list(range(6)), on_layers)
        server.mark_layers_ready("req", 2)
        assert first_two.wait(60), pull.exception() if pull.done() else "layers 0 and 1 did not arrive"
        assert not pull.done()  # layers 2 and 3 are not produced yet, so the pull cannot be done
        server.mark_layers_ready("req", 4)
        pull.result(timeout=60)
    assert [layer for lo, hi in seen for layer in range(lo, hi)] == [0, 1, 2, 3]
    assert_blocks_equal(src, list(range(6)), dst, list(range(6)))


def test_a_pull_waiting_on_a_stalled_prefill_ends_at_its_deadline(peers):
    src = random_cache()
    server = peers.server(src)
    handle = server.lease("req", [0, 1], [], 32, Released(), layers_ready=1)
    with pytest.raises(KVTransferError, match="DEADLINE_EXCEEDED") as late:
        peers.client(timeout_s=1.0).pull(handle, [0, 1], [0, 1])
    assert late.value.reason == "timeout"
    server.mark_layers_ready("req", LAYOUT.num_layers)  # the lease outlives the failed pull
    dst = KVCache(LAYOUT, 64)
    peers.client(dst).pull(handle, [3, 4], [0, 1])
    assert_blocks_equal(src, [0, 1], dst, [3, 4])


def test_chunks_beyond_the_message_size_limit_are_refused(peers):
    handle = peers.server(max_message_bytes=1 << 20).lease("req", [0], [], 16, Released())
    client = peers.client(max_chunk_bytes=2 << 20, max_message_bytes=4 << 20)
    with pytest.raises(KVTransferError, match="INVALID_ARGUMENT"):
        client.pull(handle, [0], [0])


def test_calls_beyond_the_bounded_thread_pool_are_turned_away(peers, transport):
    server = peers.server(max_workers=1)
    handle = server.lease("req", [0], [], 16, Released(), layers_ready=0)
    client = peers.client()
    with futures.ThreadPoolExecutor(1) as pool:
        pull = pool.submit(client.pull, handle, [0], [0])
        # Until the pull occupies the only worker (waiting for layers nobody marks ready).
        assert wait_for(lambda: server.leases.num_active_pulls == 1 or pull.done(), timeout_s=60)
        assert not pull.done(), pull.exception()
        with pytest.raises(KVTransferError, match="RESOURCE_EXHAUSTED") as busy:
            peers.client().health(server.address)
        assert busy.value.reason == "overloaded"
        server.release("req")
        with pytest.raises(KVLeaseNotFoundError):  # the waiting pull ends: its lease is gone
            pull.result(timeout=60)


def test_handle_pickles_for_ray(peers):
    handle = peers.server().lease("req", [0, 1, 2], [4, 5], 40, Released())
    assert pickle.loads(pickle.dumps(handle)) == handle
    assert handle.num_blocks == 3


# ---- a peer dies mid-transfer -----------------------------------------------------------------

def _serve_until_killed(transport: str, conn) -> None:
    server = KVTransferServer(random_cache(), TOKEN, KVServerConfig(dist=transport == "torch_dist")).start()
    conn.send(server.lease("req", list(range(8)), [], 8 * 16, lambda ids: None, layers_ready=1))
    threading.Event().wait()


def _pull_until_killed(transport: str, conn) -> None:
    client = CLIENTS[transport](KVCache(LAYOUT, 64), TOKEN, **LAYER_CHUNKS)
    conn.send("up")
    warm_up = conn.recv()
    client.pull(warm_up, [0], [0])  # connected now (torch.distributed: the pair's group has joined)
    client.release(warm_up)
    conn.send("ready")
    handle = conn.recv()
    client.pull(handle, list(range(8)), list(range(8)), on_layers=lambda lo, hi: conn.send(hi))


def _start(target, *args) -> tuple[mp.Process, object]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
    proc.start()
    assert ours.poll(120), "peer process did not come up"
    return proc, ours


def test_sender_killed_mid_transfer_fails_the_pull_cleanly(peers, transport):
    proc, conn = _start(_serve_until_killed, transport)
    handle = conn.recv()
    blocks = BlockManager(64, LAYOUT.block_size)  # the receiver's real block accounting
    dst = blocks.allocate_blocks(handle.num_blocks)
    client = peers.client(**LAYER_CHUNKS)
    got_layer0, outcome = threading.Event(), {}

    def pull() -> None:
        try:
            client.pull(handle, dst, list(range(8)), on_layers=lambda lo, hi: got_layer0.set())
        except Exception as err:
            outcome["error"] = err

    puller = threading.Thread(target=pull)
    puller.start()
    try:
        assert got_layer0.wait(60), outcome  # mid-transfer: layer 0 arrived, the rest is not produced yet
    finally:
        proc.kill()
    puller.join(60)
    assert not puller.is_alive()
    assert isinstance(outcome.get("error"), KVTransferError)
    assert outcome["error"].reason == "peer_gone", outcome["error"]
    blocks.free_block_ids(dst)
    assert blocks.num_free_blocks == 64

    src = random_cache()  # the same client still works with a live sender
    good = peers.server(src).lease("other", [2, 3], [], 32, Released())
    client.pull(good, [0, 1], [0, 1])
    assert_blocks_equal(src, [2, 3], client.cache, [0, 1])


def test_receiver_killed_mid_transfer_lets_the_lease_expire(peers, transport):
    server = peers.server()
    released = Released()
    proc, conn = _start(_pull_until_killed, transport)
    assert conn.recv() == "up"
    conn.send(server.lease("warm-up", [0], [], 16, Released()))
    assert conn.poll(120) and conn.recv() == "ready"
    # The TTL only has to outlive the hand-over of the lease to a connected receiver, and then runs once
    # more after the receiver is gone.
    conn.send(server.lease("req", list(range(8)), [], 8 * 16, released, ttl=3.0, layers_ready=1))
    assert conn.poll(60) and conn.recv() == 1  # the receiver holds layer 0
    proc.kill()
    proc.join(30)
    server.mark_layers_ready("req", LAYOUT.num_layers)
    assert released.event.wait(60)
    assert released.calls == [list(range(8))]
    assert len(server.leases) == 0

    src_handle = server.lease("next", [0, 1], [], 32, Released())  # the server keeps serving
    dst = KVCache(LAYOUT, 64)
    peers.client(dst).pull(src_handle, [5, 6], [0, 1])
    assert_blocks_equal(server.cache, [0, 1], dst, [5, 6])

