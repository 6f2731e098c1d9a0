"""/metrics after real traffic through the real ingress, read the way Prometheus reads it: the series of
DESIGN.md §3 exist, and their values agree with the traffic that was sent."""
import math
import time
import urllib.request
from collections import defaultdict

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from tests.helpers import free_port

MODEL = "tiny"
MAX_TOKENS = 7
SHARED = "The quick brown fox jumps over the lazy dog. " * 6  # a few full KV blocks, shared by requests


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_llama_dir):
    from ray import serve

    from cluster.app import build_app, shutdown_cluster

    # max_local_prefill_length=0: every prompt is prefilled remotely, so KV transfer series move too.
    # Two ingress replicas: a scrape reaches one of them and must still show the whole cluster.
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="metrics", namespace="tandem-tests",
                           engine={"num_kv_blocks": 128}, router={"max_local_prefill_length": 0},
                           prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5}, ingress_replicas=2)
    port = free_port()
    try:
        # The apps first: their cluster controllers start the workers, which load while Serve starts.
        app = build_app(config)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="metrics", route_prefix="/metrics-app")
        yield f"http://127.0.0.1:{port}/metrics-app"
    finally:
        serve.shutdown()
        shutdown_cluster(config.name, config.namespace)


@pytest.fixture(scope="module")
def traffic(app_url):
    """Six requests (the last five share a prefix; two stream), and what the client received."""
    client = openai.OpenAI(base_url=app_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    prompts = ["Once upon a time"] + [SHARED + f"Request {i}." for i in range(5)]
    received = 0
    for i, prompt in enumerate(prompts):
        kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "logprobs": 0, "extra_body": {"ignore_eos": True}}
        if i % 3 == 2:
            chunks = list(client.completions.create(stream=True, **kwargs))
            received += sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs)
        else:
            received += len(client.completions.create(**kwargs).choices[0].logprobs.tokens)
    return {"requests": len(prompts), "tokens": received}


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.fixture(scope="module")
def metrics(app_url, traffic):
    """The scrape once the ingress has polled the workers' stats after the last request."""
    deadline = time.monotonic() + 30
    while True:
        families = scrape(app_url)
        generated = total(families.get("vllm:generation_tokens", []), "vllm:generation_tokens_total")
        finished = total(families.get("vllm:request_success", []), "vllm:request_success_total")
        replicas = {s.labels["replica"] for s in families.get("tandem:requests_rejected", [])}
        # Other replicas publish their series every few seconds: wait for the last of them too.
        if (generated >= traffic["tokens"] and finished >= traffic["requests"] and len(replicas) == 2) \
                or time.monotonic() > deadline:
            return families
        time.sleep(0.2)


def test_every_scrape_adds_up_the_series_of_both_ingress_replicas(app_url, metrics, traffic):
    for _ in range(8):  # each scrape reaches either replica
        families = scrape(app_url)
        # Every replica exports its admission counter from the start, whatever traffic it got.
        assert len({s.labels["replica"] for s in families["tandem:requests_rejected"]}) == 2
        success = families["vllm:request_success"]
        assert total(success, "vllm:request_success_total") == traffic["requests"]
        assert total(families["tandem:routing_decisions"], "tandem:routing_decisions_total", pool="decode") \
            == traffic["requests"]
        # Per-worker series have one source, the worker: they carry no replica label and are not doubled.
        assert all("replica" not in s.labels for s in families["vllm:generation_tokens"])
        assert total(families["vllm:generation_tokens"], "vllm:generation_tokens_total") == traffic["tokens"]


def test_a_config_for_other_workers_is_refused_while_the_cluster_runs(app_url, tiny_llama_dir):
    from cluster.app import build_app
    from cluster.config import ConfigError

    other = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="metrics", namespace="tandem-tests",
                          engine={"num_kv_blocks": 128, "block_size": 32}, router={"max_local_prefill_length": 0},
                          prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5})
    with pytest.raises(ConfigError, match=r"engine\.block_size.*refusing"):
        build_app(other)


def test_every_documented_series_is_exported(metrics):
    expected = {
        "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_success",
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:prompt_tokens", "vllm:generation_tokens",
        "vllm:num_preemptions", "tandem:kv_transfer_seconds", "tandem:kv_transfer_bytes", "tandem:prefills",
        "tandem:kv_transfer_failures",
        "tandem:routing_decisions", "tandem:routing_prefix_hit_blocks", "tandem:scaling_events",
        "tandem:pool_replicas", "tandem:autoscaler_desired_replicas", "tandem:queued_prefill_tokens",
        "tandem:cpu_busy_lends", "tandem:cpu_reclaim_timeouts", "tandem:cpu_kernel_fallbacks"}
    assert expected <= set(metrics)
    # the C kernels built on every worker: nothing fell back to torch
    fallbacks = metrics["tandem:cpu_kernel_fallbacks"]
    assert {s.labels["pool"] for s in fallbacks} == {"prefill", "decode"} and all(s.value == 0 for s in fallbacks)


def test_request_histograms_count_every_request_and_every_token_gap(metrics, traffic):
    n, tokens = traffic["requests"], traffic["tokens"]
    assert tokens == n * MAX_TOKENS
    ttft = metrics["vllm:time_to_first_token_seconds"]
    assert total(ttft, "vllm:time_to_first_token_seconds_count") == n
    assert total(metrics["vllm:e2e_request_latency_seconds"], "vllm:e2e_request_latency_seconds_count") == n
    assert total(metrics["vllm:inter_token_latency_seconds"], "vllm:inter_token_latency_seconds_count") \
        == tokens - n
    assert total(metrics["vllm:request_success"], "vllm:request_success_total", finished_reason="length") == n


