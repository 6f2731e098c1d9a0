"""Where a prefill worker's KV server listens, and the address its handles carry to other nodes.

The advertised address goes into every KVHandle and ConnectResponse, so decode
workers on other hosts must be able to reach it: by default it is the node's IP
as Ray sees it, overridden by config (`transfer.advertise_host`) or, per node,
by the worker's environment (TANDEM_KV_ADVERTISE_HOST, e.g. a pod's IP). The
server binds the advertised address itself unless told otherwise
(`transfer.bind_host` / TANDEM_KV_BIND_HOST; "0.0.0.0" listens everywhere), so a
single-host cluster whose Ray node is 127.0.0.1 stays on loopback.
"""
from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

ADVERTISE_HOST_ENV = "TANDEM_KV_ADVERTISE_HOST"
BIND_HOST_ENV = "TANDEM_KV_BIND_HOST"

_HOSTNAME = re.compile(r"^(?=.{1,253}$)(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?$")


def check_host(value: str, field: str, *, wildcard_ok: bool) -> str:
    """`value` if it is an IP address or a hostname (a wildcard only if `wildcard_ok`); else a ValueError
    that names `field`."""
    host = value.strip()
    if host.startswith("[") and host.endswith("]"):  # "[::1]", as in URLs
        host = host[1:-1]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise ValueError(f"{field}: {value!r} is neither an IP address nor a hostname") from None
        return host
    if ip.is_unspecified and not wildcard_ok:
        raise ValueError(f"{field}: {value!r} means every interface, which no peer can connect to; "
                         "advertise this node's routable address (or leave it unset for Ray's node IP)")
    return host


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost: addresses that mean this host only."""
    if host.lower().rstrip(".") in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(host: str, port: int) -> str:
    """"host:port", with an IPv6 address in brackets (as gRPC targets and handles want it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass(frozen=True, slots=True)
class KVAddresses:
    """`advertise_host` goes into handles; `bind_host` is where the KV server and its TCPStore listen."""
    advertise_host: str
    bind_host: str


def resolve_kv_addresses(advertise_host: str | None, bind_host: str | None, node_ip: str,
                         environ: Mapping[str, str] = os.environ) -> KVAddresses:
    """The worker's KV addresses: its environment wins over the config, which wins over Ray's node IP;
    the bind address defaults to the advertised one. Raises ValueError naming the bad setting."""
    if environ.get(ADVERTISE_HOST_ENV, "").strip():
        advertise = check_host(environ[ADVERTISE_HOST_ENV], ADVERTISE_HOST_ENV, wildcard_ok=False)
    elif advertise_host:
        advertise = check_host(advertise_host, "transfer.advertise_host", wildcard_ok=False)
    else:
        advertise = check_host(node_ip, "Ray's node IP address", wildcard_ok=False)
    if environ.get(BIND_HOST_ENV, "").strip():
        bind = check_host(environ[BIND_HOST_ENV], BIND_HOST_ENV, wildcard_ok=True)
    elif bind_host:
        bind = check_host(bind_host, "transfer.bind_host", wildcard_ok=True)
    else:
        bind = advertise
    return KVAddresses(advertise, bind)


def hosts_that_cannot_reach(advertise_host: str, node_ip: str, cluster_node_ips: set[str]) -> list[str]:
    """The other hosts of the Ray cluster (by node IP) that cannot reach a loopback `advertise_host`; empty
    when it is routable or every node is this host."""
    if not is_loopback(advertise_host):
        return []
    return sorted(cluster_node_ips - {node_ip})
