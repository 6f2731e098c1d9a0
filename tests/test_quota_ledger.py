"""Tenants' quotas counted once for several ingress replicas (router/api/quota_ledger.py): two flow controls
lease tokens and slots from one ledger, as two replicas do from its Ray actor (tests/test_flow_replicas_e2e.py
runs the actor through the real server)."""
import asyncio

import pytest
import ray

from router.api import quota_ledger
from router.api.flow_control import FlowConfig, FlowControl, TenantPolicy
from router.api.openai_api import APIError
from router.api.quota_ledger import QuotaLedger, SharedQuotas
from router.metrics import Metrics


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Handle:
    """The ledger called in this process the way a Ray handle calls its actor: `handle.method.remote(...)`
    is awaited; `down` makes every call fail as a dead actor's does."""

    def __init__(self, ledger: QuotaLedger):
        self.ledger, self.down, self.calls = ledger, False, 0

    def __getattr__(self, name):
        method = getattr(self.ledger, name)
        handle = self

        class Remote:
            @staticmethod
            async def remote(*args):
                handle.calls += 1
                await asyncio.sleep(0)
                if handle.down:
                    raise ray.exceptions.RayActorError()
                return await method(*args)

        return Remote


def replicas(config: FlowConfig, ledger: QuotaLedger, n: int = 2, clock=None):
    """n flow controls (one per ingress replica) over one ledger, each with its metrics."""
    handle = Handle(ledger)
    flows = []
    for i in range(n):
        metrics = Metrics().flow
        shared = SharedQuotas(handle, "m", f"replica-{i}", n, metrics.ledger_errors)
        flows.append(FlowControl(config, metrics=metrics, shared=shared,
                                 **({} if clock is None else {"clock": clock})))
    return handle, flows


async def placed(flow: FlowControl, *args):
    grant = await flow.enter(*args)
    grant.placements(1)()
    return grant


def value(counter, **labels) -> float:
    return counter.labels(**labels)._value.get() if labels else counter._value.get()


def test_a_tenants_tokens_per_minute_are_counted_once_across_replicas_with_an_honest_retry_after():
    clock = Clock()
    ledger = QuotaLedger(clock=clock)
    config = FlowConfig(tenants={"a": TenantPolicy(tokens_per_minute=600)})
    handle, (one, two) = replicas(config, ledger, clock=clock)

    async def scenario():
        # Replica one borrows what its request needs plus a slice (600 * 0.25 / 2 replicas = 75).
        first = await placed(one, "a", 0, 100, 300)
        assert one.shared.prepaid["a"] == 75 and (await ledger.report())["tokens"]["m/a"] == pytest.approx(125)
        # Replica two cannot have 400 more: the ledger has 125. Counted alone, it would have had 600.
        with pytest.raises(APIError) as refused:
            await placed(two, "a", 0, 100, 300)
        assert refused.value.status == 429
        retry = int(refused.value.headers["Retry-After"])
        assert retry == 28  # (400 - 125) / 10 tokens a second, rounded up
        assert value(two.metrics.refused, tenant="a", priority="0", reason="tokens_per_minute") == 1
        clock.now += retry  # honest: at that time the retry goes through
        await placed(two, "a", 0, 100, 300)
        # Tokens one's request did not generate go back: one slice stays with the replica, the rest to the ledger.
        before = (await ledger.report())["tokens"]["m/a"]
        first.release(0)  # it generated nothing: its 300 are refunded
        await asyncio.sleep(0.01)
        assert one.shared.prepaid["a"] == 75
        assert (await ledger.report())["tokens"]["m/a"] == pytest.approx(before + 300)
        # A request covered by the slice the replica holds costs no call to the ledger.
        calls = handle.calls
        await placed(one, "a", 0, 20, 50)
        assert handle.calls == calls and one.shared.prepaid["a"] == 5

    asyncio.run(scenario())


def test_a_tenants_max_concurrent_holds_across_replicas_and_a_slot_given_back_wakes_the_other():
    ledger = QuotaLedger()
    config = FlowConfig(tenants={"a": TenantPolicy(max_concurrent=1)})
    _, (one, two) = replicas(config, ledger)

    async def scenario():
        first = await asyncio.wait_for(placed(one, "a", 0, 10, 10), 5)
        assert ledger.held("m/a") == 1
        waiter = asyncio.create_task(placed(two, "a", 0, 10, 10))
        await asyncio.sleep(0.2)
        assert not waiter.done() and two.queue.queued("a") == 1  # one slot, held by replica one
        # Another tenant is not held back by a's slots.
        await asyncio.wait_for(placed(two, "b", 0, 10, 10), 5)
        first.release(10)  # replica one gives its slot back: replica two's long poll gets it
        second = await asyncio.wait_for(waiter, 5)
        assert ledger.held("m/a") == 1 and one.shared.held.get("a", 0) == 0 and two.shared.held["a"] == 1
        second.release(10)
        await asyncio.sleep(0.01)
        assert ledger.held("m/a") == 0

    asyncio.run(scenario())


