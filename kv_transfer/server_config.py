"""The KV export server's configuration: where it listens and what a caller may ask of it."""
from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer.config import TLSFiles
from kv_transfer.faults import FaultInjector


@dataclass(slots=True)
class KVServerConfig:
    """Where the server listens and how much it accepts; `dist` adds the torch.distributed data plane.

    `advertise_host` goes into every handle (and the TCPStore's address into every ConnectResponse), so it
    must be an address decode workers can reach; `bind_host` (default: the advertised address) is where the
    gRPC server and the TCPStore listen. A prefill worker resolves both on its node (addresses.py).

    gRPC chunks always carry a checksum. Over torch.distributed, host payloads
    carry one unless `dist_checksums` is off (TCP already checks the bytes;
    hashing them costs about a fifth of Gloo's throughput on a 2-core box);
    device payloads (NCCL) never do. A decode client's process group that
    sees no pull for `dist_pair_idle_s` is discarded (the client reconnects).

    What a caller may ask for is bounded, so that no request can make the server plan or hold more than
    its lease: requests are at most `max_request_bytes`, a pull names at most `max_blocks_per_pull`
    distinct block indices, and chunks are at least MIN_CHUNK_BYTES. `faults` is for tests only
    (faults.py); by default it comes from TANDEM_KV_FAULTS, unset in production.
    """
    advertise_host: str = "127.0.0.1"
    bind_host: str | None = None
    port: int = 0
    max_workers: int = 16
    max_message_bytes: int = 16 << 20
    max_request_bytes: int = 1 << 20
    max_blocks_per_pull: int = 1 << 16
    lease_ttl_s: float = 30.0
    dist: bool = False
    dist_timeout_s: float = 30.0
    dist_checksums: bool = True
    dist_pair_idle_s: float = 600.0
    tls: TLSFiles | None = None  # serve TLS only (kv_transfer/tls.py)
    # Handles name the cache's memfd when it has one (a CPU prefill worker's): a decode worker on the same
    # host copies from it (kv_transfer/shm.py). Off with torch_dist, and while faults are injected, which
    # act on the network path.
    shared_memory: bool = True
    faults: FaultInjector | None = field(default_factory=FaultInjector.from_env)


MAX_ID_CHARS = 256  # request and pair ids; theirs are uuid-sized
