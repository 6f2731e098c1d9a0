"""Peer prefix pulls between real workers (issue 41): a prefix cached only on worker A, in its cache or in
its host tier, is pulled by worker B instead of computed (bytes counted, no prompt token of it computed again,
the same output), through A's lease, which B releases; a holder that is gone, or killed mid-pull, leaves B to
compute, counted; a prefill worker pulls what a decode worker holds, and the decode worker imports the rest."""
import random
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

from cluster.config import ClusterConfig
from cluster.pools import Pools
from engine import SamplingParams
from worker_runtime.protocol import GenerateRequest, PrefixSource
from tests.helpers import wait_for
from tests.pool_helpers import run_all
from tests.worker_kills import freeze_kv_export, kill_when_frozen

pytestmark = pytest.mark.ray

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
BS = 16


@pytest.fixture(scope="module")
def pair(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, mode="colocated", name="peers", engine={"num_kv_blocks": 40},
                           kv_tiers={"host_gb": 0.002}, decode={"replicas": 2, "num_cpus": 0.5})
    pools = Pools(config)
    pools.start()
    (a_id, a), (b_id, b) = sorted((worker_id, info.actor) for worker_id, info in pools.decode.workers.items())
    yield (a_id, a), (b_id, b)
    pools.shutdown()


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def pulled(b, request_id, tokens, source) -> list[int]:
    request = GenerateRequest(request_id, tokens, GREEDY)
    request.prefix_source = source
    [(out, _)] = run_all([request], b)
    return out


