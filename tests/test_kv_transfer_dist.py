"""The torch.distributed transport's process groups: pairs that go idle or lose their client are discarded.

Real Gloo groups with a real client process that is killed without saying goodbye.
"""
from __future__ import annotations

import gc
import os
import threading
import time
from pathlib import Path

import grpc
import pytest

from engine.kv_cache import KVCache
from kv_transfer.dist_client import DistKVClient
from kv_transfer.wire import layout_to_proto
from protos import kv_transfer_pb2 as pb
from protos.kv_transfer_pb2_grpc import KVTransferStub
from tests.test_kv_transfer import LAYOUT, TOKEN, Released, _start, assert_blocks_equal, peers, random_cache  # noqa: F401


def gloo_threads() -> int:
    """Gloo's I/O threads in this process: one per live pair group (once discarded ones are collected)."""
    gc.collect()
    return sum(Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "gloo_tcp_loop"
               for tid in os.listdir("/proc/self/task") if Path(f"/proc/self/task/{tid}/comm").exists())


def wait_until(condition, timeout: float = 30.0) -> bool:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.parametrize("transport", ["torch_dist"])
def test_an_idle_pair_is_discarded_and_the_next_pull_reconnects(peers):
    src = random_cache()
    server = peers.server(src, dist_pair_idle_s=0.5)
    dst = KVCache(LAYOUT, 64)
    client = peers.client(dst)
    client.pull(server.lease("a", [1, 2], [], 32, Released()), [0, 1], [0, 1])
    assert server.dist.num_pairs == 1
    assert wait_until(lambda: server.dist.num_pairs == 0)
    client.pull(server.lease("b", [3, 4], [], 32, Released()), [5, 6], [0, 1])  # the client does not notice
    assert_blocks_equal(src, [3, 4], dst, [5, 6])
    assert server.dist.num_pairs == 1


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
    conn.send(server.lease("req", [0, 1], [], 32, Released()))
    assert conn.poll(60) and conn.recv() == "pulled"
    assert server.dist.num_pairs == 1 and gloo_threads() == before + 1
    proc.kill()
    proc.join(30)
    assert wait_until(lambda: server.dist.num_pairs == 0 and gloo_threads() == before)


@pytest.mark.parametrize("transport", ["torch_dist"])
def test_a_pair_whose_client_never_joins_is_discarded(peers):
    server = peers.server(dist_timeout_s=1.0, dist_pair_idle_s=0.5)
    before = gloo_threads()
    stub = KVTransferStub(grpc.insecure_channel(server.address))
    auth = (("authorization", f"Bearer {TOKEN}"),)
    stub.Connect(pb.ConnectRequest(pair_id="never-joins", layout=layout_to_proto(LAYOUT)), metadata=auth,
                 timeout=10)
    assert server.dist.num_pairs == 1  # joining in the background, waiting for rank 1
    assert wait_until(lambda: server.dist.num_pairs == 0, timeout=15)
    assert wait_until(lambda: gloo_threads() == before, timeout=5)  # its Gloo device's thread is gone too
    request = pb.PullRequest(request_id="req", layout=layout_to_proto(LAYOUT), block_indices=[0], layer_start=0,
                             layer_end=LAYOUT.num_layers, max_chunk_bytes=1 << 20, pair_id="never-joins")
    server.lease("req", [0], [], 16, Released())
    with pytest.raises(grpc.RpcError) as err:
        list(stub.PullDist(request, metadata=auth, timeout=10))
    assert err.value.code() == grpc.StatusCode.ABORTED  # the client would connect a new pair