def test_a_client_that_leaves_while_waiting_for_a_slot_leaves_no_slot_behind():
    ledger = QuotaLedger()
    config = FlowConfig(tenants={"a": TenantPolicy(max_concurrent=1)})
    _, (one, two) = replicas(config, ledger)

    async def scenario():
        first = await asyncio.wait_for(placed(one, "a", 0, 10, 10), 5)
        waiter = asyncio.create_task(placed(two, "a", 0, 10, 10))
        await asyncio.sleep(0.1)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        first.release(10)
        await asyncio.sleep(0.2)  # the slot replica two's poll may have got on the way goes back
        assert ledger.held("m/a") == 0 and not two.shared.held.get("a")

    asyncio.run(scenario())


def test_the_slots_of_a_replica_that_stops_renewing_are_taken_back(monkeypatch):
    monkeypatch.setattr(quota_ledger, "RENEW_S", 0.05)
    ledger = QuotaLedger(lease_ttl_s=0.5)
    config = FlowConfig(tenants={"a": TenantPolicy(max_concurrent=1)})
    _, (live, dead, other) = replicas(config, ledger, n=3)

    async def scenario():
        renewing = asyncio.create_task(live.shared.renew_forever())
        held = await asyncio.wait_for(placed(live, "a", 0, 10, 10), 5)
        await asyncio.sleep(0.8)  # past the lease: a renewing replica keeps its slot
        assert ledger.held("m/a") == 1
        held.release(10)
        await asyncio.sleep(0.01)
        await asyncio.wait_for(placed(dead, "a", 0, 10, 10), 5)  # then its process dies: no release, no renewal
        waiter = asyncio.create_task(placed(other, "a", 0, 10, 10))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await asyncio.wait_for(waiter, 3)  # the lease ran out: the slot is the other replica's
        assert (await ledger.report())["slots"] == {"replica-2/m": {"m/a": 1}}
        renewing.cancel()

    asyncio.run(scenario())


def test_a_restarted_ledger_learns_the_slots_from_the_replicas_reports():
    config = FlowConfig(tenants={"a": TenantPolicy(max_concurrent=2)})
    _, (one, _) = replicas(config, QuotaLedger())

    async def scenario():
        await asyncio.wait_for(placed(one, "a", 0, 10, 10), 5)
        fresh = QuotaLedger()  # the actor restarted: it knows nothing
        await fresh.renew("replica-0/m", {"m/a": 1})
        assert fresh.held("m/a") == 1
        await fresh.renew("replica-0/m", {})  # a later report crossing a grant does not undo it
        assert fresh.held("m/a") == 1

    asyncio.run(scenario())


def test_a_ledger_that_does_not_answer_gets_503_counted_and_tenants_without_quotas_go_on():
    ledger = QuotaLedger()
    config = FlowConfig(tenants={"tpm": TenantPolicy(tokens_per_minute=600),
                                 "cap": TenantPolicy(max_concurrent=1)})
    handle, (one, _) = replicas(config, ledger)

    async def scenario():
        handle.down = True
        with pytest.raises(APIError) as tokens:
            await placed(one, "tpm", 0, 10, 10)
        assert tokens.value.status == 503 and tokens.value.headers["Retry-After"] == "1"
        with pytest.raises(APIError) as slots:
            await asyncio.wait_for(placed(one, "cap", 0, 10, 10), 5)  # queued for a slot, then refused
        assert slots.value.status == 503 and not len(one.queue)
        assert value(one.metrics.ledger_errors) == 2
        assert value(one.metrics.refused, tenant="cap", priority="0", reason="ledger") == 1
        free = await placed(one, "free", 0, 10, 10)  # no quota: the ledger is never asked
        free.release(10)
        handle.down = False
        (await placed(one, "tpm", 0, 10, 10)).release(10)
        assert value(one.metrics.ledger_errors) == 2

    asyncio.run(scenario())

