"""A local Ray instance never outlives the `tandem serve` that started it.

`tandem serve` marks its environment (Ray's processes inherit it) and starts this module as a watchdog in a
session of its own, holding the only writer of the watchdog's stdin. However `tandem serve` ends, kill -9
included, the watchdog then reads end of file and kills what is left of the server's family: Ray's worker
processes, each in a process group of its own, are by then children of init and found through /proc.

The marker alone does not find them all. A process that sets its title (Ray's dashboard and runtime-env
agents do) overwrites the start of the memory /proc/PID/environ shows, and where the marker sits in that
memory depends on the environment's order, so an agent can lose it (seen in CI: both agents outlived a
kill -9). So the watchdog also follows the process tree while the server lives: every second it records the
server's descendants and the descendants of every marked process (pid and start time, against pid reuse),
and at the end it kills what it recorded, what is marked, and their descendants, until a few sweeps in a
row find nothing. Kept free of heavy imports: it waits beside the server for its whole life.

    python -m cluster.local_ray_watchdog MARKER
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid

MARKER_ENV = "TANDEM_SERVE_ID"
FOLLOW_INTERVAL_S = 1.0  # how often the watchdog records the server's family while it lives
_watchdogs: list[subprocess.Popen] = []  # their stdin pipes stay open for the life of this process

Family = dict[int, int]  # pid -> start time (clock ticks after boot), so a reused pid is not mistaken


def start_watchdog() -> str:
    """Start the watchdog for this process, then mark this process's environment; returns the marker."""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != MARKER_ENV}
    _watchdogs.append(subprocess.Popen([sys.executable, "-m", __name__, marker], stdin=subprocess.PIPE, env=env,
                                       stdout=subprocess.DEVNULL, start_new_session=True))
    os.environ[MARKER_ENV] = marker
    return marker


def kill_marked(marker: str, name: str = MARKER_ENV, known: Family | None = None,
                root: int | None = None) -> list[int]:
    """SIGKILL the family of `marker` (see `family`) but this process; returns their pids."""
    found = family(marker, name, known, root)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return list(found)


def family(marker: str, name: str = MARKER_ENV, known: Family | None = None, root: int | None = None) -> Family:
    """The live processes of a server's family, this one and its watchdogs excepted: those in `known` still
    running (same start time), those whose environment has name=marker, the descendants of `root`, and
    every descendant of all of these."""
    processes = _processes()
    found: Family = {pid: start for pid, start in (known or {}).items()
                     if pid in processes and processes[pid][1] == start}
    found.update((pid, processes[pid][1]) for pid in processes if _has_marker(pid, name, marker))
    children: dict[int, list[int]] = {}
    for pid, (ppid, _start) in processes.items():
        children.setdefault(ppid, []).append(pid)
    stack = list(found) + children.get(root, [])
    while stack:
        pid = stack.pop()
        found.setdefault(pid, processes[pid][1])
        stack.extend(child for child in children.get(pid, []) if child not in found)
    for pid in [os.getpid()] + [watchdog.pid for watchdog in _watchdogs]:
        found.pop(pid, None)
    return found


def _processes() -> dict[int, tuple[int, int]]:
    """Every process but this one: pid -> (parent pid, start time)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # the name, in parentheses, may hold spaces
        except (OSError, IndexError):
            continue
        found[int(entry)] = (int(fields[1]), int(fields[19]))
    return found


def _has_marker(pid: int, name: str, marker: str) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = b"\0" + f.read() + b"\0"
    except OSError:
        return False
    return b"\0" + f"{name}={marker}".encode() + b"\0" in environ


def main(marker: str) -> None:
    for signum in (signal.SIGINT, signal.SIGHUP):  # a terminal's Ctrl-C or hang-up is for the server
        signal.signal(signum, signal.SIG_IGN)
    server = os.getppid()
    known: Family = {}
    while True:
        readable, _, _ = select.select([sys.stdin.buffer], [], [], FOLLOW_INTERVAL_S)
        if readable and not os.read(sys.stdin.fileno(), 4096):
            break
        known = family(marker, known=known, root=server)
    # Sweep until a few sweeps in a row find nothing: a process forked while a sweep ran escapes it.
    deadline, quiet = time.monotonic() + 30, 0
    while quiet < 3 and time.monotonic() < deadline:
        # Not root=server any more: the server is gone, and its pid may already be another process's.
        killed = kill_marked(marker, known=known)
        quiet = 0 if killed else quiet + 1
        time.sleep(0.2)


if __name__ == "__main__":
    main(sys.argv[1])
