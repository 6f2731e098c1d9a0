"""Scaling and draining through the cluster controller while requests keep coming through the real ingress
over HTTP: nothing in flight is dropped, new workers take traffic only once registered, drained workers
leave membership and Ray."""
import asyncio
import time

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.controller import get_controller
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.placement.dispatch import run_request
from tests.cluster_load import LoadClient, failures, has_served, in_flight, serve_tandem
from tests.helpers import wait_for, wait_off_loop

MODEL = "tiny"


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="ctl", namespace="tandem-tests",
                           engine={"num_kv_blocks": 128, "max_num_batched_tokens": 256},
                           prefill={"max_replicas": 3, "num_cpus": 0.5}, decode={"max_replicas": 3, "num_cpus": 0.5},
                           transfer={"lease_ttl_s": 5}, router={"max_local_prefill_length": 0})
    with serve_tandem(config) as url:
        yield url, get_controller(config.name, config.namespace)


@pytest.fixture(scope="module")
def controller(app):
    return app[1]


def members(controller, pool):
    return sorted(w.worker_id for w in ray.get(controller.membership.remote()).workers if w.pool == pool)


def actors(controller, pool) -> dict:
    return {w.worker_id: w.actor for w in ray.get(controller.membership.remote()).workers if w.pool == pool}


def assert_actor_gone(actor):
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.ping.remote(), timeout=30)



def under_load(app, operations, seed, max_requests=800, interval_s=0.08, max_tokens=(64, 128), max_in_flight=48):
    """Run `operations(client)` while a LoadClient sends a request to the app every `interval_s`; let the
    load run on until a few more requests have ended, stop it and wait for every request to end. Requests
    are long enough (`max_tokens`) that every worker has some in flight at any moment, even the least
    loaded one, which is the one a scale-down drains. On a loaded machine starting a worker can take most
    of a minute, and the load must still run when it is ready: `max_requests` only bounds the loop, and
    `max_in_flight` keeps the work that piles up meanwhile bounded."""
    client = LoadClient(app[0], MODEL, seed=seed, max_tokens=max_tokens)

    async def main():
        stop = asyncio.Event()
        load = asyncio.create_task(client.run(stop, max_requests, interval_s, max_in_flight))
        assert await wait_off_loop(lambda: len(client.outcomes) >= 5)
        await operations(client)
        await served_more(client, max_requests)
        stop.set()
        await load

    asyncio.run(main())
    return client


async def served_more(client: LoadClient, max_requests: int, n: int = 5) -> None:
    """Wait until `n` more requests of the load (which sends `max_requests` at most) have ended: the cluster
    serves on after a change."""
    target = min(len(client.outcomes) + n, max_requests)
    assert await wait_off_loop(lambda: len(client.outcomes) >= target)


def wait_for_membership(controller, predicate, timeout_s: float = 120.0):
    """Follow the controller's membership long poll until `predicate(membership)` holds; returns it."""
    deadline = time.monotonic() + timeout_s
    membership = ray.get(controller.membership.remote())
    while not predicate(membership):
        assert time.monotonic() < deadline, "the membership did not reach the state in time"
        membership = ray.get(controller.membership.remote(membership.version, 5.0))
    return membership


def scale_down_watching(controller, pool: str, replicas: int, steps: dict):
    """Scale `pool` down, noting first what each worker holds in flight (the drained one must hold some)."""
    steps["actors"] = actors(controller, pool)
    steps["in_flight"] = {wid: in_flight(a) for wid, a in steps["actors"].items()}
    return ray.get(controller.scale.remote(pool, replicas))


def test_decode_scales_up_then_down_under_load_without_failed_requests(app, controller):
    steps = {}

    async def operations(client):
        steps["up"] = await controller.scale.remote("decode", 2)
        new = actors(controller, "decode")[steps["up"].added[0]]
        assert await wait_off_loop(lambda: has_served(new))  # registered workers take traffic
        steps["down"] = await asyncio.to_thread(scale_down_watching, controller, "decode", 1, steps)

    client = under_load(app, operations, seed=1)
    up, down = steps["up"], steps["down"]
    assert (up.replicas_before, up.replicas, len(up.added)) == (1, 2, 1)
    assert (down.replicas_before, down.replicas, len(down.drained)) == (2, 1, 1)
    assert failures(client.outcomes) == []
    assert len(client.outcomes) >= 20
    victim = down.drained[0]
    assert steps["in_flight"][victim] > 0, "the drained worker had nothing in flight"
    assert victim not in members(controller, "decode")
    assert_actor_gone(steps["actors"][victim])


