"""A worker's KV export server: prefill workers lease prompts to decode workers through it, and every worker
leases cached prefix blocks to peers that pull them instead of computing them (EngineServer.lease_prefix)."""
from __future__ import annotations

import logging
import secrets

import ray

from kv_transfer.addresses import KVAddresses, hosts_that_cannot_reach, is_loopback, resolve_kv_addresses
from kv_transfer.config import TransferConfig

logger = logging.getLogger(__name__)


def start_kv_server(cache, transfer: TransferConfig):
    """A started KVTransferServer on `cache` at this node's KV addresses."""
    from kv_transfer.server import KVTransferServer
    from kv_transfer.server_config import KVServerConfig

    addresses = node_kv_addresses(transfer)
    server_config = KVServerConfig(advertise_host=addresses.advertise_host, bind_host=addresses.bind_host,
                                   lease_ttl_s=transfer.lease_ttl_s, max_workers=transfer.max_workers,
                                   dist=transfer.backend == "torch_dist", tls=transfer.tls,
                                   shared_memory=transfer.shared_memory)
    return KVTransferServer(cache, transfer.token or secrets.token_hex(16), server_config).start()


def node_kv_addresses(transfer: TransferConfig) -> KVAddresses:
    """This worker's KV addresses, resolved on its own node (its environment, then the config, then Ray's
    node IP); warns when it would advertise loopback while the Ray cluster spans several hosts."""
    node_ip = ray.util.get_node_ip_address()
    addresses = resolve_kv_addresses(transfer.advertise_host, transfer.bind_host, node_ip)
    if is_loopback(addresses.advertise_host):
        node_ips = {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        others = hosts_that_cannot_reach(addresses.advertise_host, node_ip, node_ips)
        if others:
            logger.warning("this worker advertises its KV server at %s, a loopback address, but the "
                           "Ray cluster has nodes on other hosts (%s) that cannot pull from it; set "
                           "TANDEM_KV_ADVERTISE_HOST or transfer.advertise_host to this node's routable IP",
                           addresses.advertise_host, ", ".join(others))
    return addresses


def make_kv_client(transfer: TransferConfig, cache):
    if transfer.backend == "torch_dist":
        from kv_transfer.dist_client import DistKVClient
        return DistKVClient(cache, transfer.token, timeout_s=transfer.timeout_s, tls=transfer.tls)
    from kv_transfer.grpc_client import GrpcKVClient
    return GrpcKVClient(cache, transfer.token, timeout_s=transfer.timeout_s, tls=transfer.tls,
                        shared_memory=transfer.shared_memory)
