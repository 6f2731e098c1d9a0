"""A worker's engine loop says how long it has been stuck in one piece of work, and 0 while it waits for
work: the controller's health check restarts a worker whose loop stays stuck (tests/test_worker_faults.py
runs that through the real app)."""
from __future__ import annotations

import threading
import time

import pytest

from worker_runtime.engine_loop import EngineLoop
from worker_runtime.serving import EngineServer, WorkerStalled
from tests.helpers import wait_for


class IdleEngine:
    ranks = None  # one rank: nothing else to be alive

    def has_unfinished_requests(self) -> bool:
        return False


def test_an_idle_loop_is_not_stalled():
    loop = EngineLoop(IdleEngine())
    assert loop.submit(lambda: "ran").result(timeout=30) == "ran"
    assert wait_for(lambda: loop.idle)
    time.sleep(0.05)  # the behaviour: time passing while the loop idles is not counted as a stall
    assert loop.stalled_s() == 0.0
    loop.stop()


def test_a_loop_stuck_in_a_command_reports_the_time_it_has_been_stuck_and_recovers():
    loop = EngineLoop(IdleEngine())
    stuck, release = threading.Event(), threading.Event()
    loop.submit(lambda: (stuck.set(), release.wait(60)))
    assert stuck.wait(30)
    assert wait_for(lambda: loop.stalled_s() > 0.2)
    release.set()
    assert loop.submit(lambda: "alive").result(timeout=30) == "alive"
    assert wait_for(lambda: loop.stalled_s() == 0.0)
    loop.stop()


def test_ping_raises_worker_stalled_only_past_the_timeout():
    """EngineServer.ping on a server whose loop is stuck (built without a model: only the loop matters)."""
    server = EngineServer.__new__(EngineServer)
    server.worker_id = "decode-7"
    server.loop = EngineLoop(IdleEngine())
    server.engine = server.loop.engine
    stuck, release = threading.Event(), threading.Event()
    server.loop.submit(lambda: (stuck.set(), release.wait(60)))
    assert stuck.wait(30)
    assert wait_for(lambda: server.loop.stalled_s() > 0.2)
    assert server.ping() == "decode-7"  # no timeout given: never stalled
    assert server.ping(stall_timeout_s=3600) == "decode-7"
    with pytest.raises(WorkerStalled, match="decode-7: the engine loop has made no progress"):
        server.ping(stall_timeout_s=0.1)
    release.set()
    assert wait_for(lambda: server.loop.stalled_s() == 0.0)
    assert server.ping(stall_timeout_s=0.1) == "decode-7"
    server.loop.stop()


def test_ping_raises_worker_rank_lost_once_a_tensor_parallel_rank_has_exited():
    """A logical worker fails as a unit: a stalled-kind error, so the controller restarts it."""
    from engine.errors import WorkerRankLost

    class Ranks:
        up = True

        def alive(self):
            return self.up

        def describe(self):
            return "" if self.up else "rank 1 exited with code -9"

    engine = IdleEngine()
    engine.ranks = Ranks()
    server = EngineServer.__new__(EngineServer)
    server.worker_id, server.engine, server.loop = "decode-3", engine, EngineLoop(engine)
    assert server.ping(stall_timeout_s=60) == "decode-3"
    engine.ranks.up = False
    with pytest.raises(WorkerStalled, match="decode-3: rank 1 exited with code -9") as raised:
        server.ping(stall_timeout_s=60)
    assert isinstance(raised.value, WorkerRankLost)
    server.loop.stop()
