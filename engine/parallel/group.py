"""The ranks' process group: built straight from a TCPStore that rank 0 hosts (never torch's global default group,
which a worker's KV transfer may use for its own pairs), Gloo on CPU and NCCL on CUDA, with the few collectives a
sharded forward needs and a broadcast of pickled objects for the step plans."""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.errors import RankFailed

# A rank that waits longer than this for a collective gives up. The other ranks wait for rank 0's next plan for
# as long as the engine idles, so this is long; a rank that dies is noticed at once (its connections close, or
# the shared-memory wait checks it), and a stuck step is the worker's stall watchdog's (PoolConfig.stall_timeout_s).
DEFAULT_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(frozen=True, slots=True)
class GroupAddress:
    """Where the ranks meet: rank 0's store."""
    host: str
    port: int
    size: int


class TPGroup:
    """One rank's handle on the group of `size` ranks."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup, store: dist.TCPStore,
                 device: torch.device):
        self.rank, self.size, self.group, self.store, self.device = rank, size, group, store, device
        # Rank 0's: which ranks are gone and how (engine/parallel/ranks.py), for the error a failed collective gives.
        self.describe_ranks = lambda: ""
        self.alive = lambda: True  # whether the other ranks still run (rank 0: its processes; others: rank 0)
        self.shm = None  # CPU ranks' shared-memory all-reduce, once attached

    def attach_shared_memory(self, max_bytes: int) -> None:
        """CPU ranks: all-reduce through shared memory for tensors up to `max_bytes` (engine/parallel/shm_collectives.py).
        Rank 0 creates the buffers and publishes their name in the store; the others attach."""
        from engine.parallel.shm_collectives import ShmCollectives, supported

        if self.device.type != "cpu" or self.size == 1 or not supported():
            return
        if self.rank == 0:
            self.shm = ShmCollectives(None, 0, self.size, max_bytes, self.alive)
            self.store.set("tp/shm", self.shm.name)
        else:
            self.shm = ShmCollectives(self.store.get("tp/shm").decode(), self.rank, self.size, max_bytes, self.alive)

    def failed(self, error: BaseException) -> RuntimeError:
        """The error a failed step raises: which ranks are gone, then the collective's own message."""
        gone = self.describe_ranks()
        return RankFailed(f"tensor-parallel group of {self.size} failed{': ' + gone if gone else ''} ({error})")

    @classmethod
    def host(cls, size: int, host: str = "127.0.0.1") -> tuple[dist.TCPStore, GroupAddress]:
        """Rank 0's store, on a free port of `host` (the ranks of a worker share one node)."""
        store = dist.TCPStore(host, 0, None, True, timeout=timedelta(seconds=DEFAULT_TIMEOUT_S),
                              wait_for_workers=False)
        return store, GroupAddress(host, store.port, size)

    @staticmethod
    def connect(address: GroupAddress, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
        """A rank's client of rank 0's store."""
        return dist.TCPStore(address.host, address.port, None, False, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    @classmethod
    def join(cls, address: GroupAddress, rank: int, device: torch.device, store: dist.TCPStore | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> TPGroup:
        """Join the group (blocks until all ranks have); rank 0 passes the store it hosts."""
        if store is None:
            store = cls.connect(address, timeout_s)
        prefixed = dist.PrefixStore("tp/", store)
        timeout = timedelta(seconds=timeout_s)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(prefixed, rank, address.size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=address.host)]
            group = dist.ProcessGroupGloo(prefixed, rank, address.size, options)
        return cls(rank, address.size, group, store, device)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place: through shared memory on CPU, else (or when larger than its
        buffers, counted in `shm.too_large`) over the process group."""
        if self.shm is None or not self.shm.all_reduce(tensor):
            self.group.allreduce([tensor]).wait()
        return tensor

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Rank 0 gets every rank's `tensor` (all of one shape), in rank order; the others get None."""
        if self.shm is not None:
            out = self.shm.gather_to_first(tensor)
            if out is not False:
                return out
        opts = dist.GatherOptions()
        opts.rootRank = 0
        if self.rank == 0:
            out = [[torch.empty_like(tensor) for _ in range(self.size)]]
            self.group.gather(out, [tensor], opts).wait()
            return out[0]
        self.group.gather([], [tensor], opts).wait()
        return None

    def broadcast_object(self, obj=None):
        """Rank 0 sends `obj` (pickled) to every rank; each returns it (NCCL carries the bytes in a device
        buffer, Gloo in a host one)."""
        if self.rank == 0:
            payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            return pickle.loads(self._broadcast_bytes(payload))
        return pickle.loads(self._broadcast_bytes(None))

    def _broadcast_bytes(self, payload: bytes | None) -> bytes:
        if self.shm is not None:
            data = self.shm.broadcast(payload)
            if data is not None:
                return data
        device = self.device if self.device.type == "cuda" else torch.device("cpu")
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        size = torch.tensor([len(payload) if payload is not None else 0], dtype=torch.long, device=device)
        self.group.broadcast([size], opts).wait()
        if payload is not None:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        else:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.group.broadcast([data], opts).wait()
        return payload if payload is not None else data.cpu().numpy().tobytes()

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        try:
            self.group.abort()
        except (RuntimeError, AttributeError):  # a group that failed may refuse to abort; unusable either way
            pass
