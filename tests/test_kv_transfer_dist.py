"""The torch.distributed transport's process groups: pairs that go idle or lose their client are discarded.

Real Gloo groups with a real client process that is killed without saying goodbye.
"""
from __future__ import annotations

import gc
import os
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from engine.kv_cache import KVCache
from kv_transfer.dist_client import DistKVClient
from kv_transfer.wire import layout_to_proto
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub
from tests.helpers import wait_for
from tests.test_kv_transfer import LAYOUT, TOKEN, Released, _start, assert_blocks_equal, peers, random_cache  # noqa: F401


def gloo_threads() -> int:
    """Gloo's I/O threads in this process: one per live pair group (once discarded ones are collected)."""
    gc.collect()
    return sum(Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "gloo_tcp_loop"
               for tid in os.listdir("/proc/self/task") if Path(f"/proc/self/task/{tid}/comm").exists())


def pull_holding_its_pair(server, client, request_id: str, src_ids: list[int], dst_ids: list[int]) -> None:
    """Pull a lease whose layers are marked ready only once the pull holds its pair (so the pair cannot
    be discarded as idle meanwhile), after checking the pair is there."""
    handle = server.lease(request_id, src_ids, [], 16 * len(src_ids), Released(), layers_ready=0)
    with futures.ThreadPoolExecutor(1) as pool:
        pull = pool.submit(client.pull, handle, dst_ids, list(range(len(src_ids))))
        assert wait_for(lambda: server.leases.num_active_pulls == 1 or pull.done()), "the pull never started"
        assert not pull.done(), pull.exception()
        assert server.dist.num_pairs == 1
        server.mark_layers_ready(request_id, LAYOUT.num_layers)
        pull.result(timeout=60)


@pytest.mark.parametrize("transport", ["torch_dist"])
def test_an_idle_pair_is_discarded_and_the_next_pull_reconnects(peers):
    src = random_cache()
    server = peers.server(src, dist_pair_idle_s=1.0)
    dst = KVCache(LAYOUT, 64)
    client = peers.client(dst)
    pull_holding_its_pair(server, client, "a", [1, 2], [0, 1])
    assert wait_for(lambda: server.dist.num_pairs == 0)
    pull_holding_its_pair(server, client, "b", [3, 4], [5, 6])  # the client does not notice
    assert_blocks_equal(src, [1, 2, 3, 4], dst, [0, 1, 5, 6])


def _pull_once_then_hang(conn) -> None:
    client = DistKVClient(KVCache(LAYOUT, 64), TOKEN)
    conn.send("ready")
    client.pull(conn.recv(), [0, 1], [0, 1])
    conn.send("pulled")
    threading.Event().wait()


@pytest.mark.parametrize("transport", ["torch_dist"])
def test_a_client_that_vanishes_without_disconnect_leaves_no_gloo_threads_behind(peers):
    server = peers.server(dist_pair_idle_s=1.0)
    before = gloo_threads()
    proc, conn = _start(_pull_once_then_hang)
    assert conn.recv() == "ready"
    conn.send(server.lease("req", [0, 1], [], 32, Released(), layers_ready=0))
    # While the pull waits for its layers it holds the pair, which cannot be discarded as idle meanwhile.
    assert wait_for(lambda: server.leases.num_active_pulls == 1, timeout_s=60)
    assert server.dist.num_pairs == 1 and gloo_threads() == before + 1
    server.mark_layers_ready("req", LAYOUT.num_layers)
    assert conn.poll(60) and conn.recv() == "pulled"
    proc.kill()
    proc.join(30)
    assert wait_for(lambda: server.dist.num_pairs == 0 and gloo_threads() == before)


@pytest.mark.parametrize("transport", ["torch_dist"])
def test_a_pair_whose_client_never_joins_is_discarded(peers):
    # The join fails after dist_timeout_s; until then (and for idle_s) the pair is kept, a margin the
    # check right after Connect needs.
    server = peers.server(dist_timeout_s=2.0, dist_pair_idle_s=4.0)
    before = gloo_threads()
    stub = KVTransferStub(grpc.insecure_channel(server.address))
    auth = (("authorization", f"Bearer {TOKEN}"),)
    stub.Connect(pb.ConnectRequest(pair_id="never-joins", layout=layout_to_proto(LAYOUT)), metadata=auth,
                 timeout=10)
    assert server.dist.num_pairs == 1  # joining in the background, waiting for rank 1
    assert wait_for(lambda: server.dist.num_pairs == 0, timeout_s=30)
    assert wait_for(lambda: gloo_threads() == before, timeout_s=10)  # its Gloo device's thread is gone too
    request = pb.PullRequest(request_id="req", layout=layout_to_proto(LAYOUT), block_indices=[0], layer_start=0,
                             layer_end=LAYOUT.num_layers, max_chunk_bytes=1 << 20, pair_id="never-joins")
    server.lease("req", [0], [], 16, Released())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.PullDist(request, metadata=auth, timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED  # the client would connect a new pair
