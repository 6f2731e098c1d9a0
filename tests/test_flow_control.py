"""The ingress's queue discipline (router/api/flow_control.py): priority bands with aging, start-time fair queueing
across tenants by weight on predicted tokens, per-tenant quotas, and cancellation while queued."""
import asyncio
from collections import Counter

import pytest

from router.api.flow_control import FairQueue, FlowConfig, FlowControl, PredictionErrors, TenantPolicy, TokenBucket
from router.api.openai_api import APIError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_tenants_share_by_weight_on_predicted_tokens_over_a_long_run():
    queue = FairQueue(aging_s=1e9)
    for i in range(3000):  # both always backlogged; b's requests are 3x as long
        queue.push("a", 0, 100, 0.0, weight=2.0)
        queue.push("b", 0, 300, 0.0, weight=1.0)
    served = Counter()
    for _ in range(3000):
        entry = queue.pop(0.0)
        served[entry.tenant] += entry.cost
    share = served["a"] / (served["a"] + served["b"])
    assert share == pytest.approx(2 / 3, abs=0.02)  # tokens, by weight: not requests (a sent 4.5x as many)


def test_a_quiet_tenant_goes_next_beside_a_flood_and_banks_no_credit_while_idle():
    """Start-time fair queueing: a tenant that was idle starts at the virtual time now, so its request goes
    before the backlogged flood's next one (deficit round robin let a burst of the flood's go first); while
    idle it earns nothing, and one that just left keeps what it was served."""
    queue = FairQueue(aging_s=1e9)
    for _ in range(50):
        queue.push("flood", 0, 320, 0.0)
    for _ in range(10):
        assert queue.pop(0.0).tenant == "flood"
        quiet = queue.push("quiet", 0, 320, 0.0)
        assert queue.pop(0.0) is quiet  # at once, each time
    # Idle for a long while (30 flood requests served): on its return it gets its turn, not 30 in a row.
    for _ in range(30):
        assert queue.pop(0.0).tenant == "flood"
    for _ in range(3):
        queue.push("quiet", 0, 320, 0.0)
    assert [queue.pop(0.0).tenant for _ in range(6)] == ["quiet", "flood", "quiet", "flood", "quiet", "flood"]
    # A tenant that empties its queue and comes straight back does not jump ahead of its share.
    queue.push("quiet", 0, 320, 0.0)
    assert queue.pop(0.0).tenant == "quiet"  # flood went last
    queue.push("quiet", 0, 320, 0.0)
    assert queue.pop(0.0).tenant == "flood"  # quiet went last: its next start is later than flood's
    assert queue.pop(0.0).tenant == "quiet"


def test_a_more_urgent_band_goes_first_whatever_the_tenant_weights():
    queue = FairQueue(aging_s=1e9)
    for _ in range(5):
        queue.push("heavy", 5, 10, 0.0, weight=100.0)
    queue.push("light", 0, 10, 0.0, weight=0.01)
    assert queue.pop(0.0).tenant == "light"
    assert {queue.pop(0.0).tenant for _ in range(5)} == {"heavy"}
    assert queue.pop(0.0) is None


def test_within_a_tenant_priority_then_arrival():
    queue = FairQueue()
    first, urgent, second = (queue.push("t", p, 10, 0.0) for p in (3, 1, 3))
    assert [queue.pop(0.0) for _ in range(3)] == [urgent, first, second]


def test_aging_bounds_the_wait_of_a_low_priority_request():
    """A priority-10 request behind a stream of priority-0 arrivals: each aging_s it waits moves it one band
    up, so after 10 x aging_s it is in band 0 and, the oldest there, goes next."""
    queue = FairQueue(aging_s=1.0)
    low = queue.push("t", 10, 10, 0.0)
    now, served_at = 0.0, None
    for step in range(100):
        now = step * 0.25
        queue.push("t", 0, 10, now)  # a new urgent request every 0.25 s, one served every 0.25 s
        if queue.pop(now) is low:
            served_at = now
            break
    assert served_at is not None and 10.0 <= served_at <= 10.5


