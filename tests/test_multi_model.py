"""Two models in one cluster (ClusterConfig.models): each with its own pools (a disaggregated Llama, a colocated
Qwen2), one API in front. Requests route by `model` and get their own model's greedy output; an unknown model is
a 404 naming both; /v1/models, /health, /metrics (every series labelled model_name), `tandem status`, scale and
drain name the model."""
import random
import urllib.request

import openai
import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from cluster.controller import get_controller
from engine.model_loader import load_tokenizer
from tests.cluster_load import serve_tandem
from tests.helpers import wait_for
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.ray

ADMIN = "multi-model-admin-key-for-tests"


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir, tiny_qwen2_dir):
    config = ClusterConfig(name="mm", namespace="tandem-tests", admin_key=ADMIN, engine={"num_kv_blocks": 64},
                           models=[{"key": "llama", "model": tiny_llama_dir, "served_model_name": ["llama", "l"],
                                    "prefill": {"num_cpus": 0.5}, "decode": {"num_cpus": 0.5}},
                                   {"key": "qwen", "model": tiny_qwen2_dir, "served_model_name": "qwen",
                                    "mode": "colocated", "decode": {"num_cpus": 0.5, "max_replicas": 2}}])
    with serve_tandem(config) as url:
        yield url, config


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def admin(url, method, path, body=None):
    response = requests.request(method, url + path, json=body, headers={"Authorization": f"Bearer {ADMIN}"},
                                timeout=300)
    return response.status_code, response.json()


def test_requests_route_by_model_to_their_own_pools(served, tiny_llama_dir, tiny_qwen2_dir):
    url, _ = served
    rng = random.Random(5)
    ids = [rng.randrange(10, 2000) for _ in range(40)]
    for model, model_dir in (("llama", tiny_llama_dir), ("l", tiny_llama_dir), ("qwen", tiny_qwen2_dir)):
        out = client(url).completions.create(model=model, prompt=ids, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True})
        assert out.model == ("llama" if model == "l" else model)
        expected = load_tokenizer(model_dir).decode(hf_greedy(model_dir, ids, 8), skip_special_tokens=True)
        expected = expected.rstrip("\ufffd")  # a stream holds back an incomplete UTF-8 character at its end
        assert out.choices[0].text == expected, model
    chat = client(url).chat.completions.create(model="qwen", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
    assert chat.model == "qwen" and chat.choices[0].finish_reason == "length"
    assert {m.id for m in client(url).models.list().data} == {"llama", "l", "qwen"}


def test_an_unknown_model_is_a_404_naming_every_model(served):
    url, _ = served
    with pytest.raises(openai.NotFoundError, match="`llama`, `l`, `qwen`"):
        client(url).completions.create(model="mistral", prompt="hi", max_tokens=2)


def test_health_and_metrics_carry_every_model(served):
    url, _ = served
    health = requests.get(url + "/health", timeout=30).json()
    assert health["status"] == "ok" and set(health["models"]) == {"llama", "qwen"}
    assert health["models"]["llama"] == {"decode_workers": 1, "prefill_workers": 1}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        families = {f.name: f.samples for f in text_string_to_metric_families(response.read().decode())}
    running = families["vllm:num_requests_running"]
    assert {s.labels["model_name"] for s in running} == {"llama", "qwen"}
    assert {s.labels["pool"] for s in running if s.labels["model_name"] == "qwen"} == {"decode"}
    success = families["vllm:request_success"]
    assert {s.labels["model_name"] for s in success if s.value > 0} == {"llama", "qwen"}
    assert all("model_name" in s.labels for samples in families.values() for s in samples)


def test_status_scale_and_drain_name_the_model(served):
    url, config = served
    code, status = admin(url, "GET", "/admin/status")
    assert code == 200 and set(status["models"]) == {"llama", "qwen"}
    assert set(status["models"]["llama"]["pools"]) == {"prefill", "decode"}
    code, body = admin(url, "POST", "/admin/scale", {"decode": 2})
    assert code == 400 and "llama, qwen" in body["error"]["message"]
    code, body = admin(url, "POST", "/admin/scale", {"decode": 2, "model": "nope"})
    assert code == 404
    code, body = admin(url, "POST", "/admin/scale", {"decode": 2, "model": "qwen"})
    assert code == 200 and body["pools"]["decode"]["replicas"] == 2 and body["model"] == "qwen"
    qwen, llama = (get_controller(f"mm--{key}", config.namespace) for key in ("qwen", "llama"))
    assert len([w for w in ray.get(qwen.membership.remote()).workers if w.pool == "decode"]) == 2
    assert len([w for w in ray.get(llama.membership.remote()).workers if w.pool == "decode"]) == 1
    added = body["pools"]["decode"]["added"][0]
    code, body = admin(url, "POST", "/admin/drain", {"worker_id": added, "model": "qwen"})
    assert code == 200 and body["removed"]
    assert wait_for(lambda: len(ray.get(qwen.membership.remote()).workers) == 1, timeout_s=60)
    code, events = admin(url, "GET", "/admin/events")
    assert {e["model"] for e in events["events"]} >= {"qwen"}
