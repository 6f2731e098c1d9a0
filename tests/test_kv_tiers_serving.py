"""KV tiers through the served cluster: two decode workers whose caches hold two prompts each; eight prompts push
the first ones out to the host tier, and sending those again finds every prefix block, because the router's
index follows the tier events to the worker that holds them, and that worker promotes them instead of computing.
The same text comes back; no tier copy fails."""
import random
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from tests.cluster_load import serve_tandem

pytestmark = pytest.mark.ray

PROMPT_TOKENS = 160  # 10 blocks of 16; 9 of them can be hits (one token is always computed)


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def total(samples, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


def test_evicted_prefixes_come_back_from_the_host_tier_of_the_worker_that_holds_them(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", mode="colocated", name="tiers",
                           namespace="tandem-tests", engine={"num_kv_blocks": 24},
                           kv_tiers={"host_gb": 0.004}, decode={"replicas": 2, "num_cpus": 0.5})
    rng = random.Random(41)
    prompts = [[rng.randrange(10, 250) for _ in range(PROMPT_TOKENS)] for _ in range(8)]
    with serve_tandem(config) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        first = [complete(p) for p in prompts]
        before = scrape(url)
        assert total(before["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 0
        time.sleep(1.0)  # the router's index follows the last demotions' events
        again = [complete(p) for p in prompts[:4]]
        assert again == first[:4]
        deadline = time.monotonic() + 30
        while True:
            after = scrape(url)
            hits = total(after["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total")
            if hits >= 4 * 144 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert hits == 4 * 144  # every block of every prompt sent again, none computed again
        assert total(after["tandem:kv_tier_hits"], "tandem:kv_tier_hits_total") > 0
        assert total(after["tandem:kv_tier_copy_failures"], "tandem:kv_tier_copy_failures_total") == 0
        used = {s.labels["worker"]: s.value for s in after["tandem:kv_tier_blocks"]}
        assert len(used) == 2 and all(v > 0 for v in used.values())
