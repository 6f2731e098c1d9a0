"""KV tiers and peer prefixes through the served cluster: two decode workers whose caches hold two prompts each;
eight prompts push the first ones out to the host tier, and sending those again finds every prefix block,
because the router's index follows the tier events to the worker that holds them, and that worker promotes them
instead of computing. Then one worker is drained: it hands its prefixes to the other, which serves every one of
them from its cache. The same text comes back; no tier copy or peer pull fails.

The placement is Dynamo's token cost (`placement: thresholds`), where a worker's cached blocks decide. The default
(`slo`) prices each worker in seconds from its measured step costs, and for this tiny model a prefix is worth
~3 ms of prefill while the two workers' measured decode steps on a shared 2-core box differ by as much per step:
it sends the prompts to whichever measured faster at the time, holder or not (two clean-clone CI runs in three
re-sent two of decode-0's prompts to decode-1). Its pricing of blocks in a lower tier is tested in
test_router_policy.py."""
import random
import time
import urllib.request

import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from cluster.controller import get_controller
from tests.cluster_load import serve_tandem
from tests.helpers import wait_for

pytestmark = pytest.mark.ray

PROMPT_TOKENS = 160  # 10 blocks of 16; 9 of them can be hits (one token is always computed)
HITS_PER_PROMPT = 144


def scrape(url: str) -> dict[str, list]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def total(samples, name: str) -> float:
    return sum(s.value for s in samples if s.name == name)


@pytest.fixture(scope="module")
def served(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", mode="colocated", name="tiers",
                           namespace="tandem-tests", engine={"num_kv_blocks": 24}, router={"placement": "thresholds"},
                           kv_tiers={"host_gb": 0.004}, decode={"replicas": 2, "num_cpus": 0.5})
    rng = random.Random(41)
    prompts = [[rng.randrange(10, 250) for _ in range(PROMPT_TOKENS)] for _ in range(8)]
    with serve_tandem(config) as url:
        controller = get_controller(config.name, config.namespace)
        # Both workers ready, and their stats reached the ingress, before the prompts are placed.
        assert wait_for(lambda: len(ray.get(controller.membership.remote()).workers) == 2, timeout_s=120)
        time.sleep(1.0)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)

        def complete(prompt):
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        first = [complete(p) for p in prompts]
        yield url, controller, complete, prompts, first


def hits_reaching(url: str, at_least: float) -> dict:
    """The scrape once the prefix hits counted reach `at_least` (the ingress polls stats), or after 30 s."""
    deadline = time.monotonic() + 30
    while True:
        families = scrape(url)
        if total(families["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") >= at_least \
                or time.monotonic() > deadline:
            return families
        time.sleep(0.5)


def test_evicted_prefixes_come_back_from_the_host_tier_of_the_worker_that_holds_them(served):
    url, _, complete, prompts, first = served
    assert total(scrape(url)["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 0
    time.sleep(1.0)  # the router's index follows the last demotions' events
    assert [complete(p) for p in prompts[:4]] == first[:4]
    after = hits_reaching(url, 4 * HITS_PER_PROMPT)
    # every block of every prompt sent again, none computed again
    assert total(after["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") == 4 * HITS_PER_PROMPT
    assert total(after["tandem:kv_tier_hits"], "tandem:kv_tier_hits_total") > 0
    assert total(after["tandem:kv_tier_copy_failures"], "tandem:kv_tier_copy_failures_total") == 0
    used = {s.labels["worker"]: s.value for s in after["tandem:kv_tier_blocks"]}
    assert len(used) == 2 and sum(used.values()) >= 8 * 10 - 2 * 24  # what the two caches could not hold


def test_a_drained_worker_hands_its_prefixes_to_the_one_that_stays(served):
    url, controller, complete, prompts, first = served
    # The one holding most: the first prompts go where the token cost was lowest, so one may hold them all.
    held = {w.worker_id: ray.get(w.actor.stats.remote()).kv_tiers["tiers"]["host"]["num_used"]
            for w in ray.get(controller.membership.remote()).workers}
    drained = max(held, key=held.get)
    [stayer] = set(held) - {drained}
    before = sum(s.value for s in scrape(url)["vllm:prefix_cache_hits"]
                 if s.name == "vllm:prefix_cache_hits_total" and s.labels["worker"] == stayer)
    ray.get(controller.drain.remote(drained, "test"))
    [handoff] = [e for e in ray.get(controller.scaling_events.remote()) if e.action == "handoff"]
    assert handoff.worker_id == drained and not handoff.reason.startswith("0 prefix blocks")
    assert [complete(p) for p in prompts] == first
    after = hits_reaching(url, before + 8 * HITS_PER_PROMPT)
    # every prompt's prefix is on the worker that stays: its own, and the drained one's handed over
    assert total(after["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") - before == 8 * HITS_PER_PROMPT
    assert total(after["tandem:kv_peer_pull_blocks"], "tandem:kv_peer_pull_blocks_total") > 0
    assert total(after["tandem:kv_peer_pull_failures"], "tandem:kv_peer_pull_failures_total") == 0
