"""Why a pull failed: real failures map to the fixed reason vocabulary, and each cause is logged once per peer.

(The other causes, provoked on real servers, are asserted where tests/test_kv_transfer.py provokes them.)
"""
from __future__ import annotations

import logging
import socket

import grpc
import pytest

from engine.kv_cache import KVCache
from kv_transfer import KVHandle, KVServerConfig, KVTransferError
from kv_transfer.failures import FAILURE_REASONS, TransferFailures, failure_reason
from kv_transfer.faults import ENV, FaultInjector
from tests import test_kv_transfer
from tests.test_kv_transfer import CLIENTS, LAYER_CHUNKS, LAYOUT, TOKEN, Released, assert_blocks_equal, random_cache

peers, transport = test_kv_transfer.peers, test_kv_transfer.transport  # the transfer suite's fixtures


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("transport", ["grpc", "torch_dist"])
def test_a_handle_pointing_at_a_dead_port_is_unreachable(transport):
    client = CLIENTS[transport](KVCache(LAYOUT, 64), TOKEN, timeout_s=10)
    handle = KVHandle(transport, f"127.0.0.1:{closed_port()}", "req", 32, (), LAYOUT)
    try:
        with pytest.raises(KVTransferError) as failed:
            client.pull(handle, [0, 1], [0, 1])
    finally:
        client.close()
    assert failed.value.reason == "unreachable", failed.value


class _Status(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize("err,reason", [
    (_Status(grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses; last error: UNKNOWN: "
                                          "ipv4:127.0.0.1:39789: Connection refused"), "unreachable"),
    (_Status(grpc.StatusCode.UNAVAILABLE, "Socket closed"), "peer_gone"),
    (_Status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), "timeout"),
    (_Status(grpc.StatusCode.NOT_FOUND, "no KV lease"), "lease_expired"),
    (_Status(grpc.StatusCode.UNAUTHENTICATED, "bad token"), "unauthenticated"),
    (_Status(grpc.StatusCode.FAILED_PRECONDITION, "KV layout mismatch"), "layout_mismatch"),
    (_Status(grpc.StatusCode.INTERNAL, "boom"), "other"),
    (RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:4242"), "peer_gone"),
    (RuntimeError("Timed out waiting 30000ms for recv operation to complete"), "timeout"),
    (RuntimeError("The client socket has failed to connect to [10.0.0.2]:1 (errno: 111 - Connection refused)"),
     "unreachable"),
    (KVTransferError("spoken for", "checksum"), "checksum"),
    (ValueError("anything else"), "other"),
])
def test_statuses_and_errors_map_to_one_reason_each(err, reason):
    assert failure_reason(err) == reason


def test_each_reason_and_peer_is_logged_once_and_every_failure_counted(caplog):
    failures = TransferFailures("decode-7")
    with caplog.at_level(logging.WARNING, logger="kv_transfer.failures"):
        for _ in range(3):
            failures.record("unreachable", "10.0.0.2:5000", "Connection refused")
        failures.record("unreachable", "10.0.0.3:5000", "Connection refused")
        failures.record("timeout", "10.0.0.2:5000", "Deadline Exceeded")
        failures.record("made-up", "10.0.0.2:5000", "?")
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 4
    assert "decode-7" in warnings[0] and "10.0.0.2:5000" in warnings[0] and "unreachable" in warnings[0]
    assert failures.snapshot() == {**dict.fromkeys(FAILURE_REASONS, 0), "unreachable": 4, "timeout": 1, "other": 1}
    assert failures.total == 6


# ---- faults injected into a real server's pulls, on both transports --------------------------------------

@pytest.mark.parametrize("fault,reason", [("corrupt", "checksum"), ("stall", "timeout"), ("drop", "peer_gone"),
                                          ("expire", "lease_expired")])
def test_an_injected_fault_fails_the_pull_with_its_reason_and_the_server_keeps_serving(peers, fault, reason):
    src, faults = random_cache(), FaultInjector()
    server = peers.server(src, faults=faults)
    faults.inject(fault)
    handle = server.lease("hit", list(range(8)), [], 8 * 16, Released())
    client = peers.client(timeout_s=3.0 if fault == "stall" else 30.0, **LAYER_CHUNKS)  # a pull of 4 chunks
    with pytest.raises(KVTransferError) as failed:
        client.pull(handle, list(range(8)), list(range(8)))
    assert failed.value.reason == reason, failed.value
    assert faults.injected[fault] == 1
    assert (len(server.leases) == 0) == (fault == "expire")  # only an expired lease is gone
    client.timeout_s = 30.0
    good = server.lease("next", [9, 3, 30], [], 40, Released())
    client.pull(good, [20, 21, 22], [0, 1, 2])
    assert_blocks_equal(src, [9, 3, 30], client.cache, [20, 21, 22])


def test_fault_rates_come_from_the_environment_and_are_seeded(monkeypatch):
    monkeypatch.setenv(ENV, "corrupt=0.25,drop=0.25,seed=3")
    first, second = FaultInjector.from_env(), FaultInjector.from_env()
    drawn = [first.pick() for _ in range(400)]
    assert drawn == [second.pick() for _ in range(400)]
    assert 60 < drawn.count("corrupt") < 140 and 60 < drawn.count("drop") < 140
    assert first.injected == {"corrupt": drawn.count("corrupt"), "drop": drawn.count("drop"), "stall": 0, "expire": 0}
    monkeypatch.setenv(ENV, "explode=0.5")
    with pytest.raises(ValueError, match="explode"):
        FaultInjector.from_env()
    monkeypatch.delenv(ENV)
    assert FaultInjector.from_env() is None and KVServerConfig().faults is None
