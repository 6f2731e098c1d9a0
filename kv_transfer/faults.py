"""Test-only fault injection in the KV export server: chosen pulls fail the way a bad link or peer fails them.

A server with a FaultInjector (`KVServerConfig.faults`; a prefill worker whose environment sets
TANDEM_KV_FAULTS, e.g. "corrupt=0.05,stall=0.02,seed=7", gets one) picks a fault, or none, for each
pull, and the fault happens on that pull's real transport:

- "corrupt": the first chunk's payload leaves with one bit flipped after its checksum was taken;
- "stall": after the first chunk the server sends nothing more until the client's deadline ends the call;
- "drop": after the first chunk the data connection breaks: torch.distributed aborts the pair's process
  group under the receiver; gRPC ends the call UNAVAILABLE (a socket that really drops is tested with a
  proxy in tests/test_kv_transfer_faults.py);
- "expire": the lease expires as the pull opens, as if its TTL had run out.

A decode worker counts each as a failed pull (checksum, timeout, peer_gone, lease_expired) and
recomputes the prompt locally.
"""
from __future__ import annotations

import logging
import os
import random
import threading
from collections import deque

import grpc
import torch

logger = logging.getLogger(__name__)

FAULTS = ("corrupt", "stall", "drop", "expire")
ENV = "TANDEM_KV_FAULTS"


class FaultInjector:
    """Which pulls fail, and how: queued faults first (`inject`), then each fault at its rate (seeded)."""

    def __init__(self, rates: dict[str, float] | None = None, seed: int = 0):
        rates = dict(rates or {})
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown KV transfer faults {sorted(unknown)}; known: {', '.join(FAULTS)}")
        if any(not 0 <= p <= 1 for p in rates.values()) or sum(rates.values()) > 1:
            raise ValueError("fault rates must be in [0, 1] and sum to at most 1")
        self.rates = rates
        self.injected = dict.fromkeys(FAULTS, 0)
        self._queued: deque[str] = deque()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector TANDEM_KV_FAULTS describes ("fault=rate,...,seed=N"), or None when it is unset."""
        spec = os.environ.get(ENV, "").strip()
        if not spec:
            return None
        try:
            pairs = dict(item.split("=", 1) for item in spec.split(",") if item.strip())
            seed = int(pairs.pop("seed", 0))
            injector = cls({k.strip(): float(v) for k, v in pairs.items()}, seed)
        except ValueError as err:
            raise ValueError(f"{ENV}={spec!r}: {err} (expected e.g. 'corrupt=0.05,drop=0.02,seed=1')") from None
        logger.warning("KV transfer fault injection is on (%s=%s): for tests only", ENV, spec)
        return injector

    def inject(self, fault: str, times: int = 1) -> None:
        """The next `times` pulls fail with `fault`."""
        if fault not in FAULTS:
            raise ValueError(f"unknown KV transfer fault {fault!r}; known: {', '.join(FAULTS)}")
        with self._lock:
            self._queued.extend([fault] * times)

    def pick(self) -> str | None:
        """The fault of the pull that opens now (None: it runs normally)."""
        with self._lock:
            fault = self._queued.popleft() if self._queued else self._by_rate()
            if fault is not None:
                self.injected[fault] += 1
            return fault

    def _by_rate(self) -> str | None:
        draw = self._rng.random()
        for fault, rate in self.rates.items():
            if draw < rate:
                return fault
            draw -= rate
        return None


def corrupted(segments: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of a chunk's payload segments with one bit flipped (the checksum is taken from the original)."""
    copy = [s.clone() for s in segments]
    copy[-1].view(-1).view(torch.uint8)[0] ^= 0x10
    return copy


def fail_mid_pull(fault: str, context: grpc.ServicerContext) -> None:
    """After the first chunk went out: "stall" sends nothing more until the client gives up (its deadline)
    or cancels; "drop" ends the call as a broken connection would."""
    if fault == "drop":
        context.abort(grpc.StatusCode.UNAVAILABLE, "injected fault: the connection dropped mid-pull")
    ended = threading.Event()
    if context.add_callback(ended.set):
        remaining = context.time_remaining()
        ended.wait(remaining + 5.0 if remaining is not None else 600.0)
