"""KV cache transfer between prefill and decode workers: leases, gRPC and torch.distributed transports.

Prefill side: `KVTransferServer.lease(...)` pins a request's blocks and returns
a `KVHandle`. Decode side: `plan_import` decides which blocks to pull, a
client (`make_client(handle.transport, ...)`) pulls them into the local cache,
then `release(handle)` lets the prefill worker free them.
"""
from kv_transfer.handle import (KVAuthError, KVChecksumError, KVHandle, KVLayoutMismatchError,
                                KVLeaseNotFoundError, KVTransferError, PullStats)
from kv_transfer.server import KVServerConfig, KVTransferServer

__all__ = ["KVAuthError", "KVChecksumError", "KVHandle", "KVLayoutMismatchError", "KVLeaseNotFoundError",
           "KVServerConfig", "KVTransferError", "KVTransferServer", "PullStats"]
