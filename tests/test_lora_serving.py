"""LoRA adapters through the served cluster (a prefill and a decode worker): a request names an adapter as its
`model` and gets what PEFT's merged model generates, the base model's name gets the base model; /v1/models lists
the adapters; vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter (admin key) add and remove one; an unknown
model is a 404 naming what is served; the router counts where adapters were held."""
import random
import time
import urllib.request

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from engine.lora import build_random_adapter, merged_model_dir
from tests.cluster_load import serve_tandem
from tests.hf_reference import hf_greedy

pytestmark = pytest.mark.ray

ADMIN = "lora-admin-key-for-tests"


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-lora")
    made = {"alpha": build_random_adapter(tiny_llama_dir, root / "alpha", seed=11, rank=8,
                                          target_modules=("q_proj", "v_proj", "down_proj")),
            "beta": build_random_adapter(tiny_llama_dir, root / "beta", seed=12, rank=4,
                                         target_modules=("k_proj", "o_proj", "gate_proj"))}
    return {name: (str(path), str(merged_model_dir(tiny_llama_dir, path, root / f"{name}-merged")))
            for name, path in made.items()}


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir, adapters):
    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", name="lora", namespace="tandem-tests",
                           admin_key=ADMIN, lora={"modules": {"alpha": adapters["alpha"][0]}, "max_loras": 2},
                           engine={"num_kv_blocks": 64}, prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
                           router={"max_local_prefill_length": 16})  # prompts go to the prefill worker
    with serve_tandem(config) as url:
        yield url


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def text(url, model, ids, max_tokens=10) -> str:
    out = client(url).completions.create(model=model, prompt=ids, max_tokens=max_tokens, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.model == model  # responses name the adapter asked for
    return out.choices[0].text


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def prompt(seed: int, n: int = 40) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(n)]


def hf_text(model_dir: str, ids: list[int], max_tokens: int = 10) -> str:
    from engine.model_loader import load_tokenizer
    # a stream holds back an incomplete UTF-8 character at its end; a whole decode shows it as U+FFFD
    return load_tokenizer(model_dir).decode(hf_greedy(model_dir, ids, max_tokens), skip_special_tokens=True).rstrip("\ufffd")


def test_models_lists_the_adapters_with_their_base(served, adapters):
    cards = {m.id: m for m in client(served).models.list().data}
    assert set(cards) == {"tiny", "alpha"}
    assert cards["alpha"].parent == "tiny" and cards["alpha"].root == adapters["alpha"][0]


def test_an_adapter_named_as_model_generates_what_the_merged_model_does(served, adapters, tiny_llama_dir):
    for seed in (1, 2):
        ids = prompt(seed, 40 if seed == 1 else 90)
        assert text(served, "alpha", ids) == hf_text(adapters["alpha"][1], ids)
        assert text(served, "tiny", ids) == hf_text(tiny_llama_dir, ids)
    families = scrape(served)
    lora = {s.labels["outcome"] for s in families["tandem:routing_lora"] if s.value > 0}
    assert "hit" in lora  # the second request for alpha went where a slot held it
    assert sum(s.value for s in families["tandem:lora_loads"] if s.name.endswith("_total")) >= 1
    # the prompts' KV moved from the prefill worker to the decode worker (computed there under the adapter)
    assert sum(s.value for s in families["tandem:prefills"] if s.labels["where"] == "remote") >= 4
    assert [s for s in families["tandem:kv_transfer_failures"] if s.value > 0] == []


def test_an_unknown_model_is_a_404_naming_what_is_served(served):
    with pytest.raises(openai.NotFoundError, match="`tiny`, `alpha`"):
        client(served).completions.create(model="gamma", prompt="hi", max_tokens=2)


def test_adapters_load_and_unload_through_vllms_endpoints(served, adapters):
    body = {"lora_name": "beta", "lora_path": adapters["beta"][0]}
    assert requests.post(served + "/v1/load_lora_adapter", json=body, timeout=30).status_code == 401
    auth = {"Authorization": f"Bearer {ADMIN}"}
    loaded = requests.post(served + "/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
    assert loaded.status_code == 200 and "added successfully" in loaded.text
    again = requests.post(served + "/v1/load_lora_adapter", json=body, headers=auth, timeout=30)
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = requests.post(served + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nonexistent"},
                        headers=auth, timeout=30)
    assert bad.status_code == 400 and "not a PEFT adapter directory" in bad.json()["error"]["message"]
    ids = prompt(3)
    deadline = time.monotonic() + 30  # the ingress follows the controller's registry with the membership
    while "beta" not in {m.id for m in client(served).models.list().data} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert text(served, "beta", ids) == hf_text(adapters["beta"][1], ids)
    gone = requests.post(served + "/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=auth, timeout=30)
    assert gone.status_code == 200
    missing = requests.post(served + "/v1/unload_lora_adapter", json={"lora_name": "beta"}, headers=auth, timeout=30)
    assert missing.status_code == 404
    deadline = time.monotonic() + 30
    while "beta" in {m.id for m in client(served).models.list().data} and time.monotonic() < deadline:
        time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        client(served).completions.create(model="beta", prompt=ids, max_tokens=2)
