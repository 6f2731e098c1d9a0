"""Placement policy: cost-based worker choice per pool and conditional disaggregation."""
import random
from collections import Counter

import pytest

from engine.hashing import block_hashes
from engine.kv_events import KVEvent, KVEventBatch
from router.index import PrefixIndex
from router.policy import (CostWeights, DisaggConfig, NoDecodeWorker, PoolPolicy, Router, WorkerLoad,
                           decide_prefill)

BLOCK = 16
DOC = list(range(5000, 5000 + 128 * BLOCK))  # a 2048-token shared document


def prompt(suffix_seed: int, prefix=DOC, suffix_blocks: int = 4) -> list[int]:
    rng = random.Random(suffix_seed)
    return list(prefix) + [rng.randrange(32000) for _ in range(suffix_blocks * BLOCK)]


def index_with(holdings: dict[str, list[int]]) -> PrefixIndex:
    index = PrefixIndex()
    for worker, tokens in holdings.items():
        index.apply(KVEventBatch(worker, 0, [KVEvent("stored", block_hashes(tokens, BLOCK))]))
    return index


def idle(*workers: str) -> list[WorkerLoad]:
    return [WorkerLoad(w, num_total_blocks=1024) for w in workers]


def place(policy: PoolPolicy, tokens: list[int], loads: list[WorkerLoad]):
    return policy.place(block_hashes(tokens, BLOCK), len(tokens), loads)


def test_picks_the_worker_holding_the_long_prefix():
    index = index_with({"w1": DOC, "w2": DOC[:4 * BLOCK]})
    policy = PoolPolicy(index, BLOCK, rng=random.Random(0))
    placement = place(policy, prompt(1), idle("w0", "w1", "w2", "w3"))
    assert placement.worker_id == "w1"
    assert placement.cached_tokens == len(DOC)


def test_a_busy_prefix_holder_loses_to_an_idle_worker():
    index = index_with({"w1": DOC})
    loads = idle("w0", "w1")
    loads[1].queued_prefill_tokens = 3 * len(DOC)
    placement = place(PoolPolicy(index, BLOCK, rng=random.Random(0)), prompt(1), loads)
    assert placement.worker_id == "w0"
    assert placement.cached_tokens == 0


def test_unrelated_requests_spread_over_the_pool_as_load_builds_up():
    policy = PoolPolicy(PrefixIndex(), BLOCK, rng=random.Random(0))
    loads = idle("w0", "w1", "w2", "w3")
    chosen = Counter()
    for seed in range(8):
        tokens = prompt(seed, prefix=[])
        placement = place(policy, tokens, loads)
        chosen[placement.worker_id] += 1
        next(load for load in loads if load.worker_id == placement.worker_id).num_running += 1
    assert chosen == {"w0": 2, "w1": 2, "w2": 2, "w3": 2}


def test_random_tie_break_covers_every_tied_worker():
    policy = PoolPolicy(PrefixIndex(), BLOCK, rng=random.Random(7))
    loads = idle("w0", "w1", "w2", "w3")
    chosen = {place(policy, prompt(1, prefix=[]), loads).worker_id for _ in range(100)}
    assert chosen == {"w0", "w1", "w2", "w3"}


def test_seeded_rng_makes_tie_breaks_reproducible():
    def picks(seed):
        policy = PoolPolicy(PrefixIndex(), BLOCK, rng=random.Random(seed))
        return [place(policy, prompt(1, prefix=[]), idle("w0", "w1", "w2", "w3")).worker_id for _ in range(20)]
    assert picks(3) == picks(3)


def test_never_picks_an_unhealthy_or_draining_worker_even_with_the_whole_prefix():
    index = index_with({"sick": DOC, "leaving": DOC})
    loads = idle("sick", "leaving", "w2")
    loads[0].healthy = False
    loads[1].draining = True
    placement = place(PoolPolicy(index, BLOCK, rng=random.Random(0)), prompt(1), loads)
    assert placement.worker_id == "w2"


def test_no_schedulable_worker_gives_no_placement():
    loads = idle("w0")
    loads[0].healthy = False
    assert place(PoolPolicy(PrefixIndex(), BLOCK), prompt(1), loads) is None


