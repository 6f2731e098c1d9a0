"""Where audit records go: JSON lines on stdout or appended to a file, written by a thread of their own.

The event loop only puts a record on a bounded queue; a full queue drops the record, and a failed write
drops it too. Both are counted in `tandem:audit_records_dropped` (by reason) and logged, never raised.
Each line is one write() on a file opened with O_APPEND, so several ingress replicas appending to one
file on one host never interleave within a line; a file moved away (log rotation) is reopened.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import sys
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_STOP = object()
FILE_PREFIX = "file:"


def check_sink(sink: str | None) -> str | None:
    """`sink` if it is None, "stdout" or "file:" and an absolute path; else ValueError saying what fits."""
    if sink is None or sink == "stdout":
        return sink
    if sink.startswith(FILE_PREFIX) and Path(sink[len(FILE_PREFIX):]).is_absolute():
        return sink
    raise ValueError(f"audit sink {sink!r} must be \"stdout\" or \"file:\" followed by an absolute path "
                     f"(e.g. file:/var/log/tandem/audit.jsonl)")


class AuditWriter:
    """Writes records (dicts) as JSON lines to `sink` from a daemon thread; `put` never blocks.
    `written` and `dropped_total` are prometheus counters: records written, and records dropped by reason
    ("queue_full", "write_failed", "build_failed")."""

    def __init__(self, sink: str, max_queue: int, written, dropped_total):
        self.sink = check_sink(sink)
        self.queue: queue.Queue = queue.Queue(max_queue)
        self.written = written
        self.dropped_total = dropped_total
        self._out = _Stdout() if sink == "stdout" else _AppendFile(Path(sink[len(FILE_PREFIX):]))
        self._warned: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="audit-writer", daemon=True)
        self._thread.start()

    def put(self, record: dict) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped("queue_full")

    def dropped(self, reason: str, detail: str = "") -> None:
        self.dropped_total.labels(reason).inc()
        if reason not in self._warned:  # once per reason: a broken disk must not flood the log
            self._warned.add(reason)
            logger.error("audit records are being dropped (%s%s); see tandem:audit_records_dropped", reason,
                         f": {detail}" if detail else "")

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (for up to `timeout_s`), then stop the thread."""
        try:
            self.queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        self._out.close()

    def _run(self) -> None:
        while (record := self.queue.get()) is not _STOP:
            try:
                line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
            except (TypeError, ValueError) as exc:
                self.dropped("build_failed", str(exc))
                continue
            try:
                self._out.write(line.encode())
            except Exception as exc:  # noqa: BLE001 - whatever the sink raises, the thread goes on
                self.dropped("write_failed", f"{type(exc).__name__}: {exc}")
                continue
            self.written.inc()


class _Stdout:
    def write(self, data: bytes) -> None:
        sys.stdout.write(data.decode())  # whatever sys.stdout is now (Ray redirects it to the worker's log)
        sys.stdout.flush()

    def close(self) -> None:
        pass


class _AppendFile:
    """A file opened for appending on first write, and again after a failed write or once the path no
    longer names the open file (rotated or removed)."""

    def __init__(self, path: Path):
        self.path = path
        self.fd: int | None = None
        self.inode: tuple[int, int] | None = None

    def write(self, data: bytes) -> None:
        if self.fd is not None and not self._still_there():
            self.close()
        if self.fd is None:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            st = os.fstat(self.fd)
            self.inode = (st.st_dev, st.st_ino)
        try:
            written = os.write(self.fd, data)
        except OSError:
            self.close()
            raise
        if written != len(data):
            self.close()
            raise OSError(f"short write to {self.path}: {written} of {len(data)} bytes")

    def _still_there(self) -> bool:
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
