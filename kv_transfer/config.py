"""How workers move KV between pools (shared by prefill and decode workers and the cluster config)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class TLSFiles:
    """PEM files for TLS on the gRPC KV transport (kv_transfer/tls.py): this worker's certificate and key,
    the CA that signed its peers' (None: the system's roots); `mutual` also makes servers require client
    certificates; `server_name` is the name clients expect in the server's certificate (None: its address)."""
    cert_file: str
    key_file: str
    ca_file: str | None = None
    mutual: bool = False
    server_name: str | None = None


@dataclass(slots=True)
class TransferConfig:
    """`backend` grpc works on any network; torch_dist uses NCCL on GPUs and Gloo on CPUs.

    `layerwise`: the prefill worker leases a request's blocks when its last prompt chunk is scheduled and
    marks layers ready as the forward passes them, so decode pulls while prefill still runs.

    `advertise_host` is the address a prefill worker's KV server puts into its handles (None: the node's IP
    as Ray sees it); `bind_host` is where it listens (None: the advertised address). Each worker resolves
    them on its own node (kv_transfer/addresses.py), where TANDEM_KV_ADVERTISE_HOST / TANDEM_KV_BIND_HOST
    override them.

    `shared_memory` (grpc, CPU): a prefill worker keeps its KV cache in shared memory and a decode worker on
    the same host copies leased blocks straight out of it (kv_transfer/shm.py); across hosts gRPC as ever."""
    backend: Literal["grpc", "torch_dist"] = "grpc"
    token: str = ""
    advertise_host: str | None = None
    bind_host: str | None = None
    lease_ttl_s: float = 30.0
    timeout_s: float = 30.0
    max_workers: int = 8
    layerwise: bool = False
    shared_memory: bool = True
    tls: TLSFiles | None = None
    # Every worker serves its cached prefix blocks to peers, and a decode worker the router points at a peer
    # holding more of a prompt's prefix pulls those blocks instead of computing them (issue 41).
    peer_prefix_pulls: bool = True
