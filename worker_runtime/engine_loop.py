"""Runs an Engine's step loop in a background thread and fans outputs out to asyncio consumers.

Workers are async Ray actors: many request streams wait on one batch. Only the loop thread touches
the engine. Everyone else submits commands (add, abort, stats, ...) to its inbox; the loop runs them
between steps, so an actor's event loop never waits for a model step to finish. A `between_layers` command
(a peer's prefix lease: the block manager's bookkeeping, nothing the running forward reads) does not wait for
the step either: the loop thread runs it before the forward's next decoder layer.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, TypeVar

from engine.errors import RankFailed
from engine.outputs import RequestOutput
from worker_runtime.cpu_cores import PinnedCores
from engine.step_context import StepContext

if TYPE_CHECKING:
    from engine.engine import Engine

logger = logging.getLogger(__name__)
T = TypeVar("T")


class EngineStopped(RuntimeError):
    """The worker is shutting down: its engine takes no more commands."""


def run_between_layers(model, pending: deque, run: Callable[[], None]) -> bool:
    """Before each decoder layer of a forward, `run()` the commands `pending` holds (a deque the loop thread
    drains). False when the model's layers cannot be found: such commands then wait for the step's end."""
    import torch  # with the model, not in the control plane

    from engine.layer_progress import decoder_layers
    try:
        layers = decoder_layers(model)
    except (AttributeError, ValueError) as exc:
        logger.warning("commands between layers wait for the end of each step instead: %s", exc)
        return False
    capturing = torch.cuda.is_current_stream_capturing if torch.cuda.is_available() else (lambda: False)

    def check(module, args) -> None:
        if pending and not capturing():
            run()

    for layer in layers:
        layer.register_forward_pre_hook(check)
    return True


def watch_lenders(model, cores: PinnedCores, context: StepContext) -> None:
    """Before each decoder layer of a forward, give back the borrowed cores whose owner turned busy and take
    those lent since (`PinnedCores.rebalance`): a forward cannot stop halfway, but it can shrink and grow.
    Such a step ran partly on borrowed cores, so it is measured as neither kind (`StepContext.borrow_cut`)."""
    from engine.layer_progress import decoder_layers  # with the model, not in the control plane

    def check(module, args) -> None:
        gave_back, took = cores.rebalance()
        if gave_back or took:
            context.borrowing = bool(cores.borrowed) and context.borrowing
            context.borrow_cut = True

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(check)


class EngineLoop:
    """Owns the stepping thread; `subscribe` gives a queue of a request's outputs."""

    def __init__(self, engine: Engine, on_step: Callable[[list[RequestOutput]], None] | None = None,
                 cores: PinnedCores | None = None):
        self.engine = engine
        self.on_step = on_step
        self.cores = cores  # told before each step and before each wait: lends or borrows idle cores
        self.inbox: deque[tuple[Callable, tuple, Future]] = deque()
        self.between: deque[tuple[Callable, tuple, Future]] = deque()  # `between_layers` commands
        self.wakeup = threading.Event()
        self.urgent = threading.Event()  # a command that should not wait out a pause lending the cores
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopped = False
        self.idle = True  # waiting for work, not stepping or running commands
        self.progress_at = time.monotonic()  # when the loop last finished a step or took up work
        self.step_context = StepContext()  # whether the coming step runs on borrowed cores, told to each step
        if cores is not None and cores.binding.borrow and cores.owned:
            watch_lenders(engine.runner.model, cores, self.step_context)
        model = getattr(getattr(engine, "runner", None), "model", None)
        self.runs_between_layers = model is not None and run_between_layers(model, self.between,
                                                                            lambda: self._drain(self.between))
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    def submit(self, fn: Callable[..., T], *args, urgent: bool = False, between_layers: bool = False) -> Future:
        """Run `fn(*args)` on the loop thread before its next step; returns a future of the result. An
        `urgent` one (a new request) also ends a pause in which the loop lends its cores. A `between_layers`
        one runs before the running forward's next decoder layer, if one is running: only for commands that
        touch nothing the step reads or writes until it ends (new references to cached blocks, blocks from the
        free list)."""
        future: Future = Future()
        (self.between if between_layers else self.inbox).append((fn, args, future))
        self.wakeup.set()
        if urgent:
            self.urgent.set()
        if self.stopped:  # stop() may already have failed what was queued
            self._fail_inbox()
        return future

    async def run(self, fn: Callable[..., T], *args, urgent: bool = False, between_layers: bool = False) -> T:
        """`submit` for asyncio callers. Cancelling the caller does not cancel the command."""
        return await asyncio.wrap_future(self.submit(fn, *args, urgent=urgent, between_layers=between_layers))

    def subscribe(self, request_id: str, queue: asyncio.Queue | None = None) -> asyncio.Queue:
        """The queue `request_id`'s outputs go to: a new one, or `queue` (the candidates of one prompt share one)."""
        queue = queue if queue is not None else asyncio.Queue()
        self.queues[request_id] = (asyncio.get_running_loop(), queue)
        return queue

    def unsubscribe(self, request_id: str) -> None:
        self.queues.pop(request_id, None)

    def stalled_s(self) -> float:
        """Seconds the loop has been busy with one step or command batch: 0 while it waits for work. A
        healthy loop finishes every step within a fraction of a second; one that stays busy for minutes
        is stuck (a hung forward or collective, a deadlock) and its requests will never advance."""
        return 0.0 if self.idle else time.monotonic() - self.progress_at

    def stop(self) -> None:
        self.stopped = True
        self.wakeup.set()
        self.thread.join(timeout=5)
        self._fail_inbox()

    def _run(self) -> None:
        while not self.stopped:
            self.progress_at, self.idle = time.monotonic(), False
            self._run_commands()
            if not self.engine.has_unfinished_requests():
                if self.cores is not None:
                    self.cores.idle()
                self.idle = True
                self.wakeup.wait()
                self.wakeup.clear()
                continue
            if self.cores is not None:
                self.cores.busy()
                self.step_context.borrowing, self.step_context.borrow_cut = bool(self.cores.borrowed), False
            started = time.monotonic()
            try:
                outputs = self.engine.step(self.step_context)
            except RankFailed as exc:  # the worker can run no step again: park, its ping says so (restart)
                logger.error("engine loop parked, a tensor-parallel rank is gone: %s", exc)
                while not self.stopped:
                    self.wakeup.wait(1.0)
                return
            except Exception:  # the loop must outlive any one bad step
                logger.exception("engine step failed")
                outputs = []
            if self.on_step is not None:
                self.on_step(outputs)
            self._deliver(outputs)
            if (self.cores is not None and self.cores.lends_while_busy and self.engine.has_unfinished_requests()
                    and not self.engine.has_prompt_work()):
                # Only decodes to run: lend the cores for a while if a neighbour's prompt runs (cpu.lend_busy_ms).
                self.cores.lend_between_steps(started, self.urgent)

    def _run_commands(self) -> None:
        self.urgent.clear()
        self._drain(self.between)
        self._drain(self.inbox)

    @staticmethod
    def _drain(commands: deque) -> None:
        while commands:
            fn, args, future = commands.popleft()
            # A command runs even when its caller stopped waiting (an asyncio caller cancelled in `run`
            # cancels the future): it may take or free what later commands count on. Its result then goes
            # nowhere; setting it on the cancelled future would raise and end this thread.
            waiting = future.set_running_or_notify_cancel()
            try:
                result = fn(*args)
            except Exception as exc:
                if waiting:
                    future.set_exception(exc)
                continue
            if waiting:
                future.set_result(result)

    def _fail_inbox(self) -> None:
        """Commands the stopped loop will never run fail instead of leaving their callers waiting."""
        for commands in (self.between, self.inbox):
            while True:
                try:
                    _, _, future = commands.popleft()
                except IndexError:
                    break
                if future.set_running_or_notify_cancel():
                    future.set_exception(EngineStopped("the engine loop has stopped"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their consumers: one wakeup per event loop, not one per request, since
        every wakeup of an actor's event loop competes with this thread for the GIL."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        for out in outputs:
            target = self.queues.get(out.request_id)
            if target is not None:
                batches.setdefault(target[0], []).append((target[1], out))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the consumers' event loop is gone
                for rid in [rid for rid, (lp, _) in list(self.queues.items()) if lp is loop]:
                    self.queues.pop(rid, None)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    for queue, out in batch:
        queue.put_nowait(out)
