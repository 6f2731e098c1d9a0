"""KV cache transfer between prefill and decode workers: leases, gRPC and torch.distributed transports.

Prefill side: `KVTransferServer.lease(...)` pins a request's blocks and returns
a `KVHandle`. Decode side: the engine's `reserve_for_import` decides which
blocks to pull (those its prefix cache lacks), a `GrpcKVClient` or `DistKVClient` (as
`handle.transport` says) pulls them into the local cache, and
`client.release(handle)` lets the prefill worker free them.

The names below load on first use (PEP 562): config validation imports `kv_transfer.addresses` and
`kv_transfer.tls` without loading torch.
"""
import importlib

_EXPORTS = {**dict.fromkeys(("KVAuthError", "KVChecksumError", "KVHandle", "KVLayoutMismatchError",
                             "KVLeaseNotFoundError", "KVTransferError", "PullStats"), "kv_transfer.handle"),
            **dict.fromkeys(("KVServerConfig", "KVTransferServer"), "kv_transfer.server")}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'kv_transfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
