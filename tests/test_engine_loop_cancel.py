"""A caller of EngineLoop.run that is cancelled (a client gone while its worker waits on the loop thread)
stops waiting, but its command still runs, and the loop thread goes on serving everyone else. Found by the
soak (bench/soak.py): the cancelled future made the loop thread raise InvalidStateError and die, leaving
every request on that worker hanging."""
from __future__ import annotations

import asyncio
import threading

from worker_runtime.engine_loop import EngineLoop
from tests.helpers import wait_for_async


class IdleEngine:
    def has_unfinished_requests(self) -> bool:
        return False


def test_a_cancelled_run_still_runs_its_command_and_the_loop_keeps_serving():
    loop = EngineLoop(IdleEngine())
    blocked, release, ran = threading.Event(), threading.Event(), []
    loop.submit(lambda: (blocked.set(), release.wait(10)))
    assert blocked.wait(5)

    async def cancelled_caller() -> None:
        task = asyncio.ensure_future(loop.run(ran.append, "reserved"))
        assert await wait_for_async(lambda: len(loop.inbox) == 1)  # queued behind the blocking command
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled()

    asyncio.run(cancelled_caller())
    release.set()
    assert loop.submit(lambda: "alive").result(timeout=5) == "alive"
    assert ran == ["reserved"]
    assert loop.thread.is_alive()
    loop.stop()


def test_a_cancelled_run_of_a_failing_command_does_not_end_the_loop():
    loop = EngineLoop(IdleEngine())
    blocked, release = threading.Event(), threading.Event()
    loop.submit(lambda: (blocked.set(), release.wait(10)))
    assert blocked.wait(5)

    async def cancelled_caller() -> None:
        task = asyncio.ensure_future(loop.run(lambda: 1 / 0))
        assert await wait_for_async(lambda: len(loop.inbox) == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled_caller())
    release.set()
    assert loop.submit(lambda: "alive").result(timeout=5) == "alive"
    loop.stop()
