"""What a prefill worker hands to a decode worker so that it can pull a request's KV blocks."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from engine.kv_cache import KVLayout
    from kv_transfer.shm import ShmSource

Transport = Literal["grpc", "torch_dist"]


@dataclass(frozen=True, slots=True)
class KVHandle:
    """A leased request's KV on a prefill worker; picklable, so it travels through Ray.

    `block_hashes` covers the full blocks only: the last, partial block of a
    prompt has no hash and is always pulled. The auth token is not part of it.
    """
    transport: Transport
    address: str  # host:port of the prefill worker's KV transfer server
    request_id: str
    num_tokens: int
    block_hashes: tuple[int, ...]
    layout: KVLayout
    shm: ShmSource | None = None  # a CPU prefill worker's shared cache: same-host pulls copy from it
    lora_key: str | None = None  # the LoRA adapter the KV was computed with (engine/lora.py); None: the base model

    @property
    def num_blocks(self) -> int:
        return -(-self.num_tokens // self.layout.block_size)


@dataclass(frozen=True, slots=True)
class PullStats:
    """What one pull moved: payload bytes (checksummed data, no framing), chunks and wall time; `path`
    "shm" when it was copied from the prefill worker's shared cache (its lease is then released too)."""
    num_bytes: int
    num_chunks: int
    seconds: float
    path: str = "network"

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class KVTransferError(RuntimeError):
    """A pull failed; the destination blocks hold no usable data and must be freed by the caller.

    `reason` is one of kv_transfer.failures.FAILURE_REASONS (what the failure is counted as)."""
    reason = "other"

    def __init__(self, message: str = "", reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class KVAuthError(KVTransferError):
    """The server refused the shared token (UNAUTHENTICATED)."""
    reason = "unauthenticated"


class KVLayoutMismatchError(KVTransferError):
    """The two peers' KV layouts differ (model, dtype, block size or shape)."""
    reason = "layout_mismatch"


class KVLeaseNotFoundError(KVTransferError):
    """The request's lease expired, was released, or never existed."""
    reason = "lease_expired"


class KVChecksumError(KVTransferError):
    """A chunk's payload did not match its checksum."""
    reason = "checksum"
