"""Placement from measured cost, through the real app with the default config and the default model:
while a decode worker runs streams, cold prompts go to the idle prefill worker instead of stalling them,
and a full prefill queue makes requests wait for a slot instead of falling back to the decode worker."""
import random
import threading
import time
import urllib.request
from contextlib import contextmanager

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from tests.cluster_load import serve_tandem

pytestmark = pytest.mark.slow

MODEL = "smollm2"


def cold_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 40000) for _ in range(n)]


def scrape(url: str) -> list:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def prefills(url: str) -> dict[str, float]:
    samples = scrape(url)
    return {where: total(samples, "tandem:prefills_total", where=where) for where in ("remote", "local")}


def wait_for_prefills(url: str, at_least: float, timeout_s: float = 30.0) -> dict[str, float]:
    """The prefill counters once the ingress polled the workers after `at_least` prefills in all (or at the
    timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        seen = prefills(url)
        if sum(seen.values()) >= at_least or time.monotonic() > deadline:
            return seen
        time.sleep(0.2)


def serve(smollm2_dir, name: str, **options):
    """The README's defaults (placement: slo, slo: {ttft_ms: 2000, itl_ms: 250}) but for `options`; one unpinned
    thread per worker."""
    config = ClusterConfig(model=smollm2_dir, served_model_name=MODEL, name=name, namespace="tandem-tests",
                           engine={"num_kv_blocks": 512}, prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
                           **options)
    assert config.router.placement == "slo"
    with serve_tandem(config) as url:
        yield url, openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def defaults(ray_cluster, smollm2_dir):
    yield from serve(smollm2_dir, "placement-defaults")


@pytest.fixture
def patient(ray_cluster, smollm2_dir):
    """A TTFT SLO of 10 s, so waiting for a prefill slot never risks it on a loaded 2-core machine, and a
    prefill queue of one, so that two requests routed between two stats polls fill it."""
    yield from serve(smollm2_dir, "placement-patient", slo={"ttft_ms": 10000},
                     router={"max_prefill_queue_size": 1})


@contextmanager
def running_streams(url: str, client):
    """Two long streams decoding on the decode worker meanwhile."""
    stop = threading.Event()
    started = [threading.Event(), threading.Event()]

    def stream(i: int) -> None:
        with client.completions.create(model=MODEL, prompt=cold_prompt(8, seed=100 + i), max_tokens=2000,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True}) as chunks:
            for _ in chunks:
                started[i].set()
                if stop.is_set():
                    return

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    before = sum(prefills(url).values())
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    wait_for_prefills(url, before + 2)  # the streams' own prompts, prefilled wherever the policy chose
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def complete(client, prompt: list[int]):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)


def test_a_cold_256_token_prompt_is_prefilled_by_the_idle_prefill_worker_while_streams_run(defaults):
    url, client = defaults
    with running_streams(url, client):
        before = prefills(url)
        assert complete(client, cold_prompt(256, seed=1)).choices[0].finish_reason == "length"
    after = wait_for_prefills(url, sum(before.values()) + 1)
    assert after == {"remote": before["remote"] + 1, "local": before["local"]}
    samples = scrape(url)
    assert total(samples, "tandem:routing_decisions_total", pool="prefill", reason="remote_within_ttft_slo") >= 1
    # What the decision was made with: both workers' measured speeds, the decode worker's pulls.
    for pool in ("prefill", "decode"):
        assert total(samples, "tandem:prefill_tokens_per_second", pool=pool) > 0
        assert total(samples, "tandem:decode_step_seconds", pool=pool) > 0
    assert total(samples, "tandem:kv_pull_gbps", pool="decode") > 0
    assert total(samples, "tandem:kv_pull_latency_seconds", pool="decode") > 0


def test_a_full_prefill_queue_makes_requests_wait_for_a_slot_instead_of_stalling_the_streams(patient):
    url, client = patient
    # Sent at once, each but the first finds the queue full (the requests routed to the prefill worker
    # since its last stats poll) unless a poll falls between them.
    prompts = [cold_prompt(200, seed=10 + i) for i in range(3)]
    results = [None] * len(prompts)

    def send(i: int) -> None:
        results[i] = complete(client, prompts[i])

    with running_streams(url, client):
        before = prefills(url)
        samples = scrape(url)
        waits = total(samples, "tandem:prefill_queue_wait_seconds_count", where="remote")
        queued_s = total(samples, "tandem:flow_queue_seconds_sum")
        threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert all(r is not None and r.choices[0].finish_reason == "length" for r in results)
    after = wait_for_prefills(url, sum(before.values()) + len(prompts))
    reasons = {s.labels["reason"]: s.value for s in scrape(url)
               if s.name == "tandem:routing_decisions_total" and s.labels["pool"] == "decode"}
    assert after == {"remote": before["remote"] + len(prompts), "local": before["local"]}, reasons
    # They waited for the slot: at the ingress, which holds a request that would only wait for a slot
    # (RequestRouter.would_wait), or, when a poll fell between them, in the router's slot queue.
    samples = scrape(url)
    assert (total(samples, "tandem:prefill_queue_wait_seconds_count", where="remote") > waits
            or total(samples, "tandem:flow_queue_seconds_sum") > queued_s)
