"""Where a KV server listens and what its handles advertise: config vs environment vs Ray's node IP, and a
server bound to a non-loopback address that the test itself creates (on a veth pair)."""
from __future__ import annotations

import socket
import subprocess
import uuid

import pytest

from cluster.config import ConfigError, load_config
from engine.kv_cache import KVCache
from kv_transfer import KVServerConfig, KVTransferServer
from kv_transfer.addresses import (ADVERTISE_HOST_ENV, BIND_HOST_ENV, KVAddresses, check_host, host_port,
                                   hosts_that_cannot_reach, is_loopback, resolve_kv_addresses)
from tests.test_kv_transfer import CLIENTS, LAYOUT, TOKEN, Released, assert_blocks_equal, random_cache

NODE_IP = "10.1.2.3"  # only ever resolved, never sent to


def test_the_node_ip_is_advertised_and_bound_by_default():
    assert resolve_kv_addresses(None, None, NODE_IP, {}) == KVAddresses(NODE_IP, NODE_IP)


def test_a_local_ray_node_keeps_the_kv_server_on_loopback():
    assert resolve_kv_addresses(None, None, "127.0.0.1", {}) == KVAddresses("127.0.0.1", "127.0.0.1")


def test_config_overrides_the_node_ip():
    assert resolve_kv_addresses("kv.example.internal", "0.0.0.0", NODE_IP, {}) == \
        KVAddresses("kv.example.internal", "0.0.0.0")


def test_bind_host_alone_keeps_advertising_the_node_ip():
    assert resolve_kv_addresses(None, "0.0.0.0", NODE_IP, {}) == KVAddresses(NODE_IP, "0.0.0.0")


def test_environment_wins_over_config():
    env = {ADVERTISE_HOST_ENV: "10.9.9.9", BIND_HOST_ENV: "0.0.0.0"}
    assert resolve_kv_addresses("10.5.5.5", "10.5.5.5", NODE_IP, env) == KVAddresses("10.9.9.9", "0.0.0.0")


def test_an_empty_environment_variable_is_ignored():
    assert resolve_kv_addresses("10.5.5.5", None, NODE_IP, {ADVERTISE_HOST_ENV: " "}) == \
        KVAddresses("10.5.5.5", "10.5.5.5")


@pytest.mark.parametrize("wildcard", ["0.0.0.0", "::", "[::]"])
def test_advertising_every_interface_is_refused_naming_the_setting(wildcard):
    with pytest.raises(ValueError, match=ADVERTISE_HOST_ENV):
        resolve_kv_addresses(None, None, NODE_IP, {ADVERTISE_HOST_ENV: wildcard})
    with pytest.raises(ValueError, match="transfer.advertise_host"):
        resolve_kv_addresses(wildcard, None, NODE_IP, {})


def test_a_bad_bind_host_in_the_environment_names_the_variable():
    with pytest.raises(ValueError, match=BIND_HOST_ENV):
        resolve_kv_addresses(None, None, NODE_IP, {BIND_HOST_ENV: "not a host"})


@pytest.mark.parametrize("host", ["10.0.0.7", "fd00::7", "prefill-0.tandem.svc.cluster.local", "localhost"])
def test_ips_and_hostnames_are_valid(host):
    assert check_host(host, "f", wildcard_ok=False) == host


@pytest.mark.parametrize("host", ["", "a b", "http://x", "10.0.0.256", "host:80", "-bad.example"])
def test_anything_else_is_invalid(host):
    with pytest.raises(ValueError, match="neither an IP address nor a hostname"):
        check_host(host, "f", wildcard_ok=True)


@pytest.mark.parametrize("field,value,message", [
    ("transfer.advertise_host", "0.0.0.0", "every interface"),
    ("transfer.advertise_host", "not a host", "neither an IP address"),
    ("transfer.bind_host", "999.1.1.1", "neither an IP address"),
])
def test_cluster_config_names_the_bad_transfer_field(field, value, message):
    with pytest.raises(ConfigError, match=rf"'{field}'.*{message}"):
        load_config(**{field: value})


def test_cluster_config_passes_the_hosts_to_the_workers():
    config = load_config(**{"transfer.advertise_host": "10.0.0.7", "transfer.bind_host": "0.0.0.0"})
    transfer = config.transfer_config()
    assert (transfer.advertise_host, transfer.bind_host) == ("10.0.0.7", "0.0.0.0")
    assert load_config().transfer_config().advertise_host is None


def test_loopback_and_ipv6_formatting():
    assert is_loopback("127.0.0.5") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.1") and not is_loopback("prefill-0")
    assert host_port("fd00::7", 5) == "[fd00::7]:5" and host_port("10.0.0.1", 5) == "10.0.0.1:5"


def test_loopback_is_flagged_only_when_the_ray_cluster_spans_other_hosts():
    assert hosts_that_cannot_reach("127.0.0.1", "127.0.0.1", {"127.0.0.1"}) == []  # one host, several nodes
    assert hosts_that_cannot_reach("127.0.0.1", "10.0.0.2", {"10.0.0.2", "10.0.0.4", "10.0.0.3"}) == \
        ["10.0.0.3", "10.0.0.4"]
    assert hosts_that_cannot_reach("10.0.0.2", "10.0.0.2", {"10.0.0.2", "10.0.0.3"}) == []


# ---- a server on an address the test creates ------------------------------------------------------------

@pytest.fixture(scope="module")
def own_address():
    """An address from the benchmarking range (198.18.0.0/15) on one end of a veth pair made here, removed
    after; traffic to it stays on this host."""
    name = f"tkv{uuid.uuid4().hex[:8]}"
    address = "198.18.211.7"
    made = subprocess.run(["ip", "link", "add", name, "type", "veth", "peer", "name", f"{name}p"],
                          capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a veth pair (needs root and iproute2): {made.stderr.strip()}")
    try:
        subprocess.run(["ip", "addr", "add", f"{address}/32", "dev", name], check=True, capture_output=True)
        subprocess.run(["ip", "link", "set", name, "up"], check=True, capture_output=True)
        yield address
    finally:
        subprocess.run(["ip", "link", "del", name], capture_output=True)


def refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("transport", ["grpc", "torch_dist"])
@pytest.mark.parametrize("bind_host", [None, "0.0.0.0"])
def test_a_server_on_a_non_loopback_address_is_pulled_from_at_its_advertised_address(own_address, transport,
                                                                                      bind_host):
    src = random_cache()
    server = KVTransferServer(src, TOKEN, KVServerConfig(advertise_host=own_address, bind_host=bind_host,
                                                         dist=transport == "torch_dist")).start()
    client = CLIENTS[transport](KVCache(LAYOUT, 64), TOKEN)
    try:
        handle = server.lease("req", [4, 5, 6], [11, 12], 40, Released())
        assert handle.address == f"{own_address}:{server.port}"
        client.pull(handle, [30, 31, 32], [0, 1, 2])
        assert_blocks_equal(src, [4, 5, 6], client.cache, [30, 31, 32])
        store_port = server.dist.store.port if server.dist else None
        if bind_host is None:  # bound to that address only: loopback does not answer
            assert refused("127.0.0.1", server.port)
            assert store_port is None or refused("127.0.0.1", store_port)
        else:
            assert not refused("127.0.0.1", server.port)
    finally:
        client.close()
        server.stop()


def test_a_bind_host_that_is_not_this_hosts_is_a_clear_error():
    with pytest.raises(OSError, match="cannot listen on 203.0.113.77"):
        KVTransferServer(random_cache(), TOKEN, KVServerConfig(advertise_host="203.0.113.77"))
