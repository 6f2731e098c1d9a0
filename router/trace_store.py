"""Recent requests' stage timelines, kept for `tandem trace` (by each ingress replica, and by the metrics
hub for all of them)."""
from __future__ import annotations

from collections import OrderedDict

from engine.timeline import RequestTimeline


def timeline_body(request_id: str, timelines: list[RequestTimeline]) -> dict:
    """What `tandem trace` and the `tandem` response field show: one timeline per prompt (and per
    candidate run alone) of the request."""
    return {"request_id": request_id, "timelines": [t.to_dict() for t in timelines]}


class TraceStore:
    """The last `capacity` finished requests' entries (their timelines), by request id (a client that reuses
    an id finds its latest request). `take_unshared` hands out, once each, the ids added since."""

    def __init__(self, capacity: int = 1000):
        self.capacity = capacity
        self._requests: OrderedDict[str, object] = OrderedDict()
        self._unshared: list[str] = []

    def add(self, request_id: str, entry) -> None:
        if self.capacity <= 0:
            return
        self._requests.pop(request_id, None)
        self._requests[request_id] = entry
        while len(self._requests) > self.capacity:
            self._requests.popitem(last=False)
        self._unshared.append(request_id)
        del self._unshared[:-self.capacity]

    def get(self, request_id: str):
        return self._requests.get(request_id)

    def take_unshared(self) -> list[tuple[str, object]]:
        ids, self._unshared = self._unshared, []
        return [(rid, self._requests[rid]) for rid in ids if rid in self._requests]

    def __len__(self) -> int:
        return len(self._requests)
