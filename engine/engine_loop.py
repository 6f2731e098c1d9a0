"""Runs an Engine's step loop in a background thread and fans outputs out to asyncio consumers.

Workers are async Ray actors: many request streams wait on one batch. The engine itself is not
thread-safe, so every touch of it goes through `call` (under one lock) and the loop steps only
while there is work.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TypeVar

from engine.engine import Engine
from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineLoop:
    """Owns the stepping thread; `subscribe` gives a queue of a request's outputs."""

    def __init__(self, engine: Engine, on_step: Callable[[list[RequestOutput]], None] | None = None):
        self.engine = engine
        self.on_step = on_step
        self.lock = threading.Lock()
        self.wakeup = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopped = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., T], *args) -> T:
        """Run `fn(*args)` with exclusive access to the engine, then let the loop step."""
        with self.lock:
            result = fn(*args)
        self.wakeup.set()
        return result

    def subscribe(self, request_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self.stopped:
            self.wakeup.wait()
            self.wakeup.clear()
            while not self.stopped:
                with self.lock:
                    if not self.engine.has_unfinished_requests():
                        break
                    try:
                        outputs = self.engine.step()
                    except Exception:  # the loop must outlive any one bad step
                        logger.exception("engine step failed")
                        outputs = []
                if self.on_step is not None:
                    self.on_step(outputs)
                for out in outputs:
                    self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        target = self.queues.get(out.request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the consumer's event loop is gone
            self.queues.pop(out.request_id, None)
