"""Same-host KV pulls from a prefill worker's shared cache (kv_transfer/shm.py): the copy is exact, releases
the lease, fails like an expired lease when the lease ended before the copy did, and leaves the network path
to everything it cannot map: another host key, a worker whose cache is gone, a client that turned it off."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os

import pytest
import torch

from engine.kv_cache import KVCache
from kv_transfer import KVLeaseNotFoundError, KVServerConfig, KVTransferError, KVTransferServer
from kv_transfer.faults import FaultInjector
from kv_transfer.grpc_client import GrpcKVClient
from kv_transfer.shm import host_key
from tests.test_kv_transfer import LAYOUT, TOKEN, Released, assert_blocks_equal

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs memfd (Linux)")


def shared_cache(num_blocks: int = 64, seed: int = 0) -> KVCache:
    cache = KVCache(LAYOUT, num_blocks, shared=True)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


@pytest.fixture
def server():
    server = KVTransferServer(shared_cache(), TOKEN, KVServerConfig()).start()
    yield server
    server.stop()


@pytest.fixture
def client():
    client = GrpcKVClient(KVCache(LAYOUT, 32), TOKEN)
    yield client
    client.close()


def lease(server, request_id="r", blocks=(5, 9, 2, 40)):
    released = Released()
    handle = server.lease(request_id, list(blocks), [], len(blocks) * LAYOUT.block_size, released)
    return handle, released


def test_a_shared_cache_starts_zeroed_and_names_its_memfd():
    cache = KVCache(LAYOUT, 8, shared=True)
    assert cache.shm_fd is not None and os.path.exists(f"/proc/self/fd/{cache.shm_fd}")
    assert cache.kv.abs().sum() == 0 and cache.k[0].data_ptr() == cache.kv.data_ptr()
    assert KVCache(LAYOUT, 8).shm_fd is None


def test_same_host_pull_copies_exactly_and_releases_the_lease(server, client):
    handle, released = lease(server)
    assert handle.shm is not None and handle.shm.host == host_key() and handle.shm.block_ids == (5, 9, 2, 40)
    stats = client.pull(handle, [7, 3, 30], [0, 1, 3])
    assert stats.path == "shm" and stats.num_bytes == 3 * 2 * LAYOUT.num_layers * LAYOUT.bytes_per_block_per_layer
    assert_blocks_equal(server.cache, [5, 9, 40], client.cache, [7, 3, 30])
    assert released.calls == [[5, 9, 2, 40]]  # the copy released the lease: the prefill worker freed its blocks
    assert not server.release("r") and client.shm_unavailable == 0
    assert server.stats.bytes_sent == 0  # nothing went over gRPC


def test_a_lease_that_ended_before_the_copy_fails_the_pull(server, client):
    handle, _ = lease(server)
    server.release("r")  # expired or aborted: the blocks may hold another request's KV by now
    with pytest.raises(KVLeaseNotFoundError):
        client.pull(handle, [0, 1, 2, 3], [0, 1, 2, 3])


def test_another_host_pulls_over_the_network(server, client):
    handle, released = lease(server)
    elsewhere = dataclasses.replace(handle, shm=dataclasses.replace(handle.shm, host="another-boot:1:2"))
    stats = client.pull(elsewhere, [7, 3], [0, 1])
    assert stats.path == "network" and server.stats.bytes_sent == stats.num_bytes > 0
    assert_blocks_equal(server.cache, [5, 9], client.cache, [7, 3])
    assert released.calls == [] and client.shm_unavailable == 0  # not a fallback: the path for another host


def test_an_unmappable_cache_is_counted_and_pulled_over_the_network(server, client):
    handle, _ = lease(server)
    gone = dataclasses.replace(handle, shm=dataclasses.replace(handle.shm, fd=10_000))  # no such descriptor
    stats = client.pull(gone, [7, 3], [0, 1])
    assert stats.path == "network" and client.shm_unavailable == 1
    assert_blocks_equal(server.cache, [5, 9], client.cache, [7, 3])


def test_no_shared_memory_client_faulty_server_or_layerwise_lease_uses_the_network(server):
    handle, _ = lease(server)
    client = GrpcKVClient(KVCache(LAYOUT, 32), TOKEN, shared_memory=False)
    try:
        assert client.pull(handle, [1], [0]).path == "network"
    finally:
        client.close()
    # a layer-wise lease is pulled while its forward still writes the blocks: never from the shared cache
    assert server.lease("lw", [1], [], 4, Released(), layers_ready=0).shm is None
    faulty = KVTransferServer(shared_cache(), TOKEN, KVServerConfig(faults=FaultInjector())).start()
    try:  # injected faults act on the network path, so a server that injects them offers no shared cache
        assert lease(faulty)[0].shm is None
    finally:
        faulty.stop()


def _serve(conn) -> None:
    """A prefill side in its own process: lease four blocks of a shared cache, send the handle and its data."""
    server = KVTransferServer(shared_cache(seed=3), TOKEN, KVServerConfig()).start()
    handle = server.lease("p", [1, 2, 3, 4], [], 4 * LAYOUT.block_size, lambda ids: conn.send(("released", ids)))
    conn.send((handle, server.cache.kv[:, :, 1:5].clone()))
    conn.recv()  # until told to stop (or killed)


def test_pull_from_another_process_and_from_one_that_died():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve, args=(child,), daemon=True)
    proc.start()
    client = GrpcKVClient(KVCache(LAYOUT, 16), TOKEN, timeout_s=5)
    try:
        handle, data = parent.recv()
        assert handle.shm.pid == proc.pid
        stats = client.pull(handle, [10, 11, 12, 13], [0, 1, 2, 3])
        assert stats.path == "shm" and torch.equal(client.cache.kv[:, :, 10:14], data)
        assert parent.recv() == ("released", [1, 2, 3, 4])
        proc.kill()
        proc.join(10)
        # the copy out of the map we hold cannot be confirmed (no server to release the lease): it fails, and
        # the map (which kept the dead worker's cache alive) is dropped
        with pytest.raises(KVTransferError):
            client.pull(handle, [0], [0])
        assert client.shm_unavailable == 0 and not client.shared._maps
        # the next pull has nothing to map: counted, and the network path finds no server either
        with pytest.raises(KVTransferError):
            client.pull(handle, [0], [0])
        assert client.shm_unavailable == 1
    finally:
        client.close()
        if proc.is_alive():
            proc.kill()


def test_two_first_pulls_at_once_from_new_workers_while_one_drops_a_gone_workers_map(monkeypatch):
    """Pulls run on several threads: one pull's first map of a worker, dropping the maps of workers that are gone,
    while another pull maps a second new worker. Unlocked, the second insert landed mid-iteration over the maps
    and the first pull failed with RuntimeError ("dictionary keys changed during iteration"), an internal error
    for its request."""
    import threading

    from kv_transfer import shm
    from kv_transfer.shm import SharedCaches, source

    first, second = shared_cache(seed=1), shared_cache(seed=2)
    caches = SharedCaches(KVCache(LAYOUT, 16))
    caches._maps[(2 ** 22 + 1, 3, 1)] = (torch.zeros(1), None)  # a worker that is gone
    exists, other = os.path.exists, {}

    def slow_exists(path):
        if path.startswith(f"/proc/{2 ** 22 + 1}/") and "thread" not in other:  # the first pull, mid-iteration
            other["thread"] = threading.Thread(target=lambda: other.setdefault(
                "bytes", caches.copy(source(second, [4]), [0], [1])))
            other["thread"].start()
            other["thread"].join(1.0)  # with the lock it cannot finish before this pull lets go of the maps
        return exists(path)

    monkeypatch.setattr(shm.os.path, "exists", slow_exists)
    assert caches.copy(source(first, [3]), [0], [0]) > 0
    other["thread"].join(10)
    assert other.get("bytes", 0) > 0
    assert torch.equal(caches.cache.kv[:, :, 0], first.kv[:, :, 3]) and torch.equal(caches.cache.kv[:, :, 1],
                                                                                    second.kv[:, :, 4])
    assert len(caches._maps) == 2  # the gone worker's map dropped, one per live worker
