"""The decode worker's side of feeds (router/placement/feeds.py): many requests' deltas over one Ray stream per
ingress event loop. `open_feed` is that stream; `start` runs a request's `generate` as a task that writes
to it under the caller's key; `abort` cancels one; `feed_error` hands over the error that ended one. The
DecodeWorker actor owns one FeedServer and exposes these as its Ray methods."""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from worker_runtime.protocol import FEED_END, FEED_FAILED, GenerateRequest, PrefillResult

Generate = Callable[[GenerateRequest, PrefillResult | None, list | None], AsyncIterator]


class FeedClosed(RuntimeError):
    """A request was started on a feed that this worker has closed."""


class Feed:
    """One open `open_feed` stream: what its requests yielded since it last sent, and their tasks."""

    def __init__(self):
        self.items: list[tuple] = []
        self.wakeup = asyncio.Event()
        self.tasks: dict[int, asyncio.Task] = {}  # by the caller's key

    def put(self, item: tuple) -> None:
        self.items.append(item)
        self.wakeup.set()


def _remember(recent: OrderedDict, key, value, limit: int = 1024) -> None:
    """Keep `key` in `recent`, dropping the oldest entries beyond `limit`."""
    recent[key] = value
    while len(recent) > limit:
        recent.popitem(last=False)


def _cancel_once(task: asyncio.Task) -> None:
    """Cancel a fed request's task unless it already is: a second cancellation would interrupt the clean-up
    that the first one runs (releasing its lease and blocks)."""
    if not task.cancelling():
        task.cancel()


class FeedServer:
    """The feeds open on one decode worker; a fed request runs `generate` (DecodeWorker.generate)."""

    def __init__(self, worker_id: str, generate: Generate):
        self.worker_id = worker_id
        self.generate = generate
        self.feeds: dict[str, Feed] = {}
        self.feed_errors: OrderedDict[tuple[str, int], Exception] = OrderedDict()  # until the ingress fetches them
        self.closed_feeds: OrderedDict[str, None] = OrderedDict()  # recently closed: a late start fails
        self.feed_counts = {"items": 0, "deltas": 0}  # Ray items sent on feeds, and the deltas they carried

    async def open_feed(self, feed_id: str):
        """Yield lists of (key, delta | FEED_END | FEED_FAILED) for the requests started on this feed (`key`
        is the caller's name for one start: a request re-placed here after a failure starts again under
        another), one list per wake-up (a step's deltas for all of them). Closing the stream aborts the
        requests still running on it."""
        feed = self.feeds.setdefault(feed_id, Feed())  # a start may come first
        try:
            while True:
                await feed.wakeup.wait()
                feed.wakeup.clear()
                items, feed.items = feed.items, []
                self.feed_counts["items"] += 1
                self.feed_counts["deltas"] += len(items)
                yield items
        finally:
            del self.feeds[feed_id]
            _remember(self.closed_feeds, feed_id, None)
            for task in list(feed.tasks.values()):
                _cancel_once(task)

    async def start(self, feed_id: str, key: int, request: GenerateRequest, prefill: PrefillResult | None = None,
                    pending: list | None = None) -> None:
        """Run `generate` for the request with its deltas going out on the feed under `key`; returns at once."""
        if feed_id in self.closed_feeds:
            raise FeedClosed(f"decode worker {self.worker_id} closed feed {feed_id}")
        feed = self.feeds.setdefault(feed_id, Feed())  # its open_feed call may not have begun yet
        task = asyncio.ensure_future(self._run_fed(feed_id, feed, key, request, prefill, pending))
        feed.tasks[key] = task
        task.add_done_callback(lambda _: feed.tasks.pop(key, None))

    async def _run_fed(self, feed_id: str, feed: Feed, key: int, request: GenerateRequest, prefill, pending) -> None:
        try:
            async for delta in self.generate(request, prefill, pending):
                feed.put((key, delta))
        except Exception as exc:  # the ingress fetches it with `feed_error`, raised as Ray raises errors
            _remember(self.feed_errors, (feed_id, key), exc)  # bounded: the ingress may never fetch it
            feed.put((key, FEED_FAILED))
            return
        feed.put((key, FEED_END))  # (cancelled by `abort` or by the feed's close, nobody reads it: no item)

    def abort(self, feed_id: str, key: int) -> None:
        """Stop a request started on the feed (its client left); its blocks are freed as on a stream's close."""
        feed = self.feeds.get(feed_id)
        task = feed and feed.tasks.get(key)
        if task is not None:
            _cancel_once(task)

    def stats(self) -> dict:
        """Feeds open now, their requests running, Ray items sent on feeds since start and the deltas (and
        ends) they carried."""
        return {"open": len(self.feeds), "running": sum(len(f.tasks) for f in self.feeds.values()),
                **self.feed_counts}

    def error(self, feed_id: str, key: int) -> None:
        """Raise the error that ended a fed request (FEED_FAILED), so that the caller gets it as from a stream."""
        raise self.feed_errors.pop((feed_id, key))
