"""What operators read through the ingress: /metrics, the admin API it mounts, the latencies it reports."""
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.controller import get_controller
from tests.helpers import wait_for
from tests.ingress.conftest import ADMIN_KEY, MODEL


def samples(app) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(app.get("/metrics").text) for s in family.samples}


def test_metrics_count_requests_tokens_routing_and_pool_sizes(main_app):
    before = samples(main_app)
    out = main_app.client().completions.create(model=MODEL, prompt="Metrics please", max_tokens=5, temperature=0,
                                               extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 5
    after = samples(main_app)

    def grown(name: str) -> float:
        keys = {k for k in after if k[0] == name}
        return sum(after[k] - before.get(k, 0.0) for k in keys)

    assert grown("vllm:time_to_first_token_seconds_count") == 1
    assert grown("vllm:inter_token_latency_seconds_count") == 4
    assert grown("vllm:request_success_total") == 1
    assert grown("tandem:routing_decisions_total") >= 1
    # every series names its model (vLLM's model_name)
    assert after[("tandem:pool_replicas", (("model_name", MODEL), ("pool", "decode")))] == 2
    assert after[("tandem:pool_replicas", (("model_name", MODEL), ("pool", "prefill")))] == 1
    assert all(dict(labels).get("model_name") == MODEL for _, labels in after)
    usage = {k: v for k, v in after.items() if k[0] == "vllm:kv_cache_usage_perc"}
    assert len(usage) == 3 and all(0.0 <= v <= 1.0 for v in usage.values())


def test_admin_api_is_mounted_with_its_own_key(main_app):
    url = f"{main_app.base_url}/admin/status"
    assert requests.get(url, headers={"Authorization": "Bearer key-a"}, timeout=30).status_code == 401
    status = requests.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert status.status_code == 200
    assert {w["worker_id"] for w in status.json()["pools"]["decode"]["workers"]} == {"decode-0", "decode-1"}


def test_observed_latencies_reach_the_controller_for_the_autoscaler(main_app):
    controller = get_controller(main_app.config.name, main_app.config.namespace)

    # Counted by arrival time: the window is bounded (8,192 samples each), and earlier tests fill it.
    def newest() -> float:
        return ray.get(controller.__ray_call__.remote(
            lambda self: max((q[-1][0] for q in self.latency.samples.values() if q), default=float("-inf"))))

    def reported_since(since: float) -> tuple[int, int]:
        return ray.get(controller.__ray_call__.remote(lambda self: tuple(
            sum(1 for t, _ in self.latency.samples.get(name, ()) if t > since) for name in ("ttft_s", "itl_s"))))

    since = newest()
    main_app.client().completions.create(model=MODEL, prompt="Latency", max_tokens=4, temperature=0,
                                         extra_body={"ignore_eos": True})
    # At least: an earlier request's samples may still be on their way too.
    assert wait_for(lambda: (now := reported_since(since))[0] >= 1 and now[1] >= 3)
