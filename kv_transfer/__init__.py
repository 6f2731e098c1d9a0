"""KV cache transfer between prefill and decode workers: leases, gRPC and torch.distributed transports.

Prefill side: `KVTransferServer.lease(...)` pins a request's blocks and returns
a `KVHandle`. Decode side: the engine's `reserve_for_import` decides which
blocks to pull (those its prefix cache lacks), a `GrpcKVClient` or `DistKVClient` (as
`handle.transport` says) pulls them into the local cache, and
`client.release(handle)` lets the prefill worker free them.
"""
from kv_transfer.handle import (KVAuthError, KVChecksumError, KVHandle, KVLayoutMismatchError,
                                KVLeaseNotFoundError, KVTransferError, PullStats)
from kv_transfer.server import KVServerConfig, KVTransferServer

__all__ = ["KVAuthError", "KVChecksumError", "KVHandle", "KVLayoutMismatchError", "KVLeaseNotFoundError",
           "KVServerConfig", "KVTransferError", "KVTransferServer", "PullStats"]