def test_a_removed_workers_cache_no_longer_attracts_requests():
    index = index_with({"gone": DOC})
    index.remove_worker("gone")
    policy = PoolPolicy(index, BLOCK, rng=random.Random(0))
    placement = place(policy, prompt(1), idle("gone", "w1"))  # a stale load snapshot still lists it
    assert placement.cached_tokens == 0


def test_prefill_weight_trades_cache_hits_against_load():
    index = index_with({"w1": DOC})
    loads = idle("w0", "w1")
    loads[1].num_running = 8  # 8 * 384 token-equivalents of decode load on the holder
    favour_hits = PoolPolicy(index, BLOCK, CostWeights(prefill=4.0), rng=random.Random(0))
    favour_load = PoolPolicy(index, BLOCK, CostWeights(prefill=1.0), rng=random.Random(0))
    assert place(favour_hits, prompt(1), loads).worker_id == "w1"
    assert place(favour_load, prompt(1), loads).worker_id == "w0"


# ---- conditional disaggregation ---------------------------------------------------

CONFIG = DisaggConfig(max_local_prefill_length=2048, max_remote_prefill_cache_hit_ratio=0.7,
                      max_prefill_queue_size=2)
PREFILL = WorkerLoad("p0")


def test_uncached_tokens_at_the_threshold_prefill_locally():
    assert decide_prefill(2048, 0, PREFILL, CONFIG) == decide_prefill(3000, 952, PREFILL, CONFIG)
    assert not decide_prefill(2048, 0, PREFILL, CONFIG).remote
    assert decide_prefill(2048, 0, PREFILL, CONFIG).reason == "short_uncached_prompt"


def test_uncached_tokens_over_the_threshold_prefill_remotely():
    decision = decide_prefill(2049, 0, PREFILL, CONFIG)
    assert decision.remote and decision.reason == "long_uncached_prompt"


def test_a_decode_worker_caching_most_of_the_prompt_prefills_locally():
    assert not decide_prefill(10000, 7000, PREFILL, CONFIG).remote  # 70% cached, 3000 uncached
    assert decide_prefill(10000, 6992, PREFILL, CONFIG).remote


def test_no_healthy_prefill_worker_means_local_prefill():
    assert decide_prefill(8192, 0, None, CONFIG).reason == "no_prefill_worker"
    assert not decide_prefill(8192, 0, WorkerLoad("p0", healthy=False), CONFIG).remote


def test_a_full_prefill_queue_means_local_prefill():
    assert decide_prefill(8192, 0, WorkerLoad("p0", num_waiting=1), CONFIG).remote
    decision = decide_prefill(8192, 0, WorkerLoad("p0", num_waiting=2), CONFIG)
    assert not decision.remote and decision.reason == "prefill_queue_full"


def test_router_sends_a_long_uncached_prompt_to_the_prefill_worker_holding_its_prefix():
    index = index_with({"p1": DOC, "d1": DOC[:BLOCK]})
    router = Router(index, BLOCK, disagg=CONFIG, rng=random.Random(0))
    tokens = prompt(1, suffix_blocks=64)  # 3072 tokens, 3056 uncached on d1
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), idle("p0", "p1"), idle("d0", "d1"))
    assert route.decode.worker_id == "d1"
    assert route.prefill.worker_id == "p1" and route.prefill.cached_tokens == len(DOC)
    assert route.reason == "long_uncached_prompt"


def test_router_lets_the_decode_worker_prefill_a_mostly_cached_prompt():
    index = index_with({"d1": DOC})
    router = Router(index, BLOCK, disagg=CONFIG, rng=random.Random(0))
    tokens = prompt(1, suffix_blocks=64)  # 2048 of 3072 tokens cached on d1, 1024 uncached
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), idle("p0"), idle("d0", "d1"))
    assert route.decode.worker_id == "d1"
    assert route.prefill is None and route.reason == "short_uncached_prompt"


def test_router_without_decode_workers_raises():
    loads = idle("d0")
    loads[0].draining = True
    with pytest.raises(NoDecodeWorker):
        Router(PrefixIndex(), BLOCK).route(block_hashes(DOC, BLOCK), len(DOC), idle("p0"), loads)
