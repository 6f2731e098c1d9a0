"""Log lines about a request name it: the request id (the client's X-Request-Id, or the ingress's) is set
in a context variable where a request's work starts (the ingress route, a worker's prefill or generate
call), and every log record made in that context carries it as `record.tandem_request_id` (not `request_id`: Ray Serve logs its own under that name) and leads its message
with `[request_id]`, whatever handlers and formatters the process (Ray's, Serve's) installed."""
from __future__ import annotations

import logging
from contextvars import ContextVar

REQUEST_ID: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)


def set_request_id(request_id: str | None) -> None:
    """Name the current task's request in its log lines (each asyncio task has its own context)."""
    REQUEST_ID.set(request_id)


def install_request_log_records() -> None:
    """Make this process's log records carry the current request id (once per process)."""
    factory = logging.getLogRecordFactory()
    if getattr(factory, "tandem_request_ids", False):
        return

    def record(*args, **kwargs) -> logging.LogRecord:
        out = factory(*args, **kwargs)
        out.tandem_request_id = REQUEST_ID.get()
        if out.tandem_request_id is not None:
            out.msg = f"[{out.tandem_request_id}] {out.msg}"
        return out

    record.tandem_request_ids = True
    logging.setLogRecordFactory(record)