def test_a_tenant_at_its_concurrency_cap_waits_and_the_others_go_past():
    queue = FairQueue()
    queue.push("capped", 0, 10, 0.0)
    other = queue.push("other", 0, 10, 1.0)
    assert queue.pop(2.0, eligible=lambda t: t != "capped") is other
    assert queue.pop(2.0, eligible=lambda t: t != "capped") is None
    assert queue.pop(2.0).tenant == "capped"


def test_the_token_bucket_refills_at_its_rate_and_says_when_a_charge_fits():
    clock = Clock()
    bucket = TokenBucket(600, clock)  # 10 tokens a second
    assert bucket.take(500) == 0.0
    assert bucket.take(200) == pytest.approx(10.0)  # 100 left: 100 more in 10 s
    clock.now = 10.0
    assert bucket.take(200) == 0.0
    bucket.give_back(1000)
    assert bucket.level == 600  # never above a minute's worth


def run(coro):
    return asyncio.run(coro)


async def placed(flow: FlowControl, *args):
    """`flow.enter(*args)`, and the grant placed at once (as the service does once the router placed it)."""
    grant = await flow.enter(*args)
    grant.placements(1)()
    return grant


def test_a_tenant_over_its_tokens_per_minute_gets_429_with_an_honest_retry_after_and_others_go_on():
    clock = Clock()
    flow = FlowControl(FlowConfig(tenants={"small": TenantPolicy(tokens_per_minute=600)}), clock=clock)

    async def scenario():
        grant = await placed(flow, "small", 0, 300, 200)  # 500 of 600
        with pytest.raises(APIError) as refused:
            await placed(flow, "small", 0, 100, 100)
        assert refused.value.status == 429
        retry = int(refused.value.headers["Retry-After"])
        assert retry == 10  # 100 left, 200 needed, 10 a second
        await placed(flow, "big", 0, 10_000, 10_000)  # another tenant is not affected
        clock.now = retry - 0.5
        with pytest.raises(APIError):
            await placed(flow, "small", 0, 100, 100)  # not yet
        clock.now = retry
        await placed(flow, "small", 0, 100, 100)  # at the time it said
        grant.release(output_tokens=50)  # 150 of its 200 max_tokens unused: back in the budget
        assert flow.buckets["small"].level == pytest.approx(150)
        with pytest.raises(APIError) as too_big:
            await placed(flow, "small", 0, 500, 500)  # never fits a minute's budget: no retry helps
        assert too_big.value.status == 400 and "max_tokens" in str(too_big.value)

    run(scenario())


def test_queued_requests_start_by_priority_as_room_frees_and_past_max_queued_get_429():
    flow = FlowControl(FlowConfig(max_in_flight=1, tenants={"t": TenantPolicy(max_queued=3)}))

    async def scenario():
        first = await placed(flow, "t", 0, 10, 10)
        order = []

        async def queued(priority, name):
            grant = await placed(flow, "t", priority, 10, 10)
            order.append(name)
            await asyncio.sleep(0)
            grant.release(10)

        tasks = [asyncio.create_task(queued(p, n)) for p, n in ((5, "low"), (5, "low2"), (0, "urgent"))]
        await asyncio.sleep(0)
        assert len(flow.queue) == 3
        with pytest.raises(APIError) as full:
            await placed(flow, "t", 0, 10, 10)
        assert full.value.status == 429
        first.release(10)
        await asyncio.gather(*tasks)
        assert order == ["urgent", "low", "low2"]
        assert flow.in_flight == 0 and not len(flow.queue)

    run(scenario())


