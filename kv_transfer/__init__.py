"""KV cache transfer between prefill and decode workers: leases, gRPC and torch.distributed transports.

Prefill side: `KVTransferServer.lease(...)` pins a request's blocks and returns
a `KVHandle`. Decode side: the engine's `reserve_for_import` decides which
blocks to pull (those its prefix cache lacks), a `GrpcKVClient` or `DistKVClient` (as
`handle.transport` says) pulls them into the local cache, and
`client.release(handle)` lets the prefill worker free them.

The names below load on first use: config validation imports `kv_transfer.addresses` and
`kv_transfer.tls` without loading torch.
"""
from engine.lazy_exports import lazy_exports

_EXPORTS = {**dict.fromkeys(("KVAuthError", "KVChecksumError", "KVHandle", "KVLayoutMismatchError",
                             "KVLeaseNotFoundError", "KVTransferError", "PullStats"), "kv_transfer.handle"),
            "KVServerConfig": "kv_transfer.server_config", "KVTransferServer": "kv_transfer.server"}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
