"""Why a KV pull failed, in a small fixed vocabulary, and a per-reason count that logs each cause once.

A failed pull is not an error the client sees (the decode worker recomputes the
prompt), so operators learn of it only from these counts
(`tandem:kv_transfer_failures_total{reason}`) and from one warning per
(reason, prefill address): a peer that is down fails every request, and one
line per request would bury the log.
"""
from __future__ import annotations

import logging
import threading

import grpc

logger = logging.getLogger(__name__)

FAILURE_REASONS = (
    "unreachable",  # no connection to the prefill worker's KV server (refused, no route, bad address)
    "timeout",  # the pull's deadline passed (a slow or silent peer, layers not ready in time)
    "lease_expired",  # the prefill worker no longer holds the request's blocks (TTL, released, restarted)
    "checksum",  # a chunk's payload did not match its checksum
    "layout_mismatch",  # the peers' KV layouts differ (model, dtype, block size)
    "unauthenticated",  # the server refused our shared token
    "peer_gone",  # the connection or process group broke mid-pull
    "overloaded",  # the server refused the call for lack of handler threads
    "no_free_blocks",  # the decode worker had no blocks to pull into
    "other",
)

_STATUS_REASONS = {
    grpc.StatusCode.DEADLINE_EXCEEDED: "timeout",
    grpc.StatusCode.NOT_FOUND: "lease_expired",
    grpc.StatusCode.FAILED_PRECONDITION: "layout_mismatch",
    grpc.StatusCode.UNAUTHENTICATED: "unauthenticated",
    grpc.StatusCode.PERMISSION_DENIED: "unauthenticated",
    grpc.StatusCode.RESOURCE_EXHAUSTED: "overloaded",
    grpc.StatusCode.ABORTED: "peer_gone",
    grpc.StatusCode.CANCELLED: "peer_gone",
}
# UNAVAILABLE means either no connection was made, or one broke; gRPC tells them apart only in its text.
_NOT_CONNECTED = ("failed to connect", "connection refused", "no route to host", "network is unreachable",
                  "dns resolution failed", "name or service not known", "connect failed", "failed to resolve")


def failure_reason(err: BaseException) -> str:
    """The reason (one of FAILURE_REASONS) for a failed pull's exception: a KVTransferError's own, a gRPC
    status, or an error from a socket or torch.distributed process group."""
    reason = getattr(err, "reason", None)
    if reason in FAILURE_REASONS:
        return reason
    if isinstance(err, grpc.RpcError) and hasattr(err, "code"):
        code = err.code()
        if code == grpc.StatusCode.UNAVAILABLE:
            details = (err.details() or "").lower()
            return "unreachable" if any(s in details for s in _NOT_CONNECTED) else "peer_gone"
        return _STATUS_REASONS.get(code, "other")
    text = str(err).lower()
    if isinstance(err, TimeoutError) or "timed out" in text or "timeout" in text:
        return "timeout"
    if isinstance(err, ConnectionRefusedError) or any(s in text for s in _NOT_CONNECTED):
        return "unreachable"
    if isinstance(err, (ConnectionError, RuntimeError)) and any(
            s in text for s in ("connection closed", "connection reset", "broken pipe", "closed by peer")):
        return "peer_gone"
    return "other"


class TransferFailures:
    """Failed pulls per reason. The first failure of each (reason, peer address) is logged as a warning;
    later ones are only counted. Thread-safe."""

    def __init__(self, owner: str):
        self.owner = owner
        self.counts = dict.fromkeys(FAILURE_REASONS, 0)
        self._logged: set[tuple[str, str]] = set()
        self._lock = threading.Lock()

    def record(self, reason: str, peer: str, detail: str) -> None:
        """Count one fallback to local recompute; `peer` is the prefill worker's KV address."""
        reason = reason if reason in self.counts else "other"
        with self._lock:
            self.counts[reason] += 1
            first = (reason, peer) not in self._logged
            self._logged.add((reason, peer))
        if first:
            logger.warning("%s: KV pulls from %s fail (%s: %s); recomputing locally. Later %s failures from "
                           "this peer are only counted in tandem:kv_transfer_failures_total",
                           self.owner, peer or "-", reason, detail, reason)
        else:
            logger.debug("%s: KV pull from %s failed (%s: %s)", self.owner, peer or "-", reason, detail)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)
