"""Flow control through the real server (router/api/flow_control.py): a high-priority request overtakes a
queue of low-priority ones; a tenant over its tokens-per-minute quota gets 429 with a Retry-After at which a
retry succeeds, while another tenant keeps being served; a key's priority cap is enforced; nothing admitted
is lost."""
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
ADMIN_KEY = "flow-admin-key-0123"
TPM = 720  # tenant a's tokens per minute: 12 a second
HOLD_TOKENS = 400  # one request of tenant a: its prompt and 400 tokens, more than half a minute's budget


@pytest.fixture(scope="module")
def app_url(ray_cluster, tiny_llama_dir):
    from ray import serve

    from cluster.app import build_app, shutdown_cluster

    # One request placed at a time: the rest wait in the ingress queue, which orders them.
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="flow", namespace="tandem-tests",
                           engine={"num_kv_blocks": 128}, prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
                           api_keys=KEYS, admin_key=ADMIN_KEY, flow={"max_in_flight": 1, "shed": "low_priority"},
                           slo={"ttft_ms": 600_000},  # no default deadline: only X-Tandem-Deadline-Ms sheds
                           tenants={"a": {"tokens_per_minute": TPM}, "b": {"max_priority": 5}})
    port = free_port()
    try:
        app = build_app(config)
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run(app, name="flow", route_prefix="/flow-app")
        yield f"http://127.0.0.1:{port}/flow-app"
    finally:
        serve.shutdown()
        shutdown_cluster(config.name, config.namespace)


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


def complete(url, key, max_tokens, priority=None, prompt="Once upon a time", headers=None):
    extra = {"ignore_eos": True}
    if priority is not None:
        extra["priority"] = priority
    out = client(url, key).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                                              extra_body=extra, extra_headers=headers)
    return out, time.monotonic()


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        return {f.name: f.samples for f in text_string_to_metric_families(resp.read().decode())}


def counted(url: str, series: str, expected: float, **labels) -> float:
    """The `_total` of `series` with `labels`, once the ingress has published it (within 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        samples = scrape(url).get(series, [])
        value = sum(s.value for s in samples if s.name == series + "_total"
                    and all(s.labels.get(k) == v for k, v in labels.items()))
        if value >= expected or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


def test_a_high_priority_request_overtakes_a_queue_of_low_priority_ones(app_url):
    complete(app_url, "key-b", 4, priority=5)  # warm: every worker has served once
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # One slot: the first low-priority request takes it, the other three queue behind it.
        low = []
        for i in range(4):
            low.append(pool.submit(complete, app_url, "key-b", 300, 10, f"low {i}"))
            time.sleep(0.05)
        time.sleep(0.2)
        urgent = pool.submit(complete, app_url, "key-b", 300, 5, "urgent")  # as long: without the queue, last
        done = {"urgent": urgent.result()[1], **{f"low{i}": f.result()[1] for i, f in enumerate(low)}}
    order = sorted(done, key=done.get)
    # It arrived last and ran as soon as the slot was free: at most the request holding it finished first.
    assert order.index("urgent") <= 1, order
    assert [name for name in order if name != "urgent"] == ["low0", "low1", "low2", "low3"]
    assert all(f.result()[0].usage.completion_tokens == 300 for f in low)  # nothing admitted was lost
    assert counted(app_url, "tandem:flow_admitted_requests", 4, tenant="b", priority="10") == 4
    queued = [s for s in scrape(app_url)["tandem:flow_queued_requests"] if s.labels["tenant"] == "b"]
    assert queued and all(s.value == 0 for s in queued)
    assert counted(app_url, "tandem:flow_pump_errors", 0) == 0  # the watcher's fallback never ran


def test_tandem_status_shows_the_ingress_queue_by_tenant(app_url):
    request = urllib.request.Request(app_url + "/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        flow = json.loads(resp.read())["flow"]
    assert flow["max_in_flight"] == 1 and flow["shed"] == "low_priority" and flow["in_flight"] == 0
    assert flow["tenants"]["b"] == {"running": 0, "queued": 0, "weight": 1.0}  # it has sent requests


def test_a_key_may_not_ask_for_more_urgency_than_its_cap(app_url):
    with pytest.raises(openai.BadRequestError, match="priority 0 is more urgent"):
        complete(app_url, "key-b", 4, priority=0)


def test_a_low_priority_request_that_cannot_meet_its_deadline_is_shed_with_503(app_url):
    """shed: low_priority. No placement meets a 1 ms deadline (the prediction includes the time already
    spent): priority 5 gets 503 with Retry-After at once; priority 0 is never shed; a deadline the prediction
    meets is served; a malformed deadline is a 400 naming the header."""
    with pytest.raises(openai.InternalServerError) as shed:
        complete(app_url, "key-b", 4, priority=5, headers={"X-Tandem-Deadline-Ms": "1"})
    assert shed.value.status_code == 503 and int(shed.value.response.headers["Retry-After"]) >= 1
    assert "deadline" in str(shed.value)
    out, _ = complete(app_url, "key-a", 4, priority=0, headers={"X-Tandem-Deadline-Ms": "1"})
    assert out.usage.completion_tokens == 4
    out, _ = complete(app_url, "key-b", 4, priority=5, headers={"X-Tandem-Deadline-Ms": "60000"})
    assert out.usage.completion_tokens == 4
    for bad in ("0", "-5", "soon", "1.5"):
        with pytest.raises(openai.BadRequestError, match="X-Tandem-Deadline-Ms"):
            complete(app_url, "key-b", 4, priority=5, headers={"X-Tandem-Deadline-Ms": bad})
    assert counted(app_url, "tandem:flow_refused_requests", 1, tenant="b", reason="shed") == 1


def test_a_tenant_over_its_tokens_per_minute_gets_an_honest_retry_after_and_the_other_is_served(app_url):
    complete(app_url, "key-a", HOLD_TOKENS)  # uses its prompt + 400 of 720
    with pytest.raises(openai.RateLimitError) as refused:
        complete(app_url, "key-a", HOLD_TOKENS)
    retry_after = int(refused.value.response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert "tokens per minute" in str(refused.value)
    out, _ = complete(app_url, "key-b", 8, priority=5)  # the other tenant is not held back
    assert out.usage.completion_tokens == 8
    time.sleep(retry_after)
    out, _ = complete(app_url, "key-a", HOLD_TOKENS)  # at the time it said, it goes through
    assert out.usage.completion_tokens == HOLD_TOKENS
    assert counted(app_url, "tandem:flow_refused_requests", 1, tenant="a", reason="tokens_per_minute") == 1
