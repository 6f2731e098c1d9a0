"""Collectives through shared memory for CPU ranks on one node, as vLLM's CPU backend does (its SHM all-reduce):
a Gloo all-reduce over loopback TCP costs about a millisecond, and a decode step of a 30-layer model makes 61 of
them, which made TP=2 four times slower than TP=1 (bench/HISTORY.md, "Tensor parallelism on CPU"). The step
plans (rank 0's broadcast) and the logits (gathered to rank 0) go the same way.

Each rank copies its tensor into its slot of a shared buffer, publishes the call's sequence number in its flag,
spins until every rank's flag has reached it, then sums the slots in rank order (so every rank computes the same
sum, bit for bit). Two buffers alternate by sequence parity: a rank can run at most one call ahead of the slowest
(it cannot leave call s before every rank has entered it), so the buffer it writes is never one still being read.
This relies on x86's store order (a slot written, then its flag, is seen in that order; the copy's threads have
joined before the flag is written): `supported()` is False elsewhere, and the ranks use their process group."""
from __future__ import annotations

import platform
import time
from collections.abc import Callable
from multiprocessing import shared_memory

import numpy as np
import torch

FLAG_BYTES = 64  # one cache line per rank's flag
SPIN_CHECKS = 1 << 14  # polls before a waiting rank starts to sleep between them
IDLE_POLL_S = 0.0002


def supported() -> bool:
    """Whether this CPU keeps stores in order as the flags need (x86-64); weaker orders would need barriers."""
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmCollectives:
    """`size` ranks' shared buffers for tensors of up to `max_bytes`; rank 0 creates them (`name` None), the others
    attach by name. `all_reduce(t)` sums t over the ranks in place, `gather_to_first` and `broadcast` carry the
    logits and the step plans; what is larger goes over the process group (False / None back, counted in
    `too_large`). Every rank makes the same calls in the same order, so their sequence numbers agree."""

    def __init__(self, name: str | None, rank: int, size: int, max_bytes: int,
                 alive: Callable[[], bool] = lambda: True):
        self.rank, self.size, self.max_bytes = rank, size, max_bytes
        self.alive = alive  # whether the other ranks can still arrive (checked every few ms while spinning)
        total = size * FLAG_BYTES + 2 * size * max_bytes
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=total if name is None else 0)
        self.owner = name is None
        self.name = self.shm.name
        buf = self.shm.buf
        self.flags = np.ndarray((size, FLAG_BYTES // 8), dtype=np.int64, buffer=buf)
        if self.owner:
            self.flags[:] = 0
        self.data = torch.frombuffer(buf, dtype=torch.uint8, offset=size * FLAG_BYTES,
                                     count=2 * size * max_bytes).view(2, size, max_bytes)
        self.seq = 0
        self.too_large = 0  # calls over max_bytes, left to the process group

    def all_reduce(self, tensor: torch.Tensor, timeout_s: float = 600.0) -> bool:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_bytes:
            self.too_large += 1
            return False
        seq = self.seq + 1
        slots = self.data[seq & 1, :, :nbytes].view(tensor.dtype).view(self.size, *tensor.shape)
        self._publish(tensor.contiguous().view(torch.uint8).view(-1), nbytes)
        for other in range(self.size):
            if other != self.rank:
                self._wait(other, seq, timeout_s)
        torch.sum(slots, dim=0, out=tensor)
        return True

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None | bool:
        """Rank 0 gets every rank's `tensor` (copies, in rank order), the others None; False when too large.
        Only rank 0 waits: the next call is always rank 0's `broadcast`, which no rank can pass before rank 0
        has read every slot of this one."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_bytes:
            self.too_large += 1
            return False
        seq = self._publish(tensor.contiguous().view(torch.uint8).view(-1), nbytes)
        if self.rank:
            return None
        for other in range(1, self.size):
            self._wait(other, seq)
        return [self.data[seq & 1, r, :nbytes].view(tensor.dtype).view(tensor.shape).clone() for r in range(self.size)]

    def broadcast(self, payload: bytes | None) -> bytes | None:
        """Rank 0 sends `payload`; every rank returns it. None from a rank other than 0: rank 0 sent it over the
        process group instead (over max_bytes), and so must they receive it."""
        if self.rank == 0:
            n = len(payload)
            fits = n <= self.max_bytes
            if fits:
                self.data[(self.seq + 1) & 1, 0, :n].copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
            else:
                self.too_large += 1
            self.flags[0, 1] = n if fits else -1
            self.seq += 1
            self.flags[0, 0] = self.seq
            return payload if fits else None
        self.seq += 1
        self._wait(0, self.seq, None)  # rank 0 may idle between steps for as long as nobody sends requests
        n = int(self.flags[0, 1])
        return None if n < 0 else self.data[self.seq & 1, 0, :n].numpy().tobytes()

    def _publish(self, data: torch.Tensor, nbytes: int) -> int:
        self.seq += 1
        self.data[self.seq & 1, self.rank, :nbytes].copy_(data)
        self.flags[self.rank, 0] = self.seq
        return self.seq

    def _wait(self, other: int, seq: int, timeout_s: float | None = 600.0) -> None:
        """Spin until rank `other` has reached call `seq`: within a step the wait is a layer's imbalance, well
        under a millisecond. Past SPIN_CHECKS polls (a few ms: rank 0 is idle between steps) it sleeps between
        polls instead, so that an idle engine's ranks do not each hold a core."""
        flags, spins, deadline = self.flags, 0, None
        while flags[other, 0] < seq:
            spins += 1
            if spins >= SPIN_CHECKS:
                time.sleep(IDLE_POLL_S)
            if spins % SPIN_CHECKS == 0 or spins > SPIN_CHECKS and spins % 256 == 0:
                now = time.monotonic()
                deadline = deadline or now + (timeout_s if timeout_s is not None else float("inf"))
                if now > deadline or not self.alive():
                    raise RuntimeError(f"shared memory: rank {other} did not arrive "
                                       f"({'it is gone' if now <= deadline else f'within {timeout_s:.0f}s'})")

    def close(self) -> None:
        del self.flags, self.data
        try:
            self.shm.close()
            if self.owner:
                self.shm.unlink()
        except (BufferError, FileNotFoundError):  # a view still alive, or already unlinked: the OS reclaims it
            pass
