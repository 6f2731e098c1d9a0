"""A local Ray instance never outlives the `tandem serve` that started it.

`tandem serve` marks its environment (Ray's processes inherit it) and starts this module as a watchdog in a
session of its own, holding the only writer of the watchdog's stdin. However `tandem serve` ends, kill -9
included, the watchdog then reads end of file and kills every process that still carries the marker: Ray's
worker processes, each in a process group of its own, are by then children of init and found through /proc.
Kept free of heavy imports: it waits beside the server for its whole life.

    python -m cluster.local_ray_watchdog MARKER
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

MARKER_ENV = "TANDEM_SERVE_ID"
_watchdogs: list[subprocess.Popen] = []  # their stdin pipes stay open for the life of this process


def start_watchdog() -> str:
    """Start the watchdog for this process, then mark this process's environment; returns the marker."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
    _watchdogs.append(subprocess.Popen([sys.executable, "-m", __name__, marker], stdin=subprocess.PIPE, env=env,
                                       stdout=subprocess.DEVNULL, start_new_session=True))
    os.environ[MARKER_ENV] = marker
    return marker


def kill_marked(marker: str, name: str = MARKER_ENV) -> list[int]:
    """SIGKILL every process but this one whose environment has name=marker; returns their pids."""
    pids = marked_processes(marker, name)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return pids


def marked_processes(marker: str, name: str = MARKER_ENV) -> list[int]:
    """Processes other than this one whose environment has name=marker."""
    needle = b"\0" + f"{name}={marker}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = b"\0" + f.read() + b"\0"
        except OSError:
            continue
        if needle in environ:
            found.append(int(entry))
    return found


def main(marker: str) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hang-up is for the server
        signal.signal(signum, signal.SIG_IGN)
    sys.stdin.buffer.read()
    # Sweep until a few sweeps in a row find nothing: a process forked while a sweep ran escapes it.
    deadline, quiet = time.monotonic() + 30, 0
    while quiet < 3 and time.monotonic() < deadline:
        quiet = 0 if kill_marked(marker) else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
