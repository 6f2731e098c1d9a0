"""The cluster controller is no single point of failure: `kill -9` of its process under load through the real
ingress fails no request (the ingress keeps routing from its last membership, the workers outlive it), Ray
restarts it, the restarted controller adopts the live workers with their ids, and scaling works again."""
import asyncio
import os
import signal
import time

import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.app import shutdown_cluster
from cluster.config import ClusterConfig
from cluster.controller import get_controller
from tests.cluster_load import failures, has_served, serve_tandem
from tests.helpers import metric, wait_off_loop
from tests.test_controller import MODEL, served_more, under_load

pytestmark = pytest.mark.slow

NAME, NAMESPACE = "restartable", "tandem-tests"
MAX_REQUESTS = 5000  # only bounds the load's loop: the test's stop ends it


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name=NAME, namespace=NAMESPACE,
                           engine={"num_kv_blocks": 128, "max_num_batched_tokens": 256},
                           prefill={"max_replicas": 2, "num_cpus": 0.5}, decode={"max_replicas": 3, "num_cpus": 0.5},
                           router={"max_local_prefill_length": 0})
    with serve_tandem(config) as url:
        yield url, get_controller(NAME, NAMESPACE)


def workers(controller) -> dict[str, str]:
    return {w.worker_id: w.pool for w in ray.get(controller.membership.remote(), timeout=30).workers}


def controller_pid(controller) -> int | None:
    """The controller process's pid, or None while it is away (dead or restarting)."""
    try:
        return ray.get(controller.__ray_call__.remote(lambda _: os.getpid()), timeout=10)
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return None


def test_the_controller_killed_under_load_comes_back_with_its_workers_and_scales_again(app):
    url, controller = app
    before = workers(controller)
    assert sorted(before.values()) == ["decode", "prefill"]
    pid = controller_pid(controller)
    steps = {}

    async def operations(client):
        since = time.time()
        os.kill(pid, signal.SIGKILL)
        assert await wait_off_loop(lambda: controller_pid(controller) not in (None, pid), timeout_s=180)
        steps["after"] = await asyncio.to_thread(workers, controller)
        steps["events"] = [(e.action, e.worker_id, e.reason)
                           for e in await controller.scaling_events.remote(since)]
        await served_more(client, MAX_REQUESTS)  # the load keeps running on the adopted workers
        steps["up"] = await controller.scale.remote("decode", 2)
        new = {w.worker_id: w.actor for w in (await controller.membership.remote()).workers}[steps["up"].added[0]]
        # The ingress routes to workers the new controller adds (on a loaded machine the restart and the
        # scale-up take minutes, so the load must run on until then: its bound is the stop, not a count).
        assert await wait_off_loop(lambda: has_served(new), timeout_s=180)

    client = under_load(app, operations, seed=21, max_tokens=(16, 48), max_requests=MAX_REQUESTS)
    assert failures(client.outcomes) == []
    assert len(client.outcomes) >= 20
    assert steps["after"] == before  # the same workers, same ids
    assert sorted(steps["events"]) == sorted(("adopt", w, "controller restarted") for w in before)
    [added] = steps["up"].added
    assert added not in before and steps["up"].replicas == 2  # ids are never reused
    # The restarted controller gave the new worker its workers' KV token: the new decode worker pulls
    # prompts from the adopted prefill worker, and none was refused for its token. (Other fallbacks, such
    # as no free blocks with 48 requests in flight on 128 blocks, are load, not the restart.)
    assert metric(url, "tandem:prefills_total", worker=added, where="remote") > 0
    assert metric(url, "tandem:kv_transfer_failures_total", reason="unauthenticated") == 0, failures_by_reason(url)


def failures_by_reason(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {f"{s.labels['worker']}/{s.labels['reason']}": s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "tandem:kv_transfer_failures_total" and s.value}


def test_stopping_the_cluster_stops_the_adopted_workers_too(app):
    """Last in the module. Workers are detached: stopping the cluster stops them by name, also those a
    restarted controller adopted."""
    _, controller = app
    names = {f"{NAME}-{w}" for w in workers(controller)}
    assert names <= named_actors()
    shutdown_cluster(NAME, NAMESPACE)
    assert not names & named_actors()


def named_actors() -> set[str]:
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == NAMESPACE}