def test_every_request_is_prefilled_once_and_each_remote_prefill_transfers_kv(metrics, traffic):
    # Once the decode worker caches most of the shared prefix, it prefills the rest itself.
    remote = total(metrics["tandem:prefills"], "tandem:prefills_total", where="remote")
    local = total(metrics["tandem:prefills"], "tandem:prefills_total", where="local")
    assert remote >= 1 and remote + local == traffic["requests"]
    assert total(metrics["tandem:kv_transfer_seconds"], "tandem:kv_transfer_seconds_count") == remote


def test_no_kv_pull_fails_on_the_normal_path_and_every_reason_is_exported(metrics):
    from kv_transfer.failures import FAILURE_REASONS

    failures = [s for s in metrics["tandem:kv_transfer_failures"] if s.name == "tandem:kv_transfer_failures_total"]
    assert {s.labels["reason"] for s in failures} == set(FAILURE_REASONS)
    assert {s.labels["pool"] for s in failures} == {"decode"}
    assert sum(s.value for s in failures) == 0


def test_kv_transfer_failures_are_exported_per_decode_worker_and_reason():
    from router.metrics import WorkerStatsCollector

    collector = WorkerStatsCollector()
    collector.transfer["decode-3"] = {"bytes_pulled": 0, "remote_prefills": 0, "local_prefills": 2,
                                      "transfer_failures_by_reason": {"unreachable": 2, "timeout": 0}}
    [family] = [f for f in collector.collect() if f.name == "tandem:kv_transfer_failures"]
    assert {(s.name, s.labels["worker"], s.labels["reason"], s.value) for s in family.samples} == {
        ("tandem:kv_transfer_failures_total", "decode-3", "unreachable", 2.0),
        ("tandem:kv_transfer_failures_total", "decode-3", "timeout", 0.0)}


def test_prefill_time_is_observed_for_every_remote_prefill(metrics):
    remote = total(metrics["tandem:prefills"], "tandem:prefills_total", where="remote")
    assert total(metrics["vllm:request_prefill_time_seconds"], "vllm:request_prefill_time_seconds_count") == remote


def test_histogram_buckets_are_cumulative_and_end_at_the_count(metrics):
    histograms = [name for name, samples in metrics.items() if any(s.name == name + "_bucket" for s in samples)]
    assert {"vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prefill_time_seconds", "tandem:kv_transfer_seconds"} <= set(histograms)
    for name in histograms:
        series = defaultdict(list)
        for s in metrics[name]:
            key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
            series[key].append(s)
        for key, samples in series.items():
            buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == name + "_bucket")
            counts = [v for _, v in buckets]
            assert counts == sorted(counts), (name, key)
            assert buckets[-1][0] == math.inf
            assert buckets[-1][1] == next(s.value for s in samples if s.name == name + "_count")
            assert next(s.value for s in samples if s.name == name + "_sum") >= 0


def test_worker_gauges_are_in_range_and_idle_after_the_traffic(metrics):
    usage = metrics["vllm:kv_cache_usage_perc"]
    assert {s.labels["pool"] for s in usage} == {"prefill", "decode"}
    assert all(0.0 <= s.value <= 1.0 for s in usage)
    assert total(metrics["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    assert total(metrics["vllm:num_requests_waiting"], "vllm:num_requests_waiting") == 0


def test_prefix_hits_never_exceed_queries_and_the_shared_prefix_hit(metrics):
    queries = {s.labels["worker"]: s.value for s in metrics["vllm:prefix_cache_queries"]}
    hits = {s.labels["worker"]: s.value for s in metrics["vllm:prefix_cache_hits"]}
    assert set(hits) == set(queries)
    assert all(hits[w] <= queries[w] for w in hits)
    assert sum(hits.values()) > 0  # the requests after the first shared one reuse the shared prefix


def test_generated_tokens_equal_the_tokens_clients_received(metrics, traffic):
    assert total(metrics["vllm:generation_tokens"], "vllm:generation_tokens_total") == traffic["tokens"]


def test_routing_and_pool_series_match_the_cluster(metrics, traffic):
    decisions = metrics["tandem:routing_decisions"]
    assert total(decisions, "tandem:routing_decisions_total", pool="decode") == traffic["requests"]
    assert total(metrics["tandem:pool_replicas"], "tandem:pool_replicas", pool="decode") == 1
    assert total(metrics["tandem:pool_replicas"], "tandem:pool_replicas", pool="prefill") == 1
    assert total(metrics["tandem:autoscaler_desired_replicas"], "tandem:autoscaler_desired_replicas",
                 pool="decode") == 1
    assert total(metrics["tandem:kv_transfer_bytes"], "tandem:kv_transfer_bytes_total") > 0


def test_the_metrics_hub_keeps_each_live_replicas_queue_for_status(monkeypatch):
    from router.metrics import MetricsHub

    now = [100.0]
    monkeypatch.setattr("router.metrics.time.monotonic", lambda: now[0])
    hub = MetricsHub(ttl_s=30.0)
    hub.publish("r1", b"", {"replica": "r1", "in_flight": 2})
    now[0] += 10
    hub.publish("r2", b"", {"replica": "r2", "in_flight": 0})
    assert hub.replica_flows() == [{"replica": "r1", "in_flight": 2, "age_s": 10.0},
                                   {"replica": "r2", "in_flight": 0, "age_s": 0.0}]
    now[0] += 25  # r1 silent for 35 s: gone, as its series are
    assert [f["replica"] for f in hub.replica_flows()] == ["r2"]
    hub.forget("r2")
    assert hub.replica_flows() == []
