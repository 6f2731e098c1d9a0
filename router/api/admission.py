"""Admission: a bounded number of sequences in flight per ingress replica; beyond it, 429."""
from __future__ import annotations

from router.api.openai_api import APIError


class Admission:
    """Counts admitted sequences (a request with n candidates takes n). Nothing queues here: a request
    that does not fit is refused at once with Retry-After, so memory stays bounded under overload."""

    def __init__(self, max_in_flight: int, rejected=None, retry_after_s: int = 1):
        self.max_in_flight = max_in_flight
        self.rejected = rejected  # a prometheus counter, incremented per refusal
        self.retry_after_s = retry_after_s
        self.in_flight = 0

    def acquire(self, num_sequences: int) -> Ticket:
        """Take `num_sequences` slots; raises a 429 APIError when they are not free, and a 400 when they
        never could be (retrying would not help)."""
        if num_sequences > self.max_in_flight:
            raise APIError.bad_request(f"the request asks for {num_sequences} sequences (n x prompts); this "
                                       f"server runs at most {self.max_in_flight} at a time", "n")
        if self.in_flight + num_sequences > self.max_in_flight:
            if self.rejected is not None:
                self.rejected.inc()
            raise APIError(429, f"too many requests in flight ({self.in_flight} of {self.max_in_flight} "
                                f"sequences); retry after {self.retry_after_s}s", type="rate_limit_exceeded",
                           code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s)})
        self.in_flight += num_sequences
        return Ticket(self, num_sequences)


class Ticket:
    """Admitted slots; `release` is idempotent so every exit path may call it."""

    __slots__ = ("admission", "num_sequences", "on_release")

    def __init__(self, admission: Admission, num_sequences: int):
        self.admission = admission
        self.num_sequences = num_sequences
        self.on_release = None  # called once with the slots (flow control's grant)

    def release(self) -> None:
        self.admission.in_flight -= self.num_sequences
        self.num_sequences = 0
        if self.on_release is not None:
            on_release, self.on_release = self.on_release, None
            on_release()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.release()
