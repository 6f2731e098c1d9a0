"""Tenants' quotas through the real server with two ingress replicas: a tenant gets its tokens per minute and its
max_concurrent once for the cluster, not once per replica (router/api/quota_ledger.py, a real Ray actor)."""
import concurrent.futures
import json
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from tests.helpers import free_port

MODEL = "tiny"
KEYS = {"key-a": "a", "key-b": "b"}
ADMIN_KEY = "flowrep-admin-key-0123"
TPM = 600  # tenant a: two requests of 250 output tokens a minute, cluster-wide
LONG = 250


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_llama_dir):
    from ray import serve

    from cluster.app import build_app, shutdown_cluster

    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="flowrep", namespace="tandem-tests",
                           mode="colocated", engine={"num_kv_blocks": 256}, decode={"num_cpus": 0.5},
                           ingress_replicas=2, api_keys=KEYS, admin_key=ADMIN_KEY,
                           tenants={"a": {"tokens_per_minute": TPM}, "b": {"max_concurrent": 1}})
    port = free_port()
    try:
        app = build_app(config)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="flowrep", route_prefix="/flowrep")
        yield f"http://127.0.0.1:{port}/flowrep"
    finally:
        serve.shutdown()
        shutdown_cluster(config.name, config.namespace)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}


def per_replica(url: str, series: str, tenant: str, expected: float) -> dict[str, float]:
    """`series`'s total for `tenant` on each replica, once both replicas have published it and the totals add up
    to `expected` (a replica publishes every few seconds; within 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        totals: dict[str, float] = {}
        for s in scrape(url).get(series, []):
            if s.name == series + "_total" and s.labels.get("tenant") == tenant:
                totals[s.labels["replica"]] = totals.get(s.labels["replica"], 0) + s.value
        if (len(totals) >= 2 and sum(totals.values()) >= expected) or time.monotonic() > deadline:
            return totals
        time.sleep(0.5)


def test_tokens_per_minute_are_the_tenants_once_for_both_replicas(app_url):
    def send(i):
        try:
            out = client(app_url, "key-a").completions.create(
                model=MODEL, prompt=f"Once upon a time {i}", max_tokens=LONG, temperature=0.0,
                extra_body={"ignore_eos": True})
            return out.usage.prompt_tokens + out.usage.completion_tokens
        except openai.RateLimitError as exc:
            assert int(exc.response.headers["Retry-After"]) >= 1
            return None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = []
        for i in range(8):  # spaced, so that Serve sends the next to the replica with fewer requests running
            futures.append(pool.submit(send, i))
            time.sleep(0.3)
        results = [f.result() for f in futures]
    served = [r for r in results if r is not None]
    # Counted per replica, each would have let two through (both replicas take requests: checked below).
    assert len(served) == 2 and sum(served) <= TPM, results
    admitted = per_replica(app_url, "tandem:flow_admitted_requests", "a", 2)
    refused = per_replica(app_url, "tandem:flow_refused_requests", "a", 6)
    traffic = {r: admitted.get(r, 0) + refused.get(r, 0) for r in set(admitted) | set(refused)}
    assert len(traffic) == 2 and all(traffic.values()), traffic  # the requests went to both replicas
    assert sum(admitted.values()) == 2


def test_max_concurrent_holds_across_both_replicas(app_url):
    def stream(i):
        chunks = client(app_url, "key-b").completions.create(
            model=MODEL, prompt=f"Tell me a story {i}", max_tokens=60, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        first = last = None
        tokens = 0
        for chunk in chunks:
            now = time.monotonic()
            if chunk.choices:  # (one chunk may carry several tokens, and a token may have no text yet)
                first = first or now
                last = now
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return first, last, tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = []
        for i in range(4):
            futures.append(pool.submit(stream, i))
            time.sleep(0.3)
        runs = sorted(f.result() for f in futures)
    assert all(tokens == 60 for _, _, tokens in runs), runs  # nothing admitted is lost
    for (_, end, _), (start, _, _) in zip(runs, runs[1:]):
        assert start >= end - 0.05, runs  # one at a time: each stream starts after the one before ended
    admitted = per_replica(app_url, "tandem:flow_admitted_requests", "b", 4)
    assert sum(admitted.values()) == 4 and len([n for n in admitted.values() if n]) == 2, admitted
    errors = [s.value for s in scrape(app_url).get("tandem:flow_ledger_errors", []) if s.name.endswith("_total")]
    assert errors and not any(errors)  # the ledger answered every call


def test_status_shows_every_replicas_queue(app_url):
    """`tandem status` answers from one replica: its own queue live, the other's as it last published it."""
    deadline = time.monotonic() + 30
    while True:
        request = urllib.request.Request(app_url + "/admin/status",
                                         headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        with urllib.request.urlopen(request, timeout=60) as resp:
            status = json.loads(resp.read())
        replicas = {status["flow"]["replica"], *(f["replica"] for f in status["flow_replicas"])}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert len(replicas) == 2, status
    assert all("tenants" in f and f["age_s"] >= 0 for f in status["flow_replicas"])