def test_prefill_scales_up_then_down_under_load_without_failed_requests(app, controller):
    steps = {}

    async def operations(client):
        steps["up"] = await controller.scale.remote("prefill", 2)
        new = actors(controller, "prefill")[steps["up"].added[0]]
        assert await wait_off_loop(lambda: has_served(new))
        steps["down"] = await asyncio.to_thread(scale_down_watching, controller, "prefill", 1, steps)

    client = under_load(app, operations, seed=2)
    assert failures(client.outcomes) == []
    victim = steps["down"].drained[0]
    assert victim not in members(controller, "prefill") and len(members(controller, "prefill")) == 1
    assert_actor_gone(steps["actors"][victim])


def test_draining_a_busy_worker_mid_load_lets_its_requests_finish(app, controller):
    steps = {}

    async def operations(client):
        steps["added"] = (await controller.scale.remote("decode", 2)).added[0]
        steps["actor"] = actors(controller, "decode")[steps["added"]]
        assert await wait_off_loop(lambda: in_flight(steps["actor"]) >= 2)
        steps["pool"] = await controller.drain.remote(steps["added"], "test")

    before = ray.get(controller.membership.remote()).version
    client = under_load(app, operations, seed=3)
    victim = steps["added"]
    assert steps["pool"] == "decode"
    assert failures(client.outcomes) == []
    assert victim not in members(controller, "decode")
    assert ray.get(controller.status.remote())["pools"]["decode"]["desired"] == 1  # drained, not replaced
    assert ray.get(controller.membership.remote()).version > before
    assert_actor_gone(steps["actor"])
    events = [(e.action, e.worker_id) for e in ray.get(controller.scaling_events.remote())]
    # A handoff event comes only when the victim held a prefix of two full blocks or more: the load's prompts are
    # 5-60 tokens, and which of them the victim served depends on timing.
    assert [a for a, w in events if w == victim] in (["add", "drain", "handoff", "remove"], ["add", "drain", "remove"])
    assert events[-1] == ("remove", victim)


def test_surviving_workers_hold_no_blocks_once_the_load_is_over(controller):
    def idle(w):
        stats = ray.get(w.actor.stats.remote())
        return (stats.num_active_blocks, stats.num_running, stats.num_waiting) == (0, 0, 0)

    for w in ray.get(controller.membership.remote()).workers:
        # A prefill lease nobody pulled (its decode worker refused the request) holds blocks until its TTL.
        assert wait_for(lambda: idle(w), timeout_s=60, interval_s=0.1)


def test_the_last_decode_worker_cannot_be_drained(controller):
    [last] = members(controller, "decode")
    with pytest.raises(ValueError, match="last decode worker"):
        ray.get(controller.drain.remote(last))
    with pytest.raises(ValueError, match="at least one"):
        ray.get(controller.scale.remote("decode", 0))
    assert members(controller, "decode") == [last]


def test_scaling_beyond_max_replicas_is_refused_with_the_limit(controller):
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        ray.get(controller.scale.remote("prefill", 4))


def test_draining_an_unknown_worker_names_the_command_that_lists_workers(controller):
    with pytest.raises(KeyError, match="tandem status"):
        ray.get(controller.drain.remote("decode-99"))


def test_a_worker_that_dies_for_good_is_replaced_by_a_new_one(controller):
    """Ray restarts a crashed worker in place up to max_restarts; one killed outright (or out of restarts)
    is removed and a new worker, with a new id, takes its place."""
    membership = ray.get(controller.membership.remote())
    [victim] = [w for w in membership.workers if w.pool == "decode"]
    since = time.time()
    ray.kill(victim.actor, no_restart=True)
    replaced = wait_for_membership(controller, lambda m: [w.worker_id for w in m.workers if w.pool == "decode"]
                                   not in ([victim.worker_id], []))
    [new] = [w.worker_id for w in replaced.workers if w.pool == "decode"]
    events = [(e.action, e.worker_id, e.reason) for e in ray.get(controller.scaling_events.remote(since))]
    assert ("remove", victim.worker_id, "died") in events
    assert ("add", new, f"replacing {victim.worker_id}") in events
    actor = next(w.actor for w in ray.get(controller.membership.remote()).workers if w.worker_id == new)

    async def one():
        request = GenerateRequest("after-replacement", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=4))
        return [d async for d in run_request(request, actor)]

    assert sum(len(d.new_token_ids) for d in asyncio.run(one())) == 4
