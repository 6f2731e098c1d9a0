"""Token deltas from decode workers, multiplexed: each ingress process (event loop) keeps one feed per decode
worker, a Ray streaming generator (`DecodeWorker.open_feed`) that carries a step's deltas for all of this
process's requests on that worker as one item. A stream per request cost one Ray item per request per
step, about 0.8 ms of CPU on the two sides together (bench/HISTORY.md, "Serving path cost").

A request starts on a feed with `DecodeWorker.start` and reads its deltas from a `FedStream`; closing that
early aborts it on the worker (`DecodeWorker.abort`). An error that ends a request on the worker is fetched
with `DecodeWorker.feed_error`, so it reaches the caller exactly as it would from a stream of its own (a
RayTaskError that is also an instance of its cause); a worker that dies fails every request on its feed
with Ray's RayActorError, as their own streams would."""
from __future__ import annotations

import asyncio
import collections
import contextvars
import itertools
import logging
import uuid
import weakref

import ray

from engine.outputs import RequestOutput
from worker_runtime.protocol import FEED_FAILED

logger = logging.getLogger(__name__)


# Per event loop (a Serve replica has one; a test may run several in turn), per decode worker.
_feeds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def detached(fn, *args):
    """`fn(*args)` outside the calling request's Ray task: in a Serve replica each request is an actor task,
    and a client that leaves is a recursive `ray.cancel` of it, which also cancels every task it submitted
    (tracked through a context variable). A feed and the calls on it serve all of this loop's requests, so
    they are submitted, and the pump runs, in a context of their own."""
    return contextvars.Context().run(fn, *args)


class FeedFailed(Exception):
    """Internal: the feed's stream failed; `cause` is what the requests on it raise."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


class Feed:
    """This event loop's stream of deltas from one decode worker, routed to the requests' FedStreams."""

    def __init__(self, actor):
        self.actor = actor
        self.feed_id = uuid.uuid4().hex
        self.streams: dict[int, FedStream] = {}  # by key: one per start, however often a request starts
        self.keys = itertools.count()
        self.failure: BaseException | None = None
        self.loop = asyncio.get_running_loop()
        # Submitted now, before any start on it (the worker also opens a feed on its first start).
        self.generator = detached(actor.open_feed.options(num_returns="streaming").remote, self.feed_id)
        self.pump = detached(asyncio.ensure_future, self._pump())

    async def _pump(self) -> None:
        try:
            async for ref in self.generator:
                for key, item in await ref:
                    stream = self.streams.get(key)
                    if stream is not None:
                        stream.put(item)
                        if not isinstance(item, RequestOutput):  # its last item: the worker is done with it
                            del self.streams[key]
                            stream.running = False
            # Only an actor that goes away ends its feeds; treat it so (the router re-places the requests).
            raise ray.exceptions.ActorUnavailableError(f"the feed {self.feed_id} ended", None)
        except asyncio.CancelledError:  # this event loop is closing
            ray.cancel(self.generator)
            self._fail(RuntimeError("the feed was closed"))
            raise
        except Exception as exc:
            logger.info("feed %s failed: %s", self.feed_id, type(exc).__name__)
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        self.failure = exc
        feeds = _feeds.get(self.loop)
        if feeds is not None and feeds.get(self.actor._actor_id) is self:
            del feeds[self.actor._actor_id]
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.running = False
            stream.put(FeedFailed(exc))


def start(decode, request, *args) -> FedStream:
    """Start `DecodeWorker.generate(request, *args)` on the decode worker, its deltas coming over this event
    loop's feed from that worker (opened on first use). Returns at once: as with a stream of its own, an
    error of the feed or of the start is raised by the first read."""
    feeds = _feeds.setdefault(asyncio.get_running_loop(), {})
    feed = feeds.get(decode._actor_id)
    if feed is None:
        feed = feeds[decode._actor_id] = Feed(decode)
    key = next(feed.keys)
    # Submitted now, as a stream of its own would be: the arguments are what they are at this call (the
    # caller may go on to change them, e.g. a layer-wise PrefillResult's first token).
    # Detached too: a request cancelled before its start ran is aborted by its stream's close.
    return FedStream(feed, key, request.num_outputs == 1,
                     detached(decode.start.remote, feed.feed_id, key, request, *args))


class FedStream:
    """One request's deltas from its feed. Deltas that arrived while the consumer was busy come out as one
    (one candidate only: several candidates' deltas are already coalesced per candidate by the worker)."""

    def __init__(self, feed: Feed, key: int, coalesce: bool, started):
        self.feed, self.key, self.coalesce = feed, key, coalesce
        self.items: collections.deque = collections.deque()
        self.ready = asyncio.Event()
        self.ended = False
        self.running = True  # on the worker, or starting
        if feed.failure is not None:
            self.running = False
            self.put(FeedFailed(feed.failure))
        else:
            feed.streams[key] = self
        self.starting = asyncio.ensure_future(self._started(started))

    async def _started(self, started) -> None:
        try:
            await started
        except asyncio.CancelledError:  # closed meanwhile: `close` aborts it in case it started
            raise
        except Exception as exc:  # it did not start
            if self.running:
                self.running = False
                self.feed.streams.pop(self.key, None)
                self.put(FeedFailed(exc))

    def put(self, item) -> None:
        self.items.append(item)
        self.ready.set()

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if self.ended:
            raise StopAsyncIteration
        while not self.items:
            self.ready.clear()
            await self.ready.wait()
        item = self.items.popleft()
        if not isinstance(item, RequestOutput):
            self.close()
            if isinstance(item, FeedFailed):
                raise item.cause
            if item == FEED_FAILED:
                await detached(self.feed.actor.feed_error.remote, self.feed.feed_id, self.key)  # raises its error
            raise StopAsyncIteration  # FEED_END
        while self.coalesce and not item.finished and self.items and isinstance(self.items[0], RequestOutput):
            item.extend(self.items.popleft())
        return item

    def close(self) -> None:
        """Stop reading; a request still running on the worker is aborted there."""
        self.ended = True
        if not self.starting.done():
            self.starting.cancel()
        if self.running:
            self.running = False
            self.feed.streams.pop(self.key, None)
            if self.feed.failure is None:
                detached(self.feed.actor.abort.remote, self.feed.feed_id, self.key)
