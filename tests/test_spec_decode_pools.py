"""Speculative decoding as the decode pool's default, on real prefill and decode actors: the decode side
of a remote prefill speculates, the output is plain greedy decoding's, and the worker's counters reach
the vllm:spec_decode_* series with its pool and worker labels."""
import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest
from router.metrics import WorkerStatsCollector
from tests.hf_reference import hf_greedy
from tests.pool_helpers import only, run_all

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[33280] * 8 + [5, 6, 7, 8, 33280, 33280, 33280], [5, 6, 7, 8, 9, 10] * 3]


@pytest.fixture(scope="module")
def pools(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, name="spec", engine={"num_kv_blocks": 96},
                           prefill={"resources": {"prefill_pool": 1}, "num_cpus": 1},
                           decode={"resources": {"decode_pool": 1}, "num_cpus": 1},
                           speculative_config={"num_speculative_tokens": 4, "adaptive": False})
    pools = Pools(config)
    pools.start()
    yield pools
    pools.shutdown()


def test_decode_side_of_a_remote_prefill_speculates_and_matches_greedy(pools, tiny_llama_dir):
    results = run_all([GenerateRequest(f"s{i}", p, GREEDY) for i, p in enumerate(PROMPTS)],
                      only(pools.decode), only(pools.prefill))
    for prompt, (tokens, _) in zip(PROMPTS, results):
        assert tokens == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    assert ray.get(only(pools.decode).transfer_stats.remote())["remote_prefills"] >= len(PROMPTS)
    decode = ray.get(only(pools.decode).stats.remote())
    assert decode.spec_decode.num_accepted_tokens > 0
    assert ray.get(only(pools.prefill).stats.remote()).spec_decode is None  # the pool default is decode's


def test_a_request_opting_out_does_not_speculate(pools):
    before = ray.get(only(pools.decode).stats.remote()).spec_decode.num_drafts
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, speculative=False)
    run_all([GenerateRequest("out", PROMPTS[0], params)], only(pools.decode), only(pools.prefill))
    assert ray.get(only(pools.decode).stats.remote()).spec_decode.num_drafts == before


def test_spec_decode_counters_are_exported_with_vllm_names(pools):
    run_all([GenerateRequest("m", PROMPTS[0], GREEDY)], only(pools.decode), only(pools.prefill))
    stats = ray.get(only(pools.decode).stats.remote())
    collector = WorkerStatsCollector()
    collector.update(stats)
    samples = {(s.name, s.labels.get("position")): s for f in collector.collect() for s in f.samples
               if f.name.startswith("vllm:spec_decode")}
    spec = stats.spec_decode
    assert samples["vllm:spec_decode_num_drafts_total", None].value == spec.num_drafts > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total", None].value == spec.num_draft_tokens
    assert samples["vllm:spec_decode_num_accepted_tokens_total", None].value == spec.num_accepted_tokens > 0
    assert samples["vllm:spec_decode_num_accepted_tokens_per_pos_total", "0"].value == spec.num_accepted_tokens_per_pos[0]
    assert {s.labels["pool"] for s in samples.values()} == {"decode"}
    assert {s.labels["worker"] for s in samples.values()} == {stats.worker_id}
