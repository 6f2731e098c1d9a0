"""The watchdog of `tandem serve` kills the server's whole family once the server is gone, kill -9 included,
even a process whose environment no longer shows the marker (a process that sets its title, as Ray's agents
do, overwrites the start of what /proc/PID/environ shows). Real processes, no Ray."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from cluster.local_ray_watchdog import FOLLOW_INTERVAL_S, family
from tests.helpers import wait_for

# A stand-in for `tandem serve`: starts its watchdog, then a marked child and an unmarked one (what an agent
# looks like after setting its title), each in a session of its own as Ray starts its processes.
SERVER = """
import os, subprocess, sys
from cluster.local_ray_watchdog import MARKER_ENV, start_watchdog
marker = start_watchdog()
marked = subprocess.Popen(["sleep", "300"], start_new_session=True)
bare = subprocess.Popen(["sleep", "300"], env={k: v for k, v in os.environ.items() if k != MARKER_ENV},
                        start_new_session=True)
print(marker, marked.pid, bare.pid, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _start_server() -> tuple[subprocess.Popen, str, int, int]:
    server = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    marker, marked, bare = server.stdout.readline().split()
    return server, marker, int(marked), int(bare)


def _wait_gone(pids: list[int]) -> list[int]:
    """The pids still alive once all are gone or the wait gave up."""
    wait_for(lambda: not any(_alive(pid) for pid in pids), interval_s=0.1)
    return [pid for pid in pids if _alive(pid)]


def _let_the_watchdog_record_the_family() -> None:
    # The behaviour under test: the watchdog records the family on its own clock, every FOLLOW_INTERVAL_S,
    # and shows no one when it has; a child it has not recorded yet is not expected to die with the server.
    time.sleep(3 * FOLLOW_INTERVAL_S)


def test_kill_9_of_the_server_takes_marked_and_unmarked_descendants_with_it():
    server, marker, marked, bare = _start_server()
    try:
        _let_the_watchdog_record_the_family()
        assert set(family(marker, root=server.pid)) >= {marked, bare}
        server.kill()
        server.wait()
        assert _wait_gone([marked, bare]) == []
    finally:
        for pid in (marked, bare):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_clean_exit_of_the_server_ends_its_family_too():
    server, _marker, marked, bare = _start_server()
    try:
        _let_the_watchdog_record_the_family()
        server.stdin.close()  # the stand-in returns normally
        server.wait(timeout=30)
        assert _wait_gone([marked, bare]) == []
    finally:
        for pid in (marked, bare):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_family_skips_a_reused_pid_and_this_process():
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        assert family("no-such-marker", known={sleeper.pid: 0}) == {}  # start time differs: a reused pid
        found = family("no-such-marker", root=os.getpid())
        assert sleeper.pid in found and os.getpid() not in found
    finally:
        sleeper.kill()
        sleeper.wait()
