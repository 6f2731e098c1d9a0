"""Requests waiting at the ingress for a prefill slot count against it: each one routed after them sees them
queued ahead (so its remote path's predicted wait, and the queue's fullness, are as they will be), and the
slots go to them in the order they began to wait."""
import asyncio

from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.placement.latency_report import LatencyReporter
from router.metrics import Metrics
from router.placement.pool_policy import Placement
from router.placement.routing import RouteDecision
from router.placement.request_router import RequestRouter
from tests.helpers import wait_for_async

LENGTHS = {"first": 40, "second": 41, "third": 42, "gone": 43, "urgent": 44}  # the view tells requests apart by length
CACHED = 8


class QueueView:
    """A WorkerView whose one prefill worker has `free` slots; a request seeing waiters ahead of it, or no
    free slot, is told to wait (as `Router.route` does with the backlog counted as queued)."""
    block_size = 16

    def __init__(self):
        self.free = 0
        self.backlogs: dict[str, list[dict]] = {}
        self.order: list[str] = []
        self.names = {length: name for name, length in LENGTHS.items()}
        self.changed = asyncio.Event()

    def route(self, block_hashes, num_tokens, excluded, prefill_backlog=None, **options):
        self.backlogs.setdefault(self.names[num_tokens], []).append(dict(prefill_backlog or {}))
        ahead = (prefill_backlog or {}).get("p0", (0, 0))[0]
        full = ahead >= self.free
        return RouteDecision(Placement("d0", 0, 0.0), Placement("p0", CACHED, 0.0), "slot", wait=full)

    def saturated(self):  # no worker holds prompts of its own: saturation here is the slot waiters alone
        return False

    async def wait_for_loads(self, timeout_s):
        try:
            await asyncio.wait_for(self.changed.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def open_slot(self):
        self.free += 1
        self.changed.set()
        self.changed = asyncio.Event()

    def begin(self, decision, request_id, num_tokens, block_hashes=()):
        self.order.append(request_id)
        self.free -= 1


def request(name: str, priority: int = 0) -> GenerateRequest:
    r = GenerateRequest(name, list(range(LENGTHS[name])), SamplingParams(max_tokens=4), priority=priority)
    r.stamp("arrival")
    return r


def test_waiters_count_as_queued_for_those_behind_them_and_take_slots_in_order():
    view = QueueView()
    router = RequestRouter(view, Metrics(), LatencyReporter(controller=None))

    async def route(name):
        return await router._route(request(name), [], set())

    async def main():
        tasks = []
        for name in ("first", "second", "third"):
            tasks.append(asyncio.create_task(route(name)))
            assert await wait_for_async(lambda: name in router.slot_waiters)
        assert list(router.slot_waiters) == ["first", "second", "third"]
        assert router.slot_waiters["first"] == ("p0", 40 - CACHED, 0)
        for placed in range(1, 4):
            view.open_slot()
            assert await wait_for_async(lambda: len(view.order) == placed)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert view.order == ["first", "second", "third"]
    assert view.backlogs["first"][0] == {}
    assert view.backlogs["second"][0] == {"p0": (1, 40 - CACHED)}
    assert view.backlogs["third"][0] == {"p0": (2, 40 + 41 - 2 * CACHED)}
    # The last waiter, once the two ahead were placed, saw none ahead; nothing stays registered.
    assert view.backlogs["third"][-1] == {}
    assert router.slot_waiters == {}


def test_a_request_that_stops_waiting_by_error_leaves_no_backlog_behind():
    view = QueueView()
    router = RequestRouter(view, Metrics(), LatencyReporter(controller=None))

    async def main():
        task = asyncio.create_task(router._route(request("gone"), [], set()))
        assert await wait_for_async(lambda: "gone" in router.slot_waiters)
        task.cancel()  # the client went away while it waited
        try:
            await task
        except asyncio.CancelledError:
            pass

    asyncio.run(main())
    assert router.slot_waiters == {}


def test_a_more_urgent_waiter_takes_the_next_slot_before_those_that_waited_longer():
    view = QueueView()
    router = RequestRouter(view, Metrics(), LatencyReporter(controller=None))

    async def main():
        tasks = []
        for name, priority in (("first", 0), ("second", 0), ("urgent", -1)):
            tasks.append(asyncio.create_task(router._route(request(name, priority), [], set())))
            assert await wait_for_async(lambda: name in router.slot_waiters)
        assert router.saturated()
        for placed in range(1, 4):
            view.open_slot()
            assert await wait_for_async(lambda: len(view.order) == placed)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert view.order == ["urgent", "first", "second"]
    assert view.backlogs["urgent"][-1] == {}  # nobody ahead of it
    assert view.backlogs["first"][-1] == {}
    assert not router.saturated()