def test_a_prefix_cached_only_on_a_is_pulled_by_b_and_not_computed_again(pair):
    (a_id, a), (b_id, _b) = pair
    b = _b
    tokens = prompt(1)
    [(want, _)] = run_all([GenerateRequest("on-a", tokens, GREEDY)], a)
    before = ray.get(b.stats.remote())
    got = pulled(b, "on-b", tokens, PrefixSource(a_id, a, (len(tokens) - 1) // BS))
    assert got == want
    stats, transfer = ray.get(b.stats.remote()), ray.get(b.transfer_stats.remote())
    assert transfer["peer_pulls"] == 1 and transfer["peer_blocks_pulled"] == 12
    assert transfer["peer_bytes_pulled"] == 12 * BS * stats.kv_bytes_per_token
    assert not any(transfer["peer_pull_failures_by_reason"].values())
    assert stats.prefix_cache_hits - before.prefix_cache_hits == 12 * BS  # none of the pulled tokens computed
    assert wait_for(lambda: ray.get(a.stats.remote()).num_active_blocks == 0)  # B released A's lease


def test_a_prefix_in_the_holders_host_tier_is_brought_back_and_pulled(pair):
    (a_id, a), (_, b) = pair
    tokens = prompt(2)
    [(want, _)] = run_all([GenerateRequest("tier-a", tokens, GREEDY)], a)
    for i in range(3):  # 3 x 14 blocks through a cache of 40: the first prompt's blocks go to the host tier
        run_all([GenerateRequest(f"evict-{i}", prompt(100 + i), GREEDY)], a)
    tiers = ray.get(a.stats.remote()).kv_tiers["tiers"]["host"]
    assert tiers["num_used"] > 0
    hits_before = tiers["hits"]
    before = ray.get(b.transfer_stats.remote())["peer_blocks_pulled"]
    assert pulled(b, "tier-b", tokens, PrefixSource(a_id, a, (len(tokens) - 1) // BS)) == want
    assert ray.get(b.transfer_stats.remote())["peer_blocks_pulled"] - before == 12
    assert ray.get(a.stats.remote()).kv_tiers["tiers"]["host"]["hits"] > hits_before


def test_a_holder_killed_while_its_blocks_are_pulled_leaves_the_puller_to_compute_counted(pair):
    """A freezes while B pulls from it (its KV export, and the lease release that confirms a shared-memory copy,
    never answer) and its process is killed there: B computes the prompt instead (the same tokens), one failed
    pull counted, nothing B reserved for the pull leaks; Ray starts A again in place."""
    (a_id, a), (_, b) = pair
    tokens = prompt(5)
    [(want, _)] = run_all([GenerateRequest("mid-a", tokens, GREEDY)], a)
    ray.get(a.__ray_call__.remote(freeze_kv_export))
    before = ray.get(b.transfer_stats.remote())
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(pulled, b, "mid-b", tokens, PrefixSource(a_id, a, (len(tokens) - 1) // BS))
        kill_when_frozen(a)
        assert got.result(timeout=180) == want
    after = ray.get(b.transfer_stats.remote())
    failed = {r: n - before["peer_pull_failures_by_reason"].get(r, 0)
              for r, n in after["peer_pull_failures_by_reason"].items()}
    assert sum(failed.values()) == 1, failed
    assert after["peer_blocks_pulled"] == before["peer_blocks_pulled"]  # nothing of the pull was kept
    assert wait_for(lambda: ray.get(b.stats.remote()).num_active_blocks == 0)
    assert wait_for(lambda: back(a), timeout_s=120)  # Ray started A again


def back(actor) -> bool:
    try:
        return ray.get(actor.stats.remote(), timeout=30).num_active_blocks == 0
    except ray.exceptions.RayError:  # still restarting
        return False


def test_a_holder_that_is_gone_leaves_the_puller_to_compute_counted(pair):
    (a_id, a), (_, b) = pair
    tokens = prompt(3)
    [(want, _)] = run_all([GenerateRequest("gone-a", tokens, GREEDY)], a)
    ray.kill(a, no_restart=True)
    failures = ray.get(b.transfer_stats.remote())["peer_pull_failures_by_reason"]
    assert pulled(b, "gone-b", tokens, PrefixSource(a_id, a, (len(tokens) - 1) // BS)) == want
    after = ray.get(b.transfer_stats.remote())["peer_pull_failures_by_reason"]
    assert after["unreachable"] == failures["unreachable"] + 1
    assert wait_for(lambda: ray.get(b.stats.remote()).num_active_blocks == 0)  # nothing reserved leaks


@pytest.fixture(scope="module")
def disaggregated(ray_cluster, tiny_llama_dir):
    config = ClusterConfig(model=tiny_llama_dir, name="peers-pd", engine={"num_kv_blocks": 40},
                           prefill={"replicas": 1, "num_cpus": 0.5}, decode={"replicas": 1, "num_cpus": 0.5})
    pools = Pools(config)
    pools.start()
    (p_id, p), = ((w, info.actor) for w, info in pools.prefill.workers.items())
    (d_id, d), = ((w, info.actor) for w, info in pools.decode.workers.items())
    yield (p_id, p), (d_id, d)
    pools.shutdown()


def test_a_prefill_worker_pulls_the_prefix_a_decode_worker_holds_and_decode_imports_the_rest(disaggregated):
    """The prompt computed on the decode worker first (a local prefill); the same prompt placed on the prefill worker
    with the decode worker named as the holder: the prefill worker pulls the 12 prefix blocks instead of computing
    them, computes the rest, and the decode worker imports only what it lacks. Same tokens as the local run."""
    (p_id, p), (d_id, d) = disaggregated
    tokens = prompt(4)
    [(want, _)] = run_all([GenerateRequest("pd-local", tokens, GREEDY)], d)
    hits_before = ray.get(p.stats.remote()).prefix_cache_hits
    request = GenerateRequest("pd-remote", tokens, GREEDY)
    request.prefix_source = PrefixSource(d_id, d, (len(tokens) - 1) // BS)
    [(got, _)] = run_all([request], d, p)
    assert got == want
    transfer, stats = ray.get(p.transfer_stats.remote()), ray.get(p.stats.remote())
    assert transfer["peer_pulls"] == 1 and transfer["peer_blocks_pulled"] == 12
    assert transfer["peer_bytes_pulled"] == 12 * BS * stats.kv_bytes_per_token
    assert not any(transfer["peer_pull_failures_by_reason"].values())
    assert stats.prefix_cache_hits - hits_before == 12 * BS  # the pulled tokens were not computed
    assert stats.pulls_prefixes
    assert wait_for(lambda: ray.get(d.stats.remote()).num_active_blocks == 0)  # the prefill worker released its lease
    assert wait_for(lambda: ray.get(p.num_leases.remote()) == 0)
