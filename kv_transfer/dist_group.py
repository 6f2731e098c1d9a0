"""Two-rank torch.distributed process groups, one per (prefill, decode) pair.

Each pair gets its own group built straight from a `TCPStore` (hosted by the
prefill side's KV server) under a per-pair key prefix, never the global
default group, so pairs come and go independently. NCCL on CUDA caches,
Gloo on CPU caches: the same code path runs in CPU tests.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

SENDER_RANK = 0
RECEIVER_RANK = 1


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def local_address_toward(host: str) -> str:
    """The local IP that routes to `host` (what the peer can reach us on); no packet is sent."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return probe.getsockname()[0]


def open_store(host: str, port: int, is_master: bool, timeout_s: float) -> dist.TCPStore:
    """Connect to the store at host:port (clients)."""
    return dist.TCPStore(host, port, None, is_master, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def host_store(advertise_host: str, bind_host: str, timeout_s: float) -> dist.TCPStore:
    """Host a store listening on `bind_host` (a free port), reached at `advertise_host`.

    TCPStore alone listens on every interface; handing it a socket we bound keeps it where we were told.
    """
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.bind((bind_host, 0))
        listener.listen(128)
        port = listener.getsockname()[1]
        store = dist.TCPStore(advertise_host, port, None, True, timeout=timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return store


def pair_group(backend: str, store: dist.Store, pair_id: str, rank: int, timeout_s: float,
               local_host: str, device: torch.device) -> dist.ProcessGroup:
    """Join the pair's group; blocks until both ranks have joined (or the timeout)."""
    prefixed = dist.PrefixStore(f"kv_pair/{pair_id}/", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def abort_group(group: dist.ProcessGroup) -> None:
    """Fail the group's pending sends/recvs so that no buffer is touched after we give it up."""
    try:
        group.abort()
    except RuntimeError:  # a group that already failed may refuse to abort; it is unusable either way
        pass