def test_a_client_that_leaves_while_queued_is_removed_at_once_and_its_budget_refunded():
    flow = FlowControl(FlowConfig(max_in_flight=1, tenants={"t": TenantPolicy(tokens_per_minute=1000)}))

    async def scenario():
        held = await placed(flow, "t", 0, 100, 100)
        waiter = asyncio.create_task(placed(flow, "t", 0, 300, 300))
        await asyncio.sleep(0)
        assert len(flow.queue) == 1 and flow.buckets["t"].level == pytest.approx(200, abs=1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert not len(flow.queue) and flow.buckets["t"].level == pytest.approx(800, abs=1)
        held.release(100)
        assert flow.in_flight == 0

    run(scenario())


def test_saturation_holds_requests_until_the_router_has_room_again():
    saturated = [True]
    woke = asyncio.Event

    async def scenario():
        loads_changed = woke()

        async def wait_for_loads(timeout_s):
            try:
                await asyncio.wait_for(loads_changed.wait(), timeout_s)
            except asyncio.TimeoutError:
                pass

        flow = FlowControl(FlowConfig(), saturated=lambda: saturated[0], wait_for_loads=wait_for_loads)
        waiter = asyncio.create_task(placed(flow, None, 0, 10, 10))
        await asyncio.sleep(0.1)
        assert not waiter.done() and len(flow.queue) == 1
        saturated[0] = False
        loads_changed.set()
        grant = await asyncio.wait_for(waiter, 1.0)
        assert flow.in_flight == 1
        grant.release(10)

    run(scenario())


def test_the_gate_lets_one_request_on_at_a_time_until_the_router_has_placed_it():
    """The router's saturation shows a request only once placed: until then nothing else goes past, so a
    burst is let on one by one as the loads show each, and a grant released unplaced (it failed before
    placement) frees the gate too."""
    async def scenario():
        flow = FlowControl(FlowConfig())
        first = await flow.enter("t", 0, 10, 10)
        second = asyncio.create_task(flow.enter("t", 5, 10, 10))
        third = asyncio.create_task(flow.enter("t", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert flow.placing == 1 and len(flow.queue) == 2
        done = first.placements(2)  # two candidates
        done()
        await asyncio.sleep(0.05)
        assert len(flow.queue) == 2  # one of two placed: the gate stays shut
        done()
        done()  # called once more: nothing happens
        grant = await asyncio.wait_for(third, 1.0)  # the more urgent one next
        assert flow.placing == 1 and not second.done()
        grant.release(0)  # failed before it was placed
        grant = await asyncio.wait_for(second, 1.0)
        grant.placements(1)()
        assert flow.placing == 0 and flow.in_flight == 2 and not len(flow.queue)
        first.release(10)
        grant.release(10)
        assert flow.in_flight == 0

    run(scenario())


def test_a_request_that_would_only_wait_for_a_prefill_slot_waits_in_the_ingress_queue_instead():
    """`ready()` False (placed now, it would wait for a slot behind others): it waits at the ingress, where
    the fair queue orders it, and holds back those after it in that order; it goes once ready."""
    slot_free = [False]

    async def scenario():
        async def wait_for_loads(timeout_s):
            await asyncio.sleep(min(timeout_s, 0.01))

        flow = FlowControl(FlowConfig(), wait_for_loads=wait_for_loads)
        first = asyncio.create_task(flow.enter("a", 0, 10, 10, ready=lambda: slot_free[0]))
        second = asyncio.create_task(flow.enter("b", 0, 10, 10))  # ready: but after `first` in the order
        await asyncio.sleep(0.1)
        assert not first.done() and not second.done() and len(flow.queue) == 2
        slot_free[0] = True
        grant = await asyncio.wait_for(first, 1.0)
        grant.placements(1)()
        (await asyncio.wait_for(second, 1.0)).placements(1)()
        assert flow.in_flight == 2

    run(scenario())


def test_a_request_whose_first_token_comes_in_a_fraction_of_the_held_back_heads_time_goes_on_past_it():
    """One tenant (others would go ahead by share), the router saturated, the queue's head a cold prompt that would only wait for a prefill slot (3 s away): a
    prefix hit behind it whose first token, placed now, comes in 0.5 s goes on past it (counted); requests about as
    long as the head's, one not ready, and one in a less urgent band do not; the head keeps its place. Where every
    request is about as quick as the head (a GPU's short prompts), the queue's order stands."""
    from prometheus_client import CollectorRegistry

    from router.metrics import FlowMetrics

    async def scenario():
        saturated, now = [False], [0.0]

        async def wait_for_loads(timeout_s):
            await asyncio.sleep(0.01)

        metrics = FlowMetrics(CollectorRegistry())
        flow = FlowControl(FlowConfig(), saturated=lambda: saturated[0], wait_for_loads=wait_for_loads,
                           clock=lambda: now[0], metrics=metrics)
        running = await placed(flow, "a", 0, 10, 10)
        saturated[0] = True

        def enter(tenant, priority, first_token_s, ready=True):
            return asyncio.create_task(flow.enter(tenant, priority, 10, 10, predict=lambda ahead: first_token_s,
                                                  ready=lambda: ready))

        head = enter("a", 0, 3.0, ready=False)
        long = enter("a", 0, 2.5)
        not_ready = enter("a", 0, 0.2, ready=False)
        less_urgent = enter("a", 5, 0.1)
        hit = enter("a", 0, 0.5)
        await asyncio.sleep(0.05)
        now[0] += 0.2  # the next look (at most every QUICK_SCAN_S)
        grant = await asyncio.wait_for(hit, 1.0)
        assert not grant.ahead and flow.placing == 1
        assert metrics.quick.labels("a")._value.get() == 1
        grant.placements(1)()
        now[0] += 0.2
        flow.pump()
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in (head, long, not_ready, less_urgent))
        saturated[0] = False
        for g in (running, grant):
            g.release(10)
        for task in (head, long, not_ready, less_urgent):
            task.cancel()
        await asyncio.gather(head, long, not_ready, less_urgent, return_exceptions=True)

        # As quick as the head, all of them: nobody goes past it.
        running = await placed(flow, "a", 0, 10, 10)
        saturated[0] = True
        head = enter("a", 0, 1.0, ready=False)
        others = [enter("a", 0, 0.9) for _ in range(3)]
        await asyncio.sleep(0.05)
        now[0] += 0.2
        flow.pump()
        await asyncio.sleep(0.05)
        assert not any(t.done() for t in (head, *others))
        for task in (head, *others):
            task.cancel()
        await asyncio.gather(head, *others, return_exceptions=True)
        running.release(10)

    run(scenario())


def test_a_failing_pump_is_counted_and_the_watcher_keeps_watching():
    """The watcher's fallback (a pump that raises is logged and the queue kept watched) is counted, so that
    a bug there shows in tandem:flow_pump_errors rather than only in a log."""
    from prometheus_client import CollectorRegistry
    from router.metrics import FlowMetrics

    async def scenario():
        async def wait_for_loads(timeout_s):
            await asyncio.sleep(0.01)

        metrics = FlowMetrics(CollectorRegistry())
        flow = FlowControl(FlowConfig(max_in_flight=1), metrics=metrics, wait_for_loads=wait_for_loads)
        held = await placed(flow, "t", 0, 10, 10)
        waiter = asyncio.create_task(placed(flow, "t", 0, 10, 10))
        await asyncio.sleep(0.05)
        real_pump, calls = flow.pump, []

        def failing_once():
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("a bug")
            real_pump()
        flow.pump = failing_once
        await asyncio.sleep(0.05)
        assert metrics.pump_errors._value.get() == 1
        flow.in_flight -= 1  # room frees without a pump of its own: only the watcher can let the waiter on
        flow.running["t"] -= 1
        grant = await asyncio.wait_for(waiter, 1.0)
        assert metrics.pump_errors._value.get() == 1
        grant.release(10)
        held.released = True

    run(scenario())


def test_a_tenant_below_its_share_goes_on_at_once_and_ahead_until_it_has_caught_up():
    """The router is saturated and the flood has requests running and queued: the quiet tenant's request does not
    wait for room (nor for a prefill slot) but goes on ahead of the prompts queued on workers; once placed, the
    next goes ahead too while its tenant still runs fewer, by weight; at its share it queues like the rest."""
    async def scenario():
        saturated = [False]

        async def wait_for_loads(timeout_s):
            await asyncio.sleep(0.01)

        flow = FlowControl(FlowConfig(), saturated=lambda: saturated[0], wait_for_loads=wait_for_loads)
        flood = [await placed(flow, "flood", 0, 10, 10) for _ in range(2)]
        assert not any(g.ahead for g in flood)  # one tenant alone: nobody to be behind
        saturated[0] = True
        queued = asyncio.create_task(flow.enter("flood", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert not queued.done()
        first = await asyncio.wait_for(flow.enter("quiet", 0, 10, 10), 1.0)
        assert first.ahead and flow.placing == 1
        second = asyncio.create_task(flow.enter("quiet", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert not second.done()  # the gate lets one on at a time
        first.placements(1)()
        second = await asyncio.wait_for(second, 1.0)
        assert second.ahead  # 1 running against the flood's 2
        second.placements(1)()
        third = asyncio.create_task(flow.enter("quiet", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert not third.done() and not queued.done()  # at its share: both wait for room
        saturated[0] = False
        assert not (await asyncio.wait_for(queued, 1.0)).ahead
        for g in (*flood, first, second):
            g.release(10)
        third.cancel()

    run(scenario())


def test_an_urgent_request_goes_on_ahead_while_none_of_its_band_waits_for_a_first_token_and_aging_opens_no_gate():
    """One tenant, the router saturated with priority-10 work: a priority-0 request does not wait at the ingress for
    a prefill slot (the workers compute it first anyway) but goes on ahead. A second priority-0 request waits while
    the first has no first token yet (one at a time per band, so a band cannot flood the workers), and goes on
    ahead once it has. A priority-10 request that aged in the queue is not let through by it."""
    async def scenario():
        saturated, now = [False], [0.0]

        async def wait_for_loads(timeout_s):
            await asyncio.sleep(0.01)

        flow = FlowControl(FlowConfig(aging_s=10.0), saturated=lambda: saturated[0], wait_for_loads=wait_for_loads,
                           clock=lambda: now[0])
        bulk = [await placed(flow, "t", 10, 10, 10) for _ in range(2)]
        saturated[0] = True
        queued_bulk = asyncio.create_task(flow.enter("t", 10, 10, 10))
        await asyncio.sleep(0.05)
        assert not queued_bulk.done()
        urgent = await asyncio.wait_for(flow.enter("t", 0, 10, 10), 1.0)
        assert urgent.ahead
        urgent.placements(1)()
        second = asyncio.create_task(flow.enter("t", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert not second.done()  # the first of its band has no first token yet
        urgent.prefilled = lambda: True
        flow.pump()  # (the watcher's next wake-up, or any load change)
        second = await asyncio.wait_for(second, 1.0)
        assert second.ahead and not queued_bulk.done()
        second.placements(1)()
        second.prefilled = lambda: True
        now[0] = 100.0  # the queued bulk request aged ten bands: it goes first in the queue, not through the gate
        flow.pump()
        await asyncio.sleep(0.05)
        assert not queued_bulk.done()
        saturated[0] = False
        assert not (await asyncio.wait_for(queued_bulk, 1.0)).ahead
        for g in (*bulk, urgent, second):
            g.release(10)
        assert len(flow.grants) == 1 and flow.in_flight == 1

    run(scenario())


def test_a_waiter_cancelled_just_before_its_turn_takes_no_room_and_leaves_nothing_behind():
    """The client leaves and, before its cancelled waiter runs, room frees: the gate must skip it (setting its
    cancelled future raised, and the room it was given was never given back: the gate stayed shut for good,
    as a 5,000-request soak found)."""
    async def scenario():
        flow = FlowControl(FlowConfig(max_in_flight=1))
        held = await placed(flow, "t", 0, 10, 10)
        leaving = asyncio.create_task(flow.enter("t", 0, 10, 10))
        staying = asyncio.create_task(placed(flow, "t", 0, 10, 10))
        await asyncio.sleep(0.05)
        assert len(flow.queue) == 2
        leaving.cancel()  # its future is cancelled now; the task runs its handler only on the next turn
        held.release(10)  # room frees in between
        grant = await asyncio.wait_for(staying, 1.0)
        with pytest.raises(asyncio.CancelledError):
            await leaving
        assert (flow.in_flight, flow.placing, len(flow.queue)) == (1, 0, 0)
        grant.release(10)
        assert flow.in_flight == 0

    run(scenario())


def test_a_key_may_cap_the_priority_its_tenant_asks_for():
    flow = FlowControl(FlowConfig(tenants={"batch": TenantPolicy(max_priority=5)}))
    flow.check_priority("batch", 5)
    flow.check_priority("other", -10)
    with pytest.raises(APIError, match="priority 0 is more urgent"):
        flow.check_priority("batch", 0)


@pytest.mark.parametrize("fields, message", [
    (dict(weight=0), "weight"), (dict(max_concurrent=0), "max_concurrent"),
    (dict(tokens_per_minute="lots"), "tokens_per_minute"), (dict(max_priority=1.5), "max_priority"),
])
def test_bad_tenant_policies_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        TenantPolicy(**fields)


def test_the_cluster_config_gives_the_ingress_its_flow_and_tenants_and_refuses_bad_ones():
    from pydantic import ValidationError

    from cluster.config import ClusterConfig

    config = ClusterConfig(flow={"max_in_flight": 4, "aging_s": 5}, tenants={"chat": {"weight": 4, "max_priority": 0}})
    flow = config.flow_config()
    assert flow.max_in_flight == 4 and flow.aging_s == 5 and flow.policy("chat").weight == 4
    assert flow.policy("chat").max_priority == 0 and flow.policy("anyone") == flow.default_tenant
    for bad in ({"tenants": {"t": {"weight": 0}}}, {"tenants": {"t": {"tokens_per_minute": -1}}},
                {"tenants": {"t": {"wieght": 2}}}, {"flow": {"max_in_flight": 0}}, {"flow": {"aging_s": 0}},
                {"flow": {"yield_slice_ms": 0}}, {"flow": {"yield_window_s": -1}},
                {"engine": {"prefill_batch_tokens": -1}}):
        with pytest.raises(ValidationError):
            ClusterConfig(**bad)
    # The workers' engines: aging, yielding (on by default) and the prefill batch limit.
    engine = config.engine_config(config.prefill, "prefill")
    assert (engine.priority_aging_s, engine.yield_slice_ms, engine.yield_window_s) == (5, 250.0, 30.0)
    assert engine.prefill_batch_tokens is None  # by device
    tuned = ClusterConfig(flow={"yield_slice_ms": None, "yield_window_s": 5}, engine={"prefill_batch_tokens": 0})
    engine = tuned.engine_config(tuned.decode, "decode")
    assert (engine.yield_slice_ms, engine.yield_window_s, engine.prefill_batch_tokens) == (None, 5, 0)


@pytest.mark.parametrize("written, shed", [("on", "on"), ("off", "off"), ("low_priority", "low_priority"),
                                           ("'on'", "on")])
def test_shed_reads_as_written_in_yaml_where_a_bare_on_is_a_boolean(tmp_path, written, shed):
    from cluster.config import load_config

    path = tmp_path / "tandem.yaml"
    path.write_text(f"flow: {{shed: {written}}}\n")
    assert load_config(path).flow.shed == shed
    path.write_text("flow: {shed: sometimes}\n")
    with pytest.raises(ValueError, match="shed"):
        load_config(path)


def test_shedding_refuses_only_a_request_predicted_to_miss_its_deadline():
    async def scenario():
        seen = []

        def predicting(seconds):
            def predict(ahead):
                seen.append(ahead)
                return seconds
            return predict

        off = FlowControl(FlowConfig(deadline_s=2.0))
        (await placed(off, "t", 5, 10, 10, None, predicting(30.0))).release(10)  # shedding off: admitted
        on = FlowControl(FlowConfig(shed="on", deadline_s=2.0))
        (await placed(on, "t", 0, 10, 10, None, predicting(1.9))).release(10)  # meets the SLO's deadline
        with pytest.raises(APIError) as shed:
            await placed(on, "t", 0, 10, 10, None, predicting(4.5))
        assert shed.value.status == 503 and shed.value.headers["Retry-After"] == "3"
        assert "after this request's deadline of 2.00s" in str(shed.value)
        (await placed(on, "t", 0, 10, 10, 10.0, predicting(4.5))).release(10)  # its own deadline is later
        with pytest.raises(APIError):
            await placed(on, "t", 0, 10, 10, 0.5, predicting(1.0))  # its own deadline is sooner
        low = FlowControl(FlowConfig(shed="low_priority", deadline_s=2.0))
        (await placed(low, "t", 0, 10, 10, None, predicting(30.0))).release(10)  # priority 0 is never shed
        with pytest.raises(APIError):
            await placed(low, "t", 1, 10, 10, None, predicting(30.0))
        assert on.in_flight == low.in_flight == 0

    run(scenario())


def test_shedding_scales_its_prediction_by_how_far_off_the_admitted_ones_came():
    """Admitted at 1.5 s predicted, the requests' first tokens came at 1.2x their predictions: at the 0.9
    quantile of that, a request predicted at 1.8 s would miss a 2 s deadline and is shed, one at 1.6 s is not;
    where the predictions overstated (first tokens at half of them), a request predicted at 3.5 s is admitted.
    Before MIN_SAMPLES measured, or with shed_quantile null, the prediction counts as is."""
    async def scenario(quantile, ratio):
        flow = FlowControl(FlowConfig(shed="on", deadline_s=2.0, shed_quantile=quantile))
        for _ in range(PredictionErrors.MIN_SAMPLES):
            (await placed(flow, "t", 0, 10, 10, None, lambda ahead: 1.5)).release(10, ttft_s=1.5 * ratio)
        outcomes = []
        for predicted in (1.6, 1.8, 3.5):
            try:
                (await placed(flow, "t", 0, 10, 10, None, lambda ahead: predicted)).release(10)
                outcomes.append("admitted")
            except APIError as exc:
                assert exc.status == 503
                outcomes.append(str(exc))
        return outcomes, flow.prediction_errors.factor(quantile)

    outcomes, factor = run(scenario(0.9, 1.2))
    assert outcomes[0] == "admitted" and factor == pytest.approx(1.2)
    assert "expected in 2.16s (1.80s predicted, x1.20 as the admitted ones' came)" in outcomes[1]
    assert "expected in 4.20s" in outcomes[2]
    assert run(scenario(0.9, 0.5)) == (["admitted", "admitted", "admitted"], pytest.approx(0.5))
    outcomes, factor = run(scenario(None, 1.2))
    assert outcomes[:2] == ["admitted", "admitted"] and "expected in 3.50s, after" in outcomes[2] and factor == 1
    errors = PredictionErrors()
    for _ in range(PredictionErrors.MIN_SAMPLES - 1):
        errors.observe(1.0, 3.0)
    errors.observe(0.01, 5.0)  # too short a prediction to say anything
    assert errors.factor(0.9) == 1.0
    errors.observe(1.0, 100.0)
    assert errors.factor(0.9) == 3.0  # one outlier in twenty is past the 0.9 quantile
    for _ in range(4):
        errors.observe(1.0, 100.0)
    assert errors.factor(0.9) == PredictionErrors.BOUNDS[1]


def test_the_prediction_counts_the_requests_queued_ahead_in_a_band_as_urgent_or_more():
    queue = FairQueue(aging_s=100.0)
    for priority, tokens in ((0, 100), (1, 200), (5, 400)):
        queue.push("t", priority, tokens + 10, 0.0).prompt_tokens = tokens
    assert queue.ahead_of(1, 0.0) == (2, 300)
    assert queue.ahead_of(-1, 0.0) == (0, 0)
    assert queue.ahead_of(1, 400.0) == (3, 700)  # aged four bands: the priority-5 request is in band 1 now


def test_a_prediction_that_fails_is_counted_and_the_queue_keeps_its_order():
    """A bug in a queued request's prediction must not fail the requests that enter or end (the queue's pump runs in
    both): the quick look logs it, counts it in tandem:flow_pump_errors and lets nobody past the head."""
    from prometheus_client import CollectorRegistry

    from router.metrics import FlowMetrics

    def broken(ahead):
        raise RuntimeError("a bug")

    async def scenario():
        now = [0.0]

        async def wait_for_loads(timeout_s):
            await asyncio.sleep(0.01)

        metrics = FlowMetrics(CollectorRegistry())
        flow = FlowControl(FlowConfig(), saturated=lambda: True, wait_for_loads=wait_for_loads,
                           clock=lambda: now[0], metrics=metrics)
        head = asyncio.create_task(flow.enter("a", 0, 10, 10, predict=broken, ready=lambda: False))
        behind = asyncio.create_task(flow.enter("a", 0, 10, 10, predict=lambda ahead: 0.1, ready=lambda: True))
        await asyncio.sleep(0.05)
        now[0] += 0.2
        flow.pump()
        await asyncio.sleep(0.05)
        assert not head.done() and not behind.done()
        assert metrics.pump_errors._value.get() >= 1
        for task in (head, behind):
            task.cancel()
        await asyncio.gather(head, behind, return_exceptions=True)

    run(scenario())
