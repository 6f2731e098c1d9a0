"""Request ids and stage timelines at the ingress.

Every request gets an id: the client's `X-Request-Id` when it sends a valid one (1 to 128 printable ASCII
characters, no spaces), else one made here; it comes back in the `X-Request-Id` response header and is
carried to every worker in the request's timeline (engine/timeline.py). A client that sends
`X-Tandem-Trace: 1` gets the timelines in the response: a `tandem` field in the JSON body, or in the last
chunk of a stream. The last `recent_requests` timelines stay in a `TraceStore` (router/trace_store.py)
for `tandem trace`.
"""
from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from engine.timeline import RequestTimeline
from worker_runtime.tracing import end_request_span, start_request_span
from router.api.openai_api import APIError

REQUEST_ID_HEADER = "X-Request-Id"
TRACE_HEADER = "X-Tandem-Trace"
DEADLINE_HEADER = "X-Tandem-Deadline-Ms"  # the request's own TTFT deadline, for flow control's shedding
MAX_DEADLINE_MS = 86_400_000
MAX_REQUEST_ID_LENGTH = 128
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


@dataclass(slots=True)
class Trace:
    """The ingress's side of one request's tracing: its timeline (from arrival on), whether the client asked
    for it in the response, and whether it reached the store yet."""
    timeline: RequestTimeline
    requested: bool = False
    stored: bool = False
    span: object | None = None  # its OpenTelemetry span while tracing is on (worker_runtime/tracing.py)
    deadline_s: float | None = None  # X-Tandem-Deadline-Ms: its first token is worth nothing later than this

    @property
    def request_id(self) -> str:
        return self.timeline.request_id

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> Trace:
        """At arrival: the request's id and trace flag from its headers (400 naming a bad header)."""
        timeline = RequestTimeline("")  # stamps the arrival before anything is checked
        timeline.request_id = request_id_from(headers)
        trace = cls(timeline, trace_requested(headers), deadline_s=deadline_from(headers))
        trace.span = start_request_span(timeline)
        return trace

    def failed(self, error: str) -> None:
        """The request ended before it ran (refused, invalid, no worker): its span ends with the error."""
        if not self.stored:
            self.stored = True
            end_request_span(self.span, [self.timeline], error)


def request_id_from(headers: Mapping[str, str]) -> str:
    """The client's X-Request-Id, checked; a new one when it sent none."""
    given = headers.get(REQUEST_ID_HEADER)
    if given is None:
        return uuid.uuid4().hex
    if not 0 < len(given) <= MAX_REQUEST_ID_LENGTH or not all("!" <= c <= "~" for c in given):
        raise APIError.bad_request(f"the {REQUEST_ID_HEADER} header must be 1 to {MAX_REQUEST_ID_LENGTH} printable "
                                   f"ASCII characters without spaces", REQUEST_ID_HEADER)
    return given


def deadline_from(headers: Mapping[str, str]) -> float | None:
    """The client's X-Tandem-Deadline-Ms in seconds (a whole number of milliseconds, 1 to a day), or None."""
    value = headers.get(DEADLINE_HEADER)
    if value is None:
        return None
    text = value.strip()
    if not text.isdigit() or not 0 < int(text) <= MAX_DEADLINE_MS:
        raise APIError.bad_request(f"the {DEADLINE_HEADER} header must be a whole number of milliseconds from 1 to "
                                   f"{MAX_DEADLINE_MS}", DEADLINE_HEADER)
    return int(text) / 1000


def trace_requested(headers: Mapping[str, str]) -> bool:
    """Whether the client asked for the timeline in the response (`X-Tandem-Trace: 1`)."""
    value = headers.get(TRACE_HEADER)
    if value is None or value.strip().lower() in _FALSE:
        return False
    if value.strip().lower() in _TRUE:
        return True
    raise APIError.bad_request(f"the {TRACE_HEADER} header must be 1 or 0 (true or false)", TRACE_HEADER)
