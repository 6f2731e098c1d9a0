"""Placement policy: cost-based worker choice per pool and conditional disaggregation."""
import dataclasses
import math
import random
from collections import Counter

import pytest

from engine.hashing import block_hashes
from engine.kv_events import KVEvent, KVEventBatch
from router.placement.index import PrefixIndex
from engine.step_costs import (DECODE_WINDOW, PRIOR_BORROW_EFFICIENCY, PRIOR_DECODE_BATCH_SLOPE, PRIOR_DECODE_STEP_S,
                               PRIOR_KV_PULL_GBPS, PRIOR_KV_PULL_LATENCY_S, PRIOR_PREFILL_TOKENS_PER_S,
                               MIN_CHUNK_TOKENS, StepCosts, TransferSpeed)
from router.placement.calibration import PredictionErrors
from router.placement.routing import (EXPECTED_OUTPUT_TOKENS, LOCAL_ERRORS_MIN_SAMPLES, LOCAL_ERRORS_WINDOW,
                                      ArrivalRate, NoDecodeWorker, Router, share_backlog, spread_backlog,
                                      with_arrivals, with_backlog)
from router.placement.pool_policy import CostWeights, PoolPolicy
from router.placement.cost_model import (DisaggConfig, PrefillDecision, decode_seconds, displaced_seconds,
                                         decide_prefill, decide_prefill_by_cost, local_prefill_cost,
                                         prefill_rate, remote_prefill_ttft)
from worker_runtime.protocol import WorkerLoad
from router.placement.cpu_lending import lent_threads

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

# ---- fixed thresholds: the operator's override (placement "thresholds") ----

CONFIG = DisaggConfig(max_local_prefill_length=2048, max_remote_prefill_cache_hit_ratio=0.7,
                      max_prefill_queue_size=2, placement="thresholds")
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


# ---- placement from measured cost against the SLOs (placement "slo", the default) ----

SLO = DisaggConfig(max_prefill_queue_size=2, ttft_slo_s=2.0, itl_slo_s=0.25)
KV_BYTES = 46080  # SmolLM2-135M in fp32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes per token


def measured(tokens_per_s: float = 500.0, decode_s: dict[int, float] | None = None) -> StepCosts:
    """Costs of a worker that measured `tokens_per_s` for prompts of every length, and decode steps of
    20 ms alone up to 80 ms with 32 sequences."""
    return StepCosts({b: tokens_per_s for b in (64, 256, 1024, 4096)}, decode_s or {1: 0.02, 8: 0.04, 32: 0.08})


def prefill_worker(**fields) -> WorkerLoad:
    return WorkerLoad("p0", **{"step_costs": measured(), "kv_bytes_per_token": KV_BYTES, **fields})


def decode_worker(num_running: int = 0, **fields) -> WorkerLoad:
    return WorkerLoad("d0", num_running=num_running, **{"step_costs": measured(), "kv_bytes_per_token": KV_BYTES,
                                                        "kv_pull_gbps": 1.0, **fields})


def by_cost(prompt_tokens, decode, prefill, decode_cached=0, prefill_cached=0, elapsed_s=0.0, config=SLO):
    return decide_prefill_by_cost(prompt_tokens, decode_cached, prefill_cached, decode, prefill, config, elapsed_s)


def test_step_costs_keep_a_median_of_decode_steps_per_power_of_two_bucket():
    costs = StepCosts(alpha=0.5)
    assert costs.decode_time(3) == PRIOR_DECODE_STEP_S and costs.prefill_speed(256) == PRIOR_PREFILL_TOKENS_PER_S
    costs.observe(3, 0, 0, 0.04)
    costs.observe(4, 0, 0, 0.06)  # the same bucket (up to 4 sequences)
    assert costs.decode_step_s == {4: pytest.approx(0.05)}
    assert costs.decode_time(1) == costs.decode_time(16) == pytest.approx(0.05)  # the nearest bucket stands in
    costs.observe(4, 0, 0, 0.05)
    costs.observe(4, 0, 0, 0.50)  # one slow step (a collection, a neighbour on the core) moves nothing
    assert costs.decode_time(4) == pytest.approx(0.055)
    for _ in range(DECODE_WINDOW):  # a lasting change is taken within the window
        costs.observe(4, 0, 0, 0.08)
    assert costs.decode_time(4) == pytest.approx(0.08)
    assert costs.copy().decode_step_s == {4: pytest.approx(0.08)}


def test_a_prefill_step_charges_its_prompt_tokens_what_the_decodes_beside_them_did_not_take():
    costs = StepCosts({}, {4: 0.05})
    costs.observe(4, 100, 300, 0.25)  # 50 ms of decodes, 200 ms for 100 prompt tokens ending at 300
    assert costs.prefill_tokens_per_s == {512: pytest.approx(500.0)}
    assert costs.prefill_time(500, 300) == pytest.approx(0.05 + 1.0)


def test_a_small_chunk_beside_many_decodes_is_charged_what_it_took_not_half_the_step():
    """A 4-token chunk beside 12 decodes (a 36 ms batch) that made the step 58 ms took 22 ms: charged half the
    step (29 ms), its speed came out at 138 tok/s and sized the next chunk smaller, and chunks stayed near the
    4-token minimum. A step the decodes' estimate explains whole still charges the chunk its share of the tokens."""
    costs = StepCosts({}, {16: 0.036})
    costs.observe(12, 4, 1600, 0.058)
    assert costs.prefill_tokens_per_s == {2048: pytest.approx(4 / 0.022)}
    costs = StepCosts({}, {16: 0.036})
    costs.observe(12, 4, 1600, 0.036)
    assert costs.prefill_tokens_per_s == {2048: pytest.approx(4 / (0.036 * 4 / 16))}
    costs = StepCosts({}, {1: 0.02})
    costs.observe(0, 256, 256, 0.03)  # a prompt alone: at least half its step, as before
    assert costs.prefill_tokens_per_s == {256: pytest.approx(256 / 0.015)}


def test_the_stall_free_budget_keeps_a_step_within_its_time_but_always_progresses():
    costs = measured()
    budget = costs.prefill_budget(8, 0.25, min_tokens=16)
    assert costs.decode_time(8) + budget / costs.prefill_speed(budget) <= 0.25
    assert costs.decode_time(8) + (budget + 16) / costs.prefill_speed(budget) > 0.25
    assert costs.prefill_budget(32, 0.05, min_tokens=16) == 16  # no room at all: one block a step


def test_a_late_chunk_of_a_long_prompt_gets_the_speed_measured_at_its_context():
    # SmolLM2 on one core beside 10 decodes: 32 tokens took 40 ms at a prompt's start, 100 ms at 1,344 tokens.
    costs = StepCosts({32: 800.0, 2048: 320.0}, {8: 0.033})
    room = costs.step_limit(8, 0.25, stall_ratio=3.0) - costs.decode_time(8)  # 66 ms beside the decodes
    early = costs.prefill_budget(8, 0.25, min_tokens=16, stall_ratio=3.0)
    late = costs.prefill_budget(8, 0.25, min_tokens=16, stall_ratio=3.0, start=1344)
    assert (early, late) == (int(room * 800.0), int(room * 320.0)) == (52, 21)


def test_the_remote_ttft_adds_queue_wait_compute_of_the_uncached_part_and_the_pull():
    prefill = prefill_worker(queued_prefill_tokens=1000, num_waiting=2)
    predicted = remote_prefill_ttft(1024, 512, 256, prefill, decode_worker())
    queue, compute, pull = 1000 / 500, 0.02 + 512 / 500, PRIOR_KV_PULL_LATENCY_S + 768 * KV_BYTES / 1e9
    assert predicted == pytest.approx(queue + compute + pull)


def test_a_local_prefill_beside_running_streams_goes_in_itl_sized_chunks_and_stalls_them():
    decode = decode_worker(num_running=8)
    ttft, stall = local_prefill_cost(1024, 0, decode, 0.25, min_chunk=16)
    chunk = decode.step_costs.prefill_budget(8, 0.25, 16)
    assert ttft == pytest.approx(math.ceil(1024 / chunk) * (0.04 + chunk / 500))
    assert stall == pytest.approx(1024 / 500)
    idle_chunk = int((0.25 - 0.02) * 500)  # no streams: chunks within the ITL SLO still
    assert local_prefill_cost(1024, 0, decode_worker(), 0.25, 16) == (
        pytest.approx(math.ceil(1024 / idle_chunk) * 0.02 + 1024 / 500), 0.0)


def test_a_cold_256_token_prompt_goes_to_an_idle_prefill_worker_while_decode_streams_run():
    decision = by_cost(256, decode_worker(num_running=4), prefill_worker())
    assert decision == PrefillDecision(True, "remote_within_ttft_slo")
    # Dynamo's fixed threshold would prefill it locally, stalling those streams.
    assert not decide_prefill(256, 0, prefill_worker(), CONFIG).remote


def test_an_idle_decode_worker_prefills_when_the_remote_path_is_no_faster():
    # 100 tokens: one step within the ITL SLO on the idle decode worker
    assert by_cost(100, decode_worker(), prefill_worker()) == PrefillDecision(False, "decode_idle")
    faster = prefill_worker(step_costs=measured(tokens_per_s=1000.0))  # e.g. borrowing idle decode cores
    assert by_cost(100, decode_worker(), faster).remote
    assert by_cost(256, decode_worker(), prefill_worker()).remote  # locally in three SLO-sized steps: slower


def test_steps_on_borrowed_cores_are_measured_apart_and_a_prior_scales_the_own_speed_until_then():
    costs = StepCosts({}, {1: 0.02})
    costs.observe(0, 256, 256, 0.02 + 256 / 800)
    costs.own_threads, costs.borrow_threads = 1, 2  # the worker's stats: one core lent right now
    assert costs.borrowing and costs.prefill_speed(256) == pytest.approx(800)
    assert costs.prefill_speed(256, borrowing=True) == pytest.approx(800 * (1 + PRIOR_BORROW_EFFICIENCY))
    costs.observe(0, 256, 256, 0.02 + 256 / 1500, borrowed=True)
    assert costs.prefill_speed(256) == pytest.approx(800)  # its own cores' speed is untouched
    assert costs.prefill_speed(256, borrowing=True) == pytest.approx(1500)
    costs.observe(1, 0, 0, 0.5, borrowed=True)  # decode steps are not measured on borrowed cores
    assert costs.decode_time(1) == pytest.approx(0.02)
    costs.borrow_threads = 0  # nothing lent any more
    assert not costs.borrowing and costs.prefill_time(256, 256, costs.borrowing) == pytest.approx(0.02 + 256 / 800)


def test_an_idle_decode_worker_leaves_the_prompt_to_a_prefill_worker_that_borrows_its_idle_cores():
    """The decode worker's one core is lent while it is idle: the prefill worker would run the prompt on
    both cores (its stats say so), which beats the decode worker prefilling on its own."""
    lending = measured()
    lending.own_threads, lending.borrow_threads = 1, 2
    assert by_cost(100, decode_worker(), prefill_worker()) == PrefillDecision(False, "decode_idle")
    assert by_cost(100, decode_worker(), prefill_worker(step_costs=lending)).remote


def pinned(costs: StepCosts, node: str = "host:/dev/shm/tandem-cpu", lend: int = 0, borrows: bool = False,
           own: int = 1, stale_borrow_threads: int = 0) -> StepCosts:
    costs.cpu_node, costs.lend_threads, costs.borrows = node, lend, borrows
    costs.own_threads, costs.borrow_threads = own, stale_borrow_threads
    return costs


def test_the_router_sees_from_its_live_loads_that_an_idle_decode_worker_lends_its_cores():
    """The prefill worker's last stats were taken while the decode worker streamed the previous request
    (nothing lent then); the decode worker is idle now, so the prompt runs on both cores remotely.
    Before, every prompt of a steady trickle went local: a local prefill kept decode busy at the next
    stats poll, so the prefill worker never reported a lent core (measured: 12 of 12 sequential 256-token
    prompts local at 467 ms TTFT; forced remote, 338 ms)."""
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    tokens = prompt(1, suffix_blocks=0)[:112]  # one step within the ITL SLO, even on an idle decode worker
    prefill = [prefill_worker(step_costs=pinned(measured(), borrows=True))]
    lender = decode_worker(step_costs=pinned(measured(), lend=1))
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), prefill, [lender])
    assert route.prefill is not None and route.reason == "remote_within_ttft_slo"
    alone = measured().prefill_time(112, 112)
    assert route.predicted_ttft_s < alone  # at the borrowed speed
    # Pinned to another node's cores, or lending nothing: no core is lent, and the idle decode worker
    # prefills, as fast as the prefill worker alone and without the hops.
    for other in (decode_worker(step_costs=pinned(measured(), node="other:/dev/shm/tandem-cpu", lend=1)),
                  decode_worker(step_costs=pinned(measured()))):
        route = router.route(block_hashes(tokens, BLOCK), len(tokens), prefill, [other])
        assert route.prefill is None and route.reason == "decode_idle", route
    # Busy, it lends nothing: the prompt still goes remote (its streams must not stall), at the prefill
    # worker's own speed.
    busy = decode_worker(num_running=1, step_costs=pinned(measured(), lend=1))
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), prefill, [busy])
    assert route.prefill is not None and route.predicted_ttft_s >= alone


def test_an_idle_decode_worker_whose_core_is_in_a_borrowed_prefill_forward_is_not_free_for_a_local_one():
    """A second prompt arriving while the prefill worker runs the first on the idle decode worker's core
    too: prefilling it locally would share that core with the borrowed forward, slowing both (measured:
    the first request of a 0.5 req/s run took 1.46 s against a predicted 0.34 s). Local pays for the
    rest of the borrowed slice (at most the ITL SLO), so the prompt queues behind the first, unless the
    queue is deep enough that local still wins."""
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    tokens = prompt(1, suffix_blocks=0)[:112]  # one step within the ITL SLO, even on an idle decode worker
    lender = decode_worker(step_costs=pinned(measured(), lend=1))
    borrowing = prefill_worker(num_running=1, queued_prefill_tokens=112, step_costs=pinned(measured(), borrows=True))
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), [borrowing], [lender])
    assert route.prefill is not None and route.reason == "remote_within_ttft_slo"
    # The same queue on a prefill worker that borrows nothing from it (another node): local is free and faster.
    elsewhere = decode_worker(step_costs=pinned(measured(), node="other:/dev/shm/tandem-cpu", lend=1))
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), [borrowing], [elsewhere])
    assert route.prefill is None and route.reason == "decode_idle"
    # A deep queue: local wins even after waiting out the borrowed slice.
    deep = prefill_worker(num_running=1, num_waiting=3, queued_prefill_tokens=1024,
                          step_costs=pinned(measured(), borrows=True))
    route = router.route(block_hashes(tokens, BLOCK), len(tokens), [deep], [lender])
    assert route.prefill is None and route.reason == "decode_idle"
    assert route.predicted_ttft_s == pytest.approx(measured().prefill_time(112, 112) + SLO.itl_slo_s)


def test_a_stale_report_of_lent_cores_is_overruled_by_a_busy_lender():
    busy = decode_worker(num_running=3, step_costs=pinned(measured(), lend=1))
    stale = prefill_worker(step_costs=pinned(measured(), borrows=True, stale_borrow_threads=2))
    assert lent_threads(stale, [busy]).borrow_threads_now == 0
    assert lent_threads(stale, [decode_worker(step_costs=pinned(measured(), lend=1))]).borrow_threads_now == 2
    unpinned = prefill_worker(step_costs=measured())  # a GPU or unpinned worker: its stats stand
    assert lent_threads(unpinned, [busy]).borrow_threads_now is None


def test_a_borrowed_speed_measured_on_a_short_prompt_says_nothing_of_a_long_one():
    """A 16-token warm-up on borrowed cores is mostly a forward's fixed cost: seen putting 432 tok/s (slower
    than one core) on every prompt, so the router sent none to the prefill worker."""
    costs = pinned(measured(tokens_per_s=650.0), borrows=True, stale_borrow_threads=2)
    costs.observe(0, 16, 16, 0.074, borrowed=True)
    assert costs.prefill_speed(16, borrowing=True) == pytest.approx(16 / (0.074 - 0.02))
    assert costs.prefill_speed(256, borrowing=True) == pytest.approx(650 * (1 + PRIOR_BORROW_EFFICIENCY))
    costs.observe(0, 256, 256, 0.02 + 256 / 1200, borrowed=True)
    assert costs.prefill_speed(256, borrowing=True) == pytest.approx(1200)
    assert costs.prefill_speed(512, borrowing=True) == pytest.approx(1200)  # one bucket away still counts


def test_kv_pulls_are_latency_plus_bytes_over_bandwidth_learned_apart():
    """One block (737 KB of SmolLM2) pulled in 17 ms is latency, not a bandwidth of 0.04 GB/s; taken as
    bandwidth it predicted 267 ms for a 256-token prompt's pull."""
    speed = TransferSpeed()
    speed.observe(737_280, 0.017)
    assert speed.gbps == PRIOR_KV_PULL_GBPS and speed.latency_s == pytest.approx(0.017 - 737_280 / 1e9)
    speed.observe(11_796_480, speed.latency_s + 11_796_480 / 2e9)  # 256 tokens at 2 GB/s
    assert speed.gbps == pytest.approx(2.0)
    assert speed.seconds(11_796_480) == pytest.approx(speed.latency_s + 11_796_480 / 2e9)
    assert speed.seconds(0) == 0.0
    decode = decode_worker(kv_pull_gbps=speed.gbps, kv_pull_latency_s=speed.latency_s)
    fast = remote_prefill_ttft(256, 0, 0, prefill_worker(), decode)
    assert fast == pytest.approx(measured().prefill_time(256, 256) + speed.seconds(256 * KV_BYTES))


def test_a_small_uncached_tail_that_fits_one_step_within_the_itl_slo_is_prefilled_locally():
    decision = by_cost(1024, decode_worker(num_running=8), prefill_worker(), decode_cached=1008)
    assert decision == PrefillDecision(False, "stall_within_itl_slo")
    assert by_cost(1024, decode_worker(num_running=8), prefill_worker(), decode_cached=512, prefill_cached=512).remote


def test_the_stall_ratio_keeps_a_step_beside_local_prefill_within_a_few_plain_decode_steps():
    costs = measured()  # 40 ms a step with 8 decodes
    assert costs.step_limit(8, 0.25, stall_ratio=2.0) == pytest.approx(0.08)
    assert costs.step_limit(8, 0.05, stall_ratio=2.0) == pytest.approx(0.05)  # the ITL SLO when tighter
    budget = costs.prefill_budget(8, 0.25, min_tokens=16, stall_ratio=2.0)
    assert 16 <= budget < costs.prefill_budget(8, 0.25, min_tokens=16)
    assert 0.04 + budget / costs.prefill_speed(budget) <= 0.08 + 1e-9
    # A 64-token tail adds 128 ms to a 40 ms step: within the 250 ms ITL SLO but 4x the step the streams
    # run at, so it goes remote; only a looser stall ratio lets the decode worker take it.
    tail = dict(decode_cached=448)  # the prefill worker would compute all 512: local is faster
    assert by_cost(512, decode_worker(num_running=8), prefill_worker(), **tail).remote
    loose = DisaggConfig(max_prefill_queue_size=2, ttft_slo_s=2.0, itl_slo_s=0.25, stall_ratio=10.0)
    assert by_cost(512, decode_worker(num_running=8), prefill_worker(), config=loose, **tail) == \
        PrefillDecision(False, "stall_within_itl_slo")


def test_a_remote_path_that_misses_the_ttft_slo_loses_to_a_local_one_that_meets_it():
    backlog = prefill_worker(queued_prefill_tokens=2000, num_waiting=1)  # 4 s of queued prompts
    busy = decode_worker(num_running=8)  # 8 x 0.5 s of stall: more than local's TTFT saves
    assert by_cost(256, busy, backlog) == PrefillDecision(False, "remote_misses_ttft_slo")


def test_a_deep_prefill_queue_loses_to_local_chunks_when_they_delay_the_streams_less_than_it_saves():
    """4 running streams each lose 0.5 s to a 256-token local prefill in ITL-sized chunks (2 s together),
    and its first token comes ~1 s after arrival against ~4.5 s behind the prefill worker's 2,000 queued
    tokens. With the queue a second shorter, the remote path wins again (no SLO is missed either way)."""
    decode = decode_worker(num_running=4)
    local, stall = local_prefill_cost(256, 0, decode, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    deep = prefill_worker(queued_prefill_tokens=2000, num_waiting=1)
    assert local + 4 * stall < remote_prefill_ttft(256, 0, 0, deep, decode)
    assert by_cost(256, decode, deep) == PrefillDecision(False, "remote_queue_costs_more")
    shorter = prefill_worker(queued_prefill_tokens=500, num_waiting=1)
    assert local + 4 * stall > remote_prefill_ttft(256, 0, 0, shorter, decode)
    assert by_cost(256, decode, shorter) == PrefillDecision(True, "remote_within_ttft_slo")


def test_when_both_paths_miss_the_ttft_slo_the_running_streams_are_spared():
    backlog = prefill_worker(queued_prefill_tokens=2000, num_waiting=1)
    busy = decode_worker(num_running=32, queued_prefill_tokens=4000)
    assert by_cost(256, busy, backlog) == PrefillDecision(True, "ttft_slo_missed_either_way")


def test_a_full_prefill_queue_means_waiting_while_the_ttft_slo_can_still_be_met():
    full = prefill_worker(num_waiting=2, queued_prefill_tokens=256)
    decision = by_cost(256, decode_worker(num_running=4), full)
    assert decision.remote and decision.wait and decision.reason == "prefill_queue_full"


def test_the_wait_for_a_prefill_slot_ends_in_a_local_prefill_once_the_ttft_slo_would_be_lost():
    full = prefill_worker(num_waiting=2, queued_prefill_tokens=256)
    decode = decode_worker(num_running=4)
    remote = remote_prefill_ttft(256, 0, 0, full, decode)
    assert by_cost(256, decode, full, elapsed_s=SLO.ttft_slo_s - remote - 0.01).wait
    late = by_cost(256, decode, full, elapsed_s=SLO.ttft_slo_s - remote + 0.01)
    local, _ = local_prefill_cost(256, 0, decode, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    assert SLO.ttft_slo_s - remote + 0.01 + local <= SLO.ttft_slo_s
    assert late == PrefillDecision(False, "prefill_queue_full")


def test_a_full_prefill_queue_is_waited_out_when_a_local_prefill_would_come_later_and_miss_the_slo_too():
    """Seen at 1.5 req/s on a slow box: once waiting for a slot would miss the SLO, requests went local
    behind the decode worker's own queued prefills, predicted (and took) 3.6-8.7 s against ~2.5 s remote.
    When both paths miss, the sooner one wins: here the remote one, so it waits on; once the prefill queue
    is the longer wait, local (both paths then share an overload); once local meets the SLO, local."""
    full = prefill_worker(num_waiting=2, queued_prefill_tokens=512)
    decode = decode_worker(num_running=4, queued_prefill_tokens=768)  # three local prompts ahead
    remote = remote_prefill_ttft(256, 0, 0, full, decode)
    local, stall = local_prefill_cost(256, 0, decode, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    elapsed = SLO.ttft_slo_s - remote + 0.5
    assert elapsed + local > SLO.ttft_slo_s and remote < local
    decision = by_cost(256, decode, full, elapsed_s=elapsed)
    assert decision.remote and decision.wait and decision.reason == "ttft_slo_missed_either_way"
    deeper = prefill_worker(num_waiting=9, queued_prefill_tokens=9 * 256)
    assert local < remote_prefill_ttft(256, 0, 0, deeper, decode) < local + 4 * stall
    assert by_cost(256, decode, deeper, elapsed_s=elapsed) == PrefillDecision(False, "prefill_queue_full")
    # The decode worker's queue drained: local meets the SLO again and takes the request at once.
    assert by_cost(256, decode_worker(num_running=4), full, elapsed_s=SLO.ttft_slo_s - remote + 0.01) == \
        PrefillDecision(False, "prefill_queue_full")


def test_requests_waiting_at_the_ingress_for_a_prefill_slot_count_as_queued_there():
    """A prefill worker with a free slot, but a request already waiting for it at the ingress: the next
    request queues behind it. That waiter fills the slot, so the newcomer waits; behind four
    waiters the remote path would miss the TTFT SLO while a local prefill on an idle-enough decode worker
    meets it, so it goes local at once instead of waiting until the SLO is nearly gone."""
    tokens = prompt(1, prefix=[], suffix_blocks=16)  # 256 cold tokens
    hashes = block_hashes(tokens, BLOCK)
    one_slot = prefill_worker(num_waiting=1, queued_prefill_tokens=256)
    decode = [decode_worker(num_running=6)]
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    assert router.route(hashes, 256, [one_slot], decode).reason == "remote_within_ttft_slo"
    behind_one = router.route(hashes, 256, [one_slot], decode, prefill_backlog={"p0": (1, 256)})
    assert behind_one.wait and behind_one.reason == "prefill_queue_full"
    assert behind_one.predicted_ttft_s > router.route(hashes, 256, [one_slot], decode).predicted_ttft_s
    behind_four = router.route(hashes, 256, [one_slot], decode, prefill_backlog={"p0": (4, 1024)})
    assert behind_four.prefill is None and not behind_four.wait and behind_four.reason == "prefill_queue_full"
    # Waiters for another prefill worker are not ahead of this one.
    assert router.route(hashes, 256, [one_slot], decode, prefill_backlog={"p1": (4, 1024)}).prefill is not None
    assert with_backlog(one_slot, None) is one_slot and with_backlog(one_slot, (0, 0)) is one_slot
    assert (with_backlog(one_slot, (2, 300)).num_waiting, with_backlog(one_slot, (2, 300)).queued_prefill_tokens) \
        == (3, 556)


def test_without_a_schedulable_prefill_worker_the_decode_worker_prefills():
    assert by_cost(4096, decode_worker(num_running=4), None) == PrefillDecision(False, "no_prefill_worker")
    assert not by_cost(4096, decode_worker(num_running=4), prefill_worker(draining=True)).remote


def test_the_router_places_by_measured_cost_by_default_and_by_thresholds_when_told():
    tokens = prompt(1, prefix=[], suffix_blocks=16)  # 256 cold tokens
    hashes = block_hashes(tokens, BLOCK)
    prefill, decode = [prefill_worker()], [decode_worker(num_running=4)]
    route = Router(PrefixIndex(), BLOCK, rng=random.Random(0)).route(hashes, len(tokens), prefill, decode)
    assert route.prefill.worker_id == "p0" and route.reason == "remote_within_ttft_slo"
    fixed = Router(PrefixIndex(), BLOCK, disagg=CONFIG, rng=random.Random(0)).route(hashes, len(tokens), prefill,
                                                                                     decode)
    assert fixed.prefill is None and fixed.reason == "short_uncached_prompt"


def test_thresholds_placement_predicts_the_first_token_on_the_path_it_took():
    """What SLO-aware shedding compares against a deadline, whichever rule placed the request: the cost model's
    prediction for the path the thresholds chose, from arrival (`elapsed_s` ago), queues included."""
    router = Router(PrefixIndex(), BLOCK, disagg=CONFIG, rng=random.Random(0))
    short = prompt(1, prefix=[], suffix_blocks=16)  # 256 tokens: local
    decode = decode_worker(num_running=4)
    local = router.route(block_hashes(short, BLOCK), len(short), [prefill_worker()], [decode], elapsed_s=0.3,
                         record=False)
    assert local.prefill is None
    assert local.predicted_ttft_s == pytest.approx(0.3 + local_prefill_cost(256, 0, decode, CONFIG.itl_slo_s,
                                                                            MIN_CHUNK_TOKENS, CONFIG.stall_ratio)[0])
    long = prompt(2, prefix=[], suffix_blocks=160)  # 2560 tokens: remote, behind a queued prompt
    queued = prefill_worker(num_waiting=1, queued_prefill_tokens=1024)
    remote = router.route(block_hashes(long, BLOCK), len(long), [queued], [decode], record=False)
    assert remote.prefill is not None and remote.reason == "long_uncached_prompt"
    assert remote.predicted_ttft_s == pytest.approx(remote_prefill_ttft(2560, 0, 0, queued, decode))
    assert remote.predicted_ttft_s > router.route(block_hashes(long, BLOCK), len(long), [prefill_worker()],
                                                  [decode], record=False).predicted_ttft_s


def test_round_robin_takes_the_workers_in_turn_whatever_they_cache():
    index = PrefixIndex()
    policy = PoolPolicy(index, 16, round_robin=True)
    loads = [WorkerLoad("decode-1"), WorkerLoad("decode-0", num_running=9), WorkerLoad("decode-2", healthy=False)]
    index.apply(KVEventBatch("decode-1", 0, [KVEvent("stored", [1, 2])]))
    chosen = [policy.place([1, 2], 32, loads) for _ in range(4)]
    assert [p.worker_id for p in chosen] == ["decode-0", "decode-1", "decode-0", "decode-1"]
    assert [p.cached_tokens for p in chosen] == [0, 32, 0, 32]  # what the chosen worker caches is still known


# ---- the decode worker by cost in seconds (placement "slo", the default) ----

def colocated(worker_id: str, num_running: int = 0, **fields) -> WorkerLoad:
    """A colocated decode worker of the slow dev box: 512 tokens of prompt cost it about a second."""
    return WorkerLoad(worker_id, num_running=num_running, num_total_blocks=1024,
                      **{"step_costs": measured(500.0, {1: 0.05, 2: 0.055, 4: 0.06, 8: 0.07, 16: 0.09}), **fields})


def test_a_prefix_holder_running_a_few_more_streams_keeps_the_prefix_when_a_miss_costs_more():
    """Case c of bench/compare.py: the token-constant policy sends a request to the other worker as soon
    as it runs one or two sequences fewer (384 prefill-token equivalents each against a 512-token prefix),
    which spread every prefix over both workers. By seconds, a second of prefill outweighs a few ms
    per step for two more sequences."""
    index = index_with({"d0": DOC[:512]})
    tokens = prompt(1, prefix=DOC[:512])
    hashes = block_hashes(tokens, BLOCK)
    loads = [colocated("d0", num_running=4), colocated("d1", num_running=2)]
    assert PoolPolicy(index, BLOCK, rng=random.Random(0)).place(hashes, len(tokens), loads).worker_id == "d1"
    route = Router(index, BLOCK, rng=random.Random(0)).route(hashes, len(tokens), [], loads, output_tokens=64)
    assert route.decode.worker_id == "d0" and route.decode.cached_tokens == 512
    assert route.prefill is None and route.reason == "no_prefill_worker"


def test_a_prefix_holder_with_a_long_prefill_queue_loses_to_a_free_worker():
    index = index_with({"d0": DOC[:512]})
    tokens = prompt(1, prefix=DOC[:512])
    loads = [colocated("d0", num_running=4, queued_prefill_tokens=4096), colocated("d1", num_running=4)]
    route = Router(index, BLOCK, rng=random.Random(0)).route(block_hashes(tokens, BLOCK), len(tokens), [], loads)
    assert route.decode.worker_id == "d1" and route.decode.cached_tokens == 0


def test_decode_load_spreads_as_measured_steps_slow_with_the_batch():
    router = Router(PrefixIndex(), BLOCK, rng=random.Random(0))
    loads = [colocated(f"d{i}") for i in range(3)]
    for seed in range(9):
        tokens = prompt(seed, prefix=[])
        route = router.route(block_hashes(tokens, BLOCK), len(tokens), [], loads)
        next(load for load in loads if load.worker_id == route.decode.worker_id).num_running += 1
    assert [load.num_running for load in loads] == [3, 3, 3]


def test_workers_that_measured_nothing_share_the_load_by_their_sequence_counts():
    """Priors cost a decode step the same at any batch size; equal costs go to the emptier worker."""
    router = Router(PrefixIndex(), BLOCK, rng=random.Random(0))
    loads = [WorkerLoad(f"d{i}", num_total_blocks=1024) for i in range(2)]
    prefill = [WorkerLoad("p0", num_total_blocks=1024)]
    for seed in range(6):
        tokens = prompt(seed, prefix=[])
        route = router.route(block_hashes(tokens, BLOCK), len(tokens), prefill, loads)
        next(load for load in loads if load.worker_id == route.decode.worker_id).num_running += 1
    assert [load.num_running for load in loads] == [3, 3]


def test_a_worker_without_free_kv_blocks_for_the_request_is_chosen_only_when_all_are_full():
    index = index_with({"d0": DOC[:512]})
    tokens = prompt(1, prefix=DOC[:512])
    hashes = block_hashes(tokens, BLOCK)
    full = colocated("d0", num_active_blocks=1020)
    route = Router(index, BLOCK, rng=random.Random(0)).route(hashes, len(tokens), [], [full, colocated("d1", 6)])
    assert route.decode.worker_id == "d1"
    both_full = [full, colocated("d1", 6, num_active_blocks=1020)]
    assert Router(index, BLOCK, rng=random.Random(0)).route(hashes, len(tokens), [], both_full).decode.worker_id == "d0"


def test_decode_seconds_add_the_ttft_own_steps_stalls_and_the_slowdown_of_the_batch():
    load = colocated("d0", num_running=2)  # steps of 55 ms with 2 sequences, 57.5 ms with 3
    local = PrefillDecision(False, "stall_within_itl_slo")
    ttft, stall = local_prefill_cost(256, 0, load, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    assert decode_seconds(256, 0, load, local, 10, SLO, BLOCK) == pytest.approx(
        ttft + 2 * stall + 10 * 0.0575 + 2 * 10 / 2 * 0.0025)
    remote = PrefillDecision(True, "remote_within_ttft_slo", predicted_ttft_s=0.4)
    load.num_running = 4  # 60 ms with 4, 62.5 ms with 5
    assert decode_seconds(256, 0, load, remote, 10, SLO, BLOCK) == pytest.approx(0.4 + 10 * 0.0625 + 4 * 5 * 0.0025)


def fast_colocated(worker_id: str, num_running: int = 0, **fields) -> WorkerLoad:
    """A colocated decode worker of the bf16 dev box, with the KV cache of bench/compare.py's case c (217
    blocks: 60% of eight 512-token prefixes and room for the requests in flight)."""
    return WorkerLoad(worker_id, num_running=num_running, num_total_blocks=217,
                      **{"num_active_blocks": 40 * num_running,
                         "step_costs": measured(2500.0, {1: 0.035, 2: 0.038, 4: 0.044, 8: 0.056}), **fields})


OTHER = list(range(90000, 90000 + 217 * BLOCK))  # other prompts' cached blocks, filling the caches


def test_a_miss_on_a_full_cache_costs_the_hits_it_evicts_and_the_prefix_stays_where_it_is():
    """Case c in bf16: a 512-token miss costs ~0.2 s, about what two more streams add to the holder's
    steps, so the myopic cost spread every prefix over both workers. The miss's blocks also evict what the
    lighter worker's own traffic reuses (hit share 0.8): counted, the prefix stays with its holder at two
    streams more, and still goes to the lighter worker at three."""
    tokens = prompt(1, prefix=DOC[:512])
    hashes = block_hashes(tokens, BLOCK)
    chosen = {}
    for share in (0.0, 0.8):
        for running in (2, 3):
            index = index_with({"d0": DOC[:512] + OTHER[:185 * BLOCK], "d1": OTHER})
            router = Router(index, BLOCK, rng=random.Random(0))
            router.hit_share.update({"d0": share, "d1": share})
            loads = [fast_colocated("d0", running), fast_colocated("d1")]
            chosen[share, running] = router.route(hashes, len(tokens), [], loads, output_tokens=32).decode.worker_id
    assert chosen == {(0.0, 2): "d1", (0.0, 3): "d1", (0.8, 2): "d0", (0.8, 3): "d1"}


def test_displaced_seconds_price_the_evicted_blocks_at_the_hit_share_once_empty_blocks_run_out():
    load = fast_colocated("d0")  # 217 blocks, none active; 2,500 prompt tokens/s
    # 576 prompt + 64 output tokens, nothing cached: 40 blocks. 200 indexed leave 17 empty: 23 evicted.
    assert displaced_seconds(576, 0, 64, load, 200, 0.5, BLOCK) == pytest.approx(0.5 * 23 * BLOCK / 2500)
    assert displaced_seconds(576, 512, 64, load, 200, 0.5, BLOCK) == 0.0  # 8 new blocks fit the empty ones
    assert displaced_seconds(576, 0, 64, load, 100, 0.5, BLOCK) == 0.0  # room to spare: nothing evicted
    assert displaced_seconds(576, 0, 64, load, 217, 0.0, BLOCK) == 0.0  # nothing it caches was ever reused
    busy = fast_colocated("d0", num_active_blocks=217)  # the active blocks fill it whatever the index says
    assert displaced_seconds(576, 0, 64, busy, 0, 1.0, BLOCK) == pytest.approx(40 * BLOCK / 2500)


def test_the_router_measures_each_decode_workers_hit_share_from_its_placements():
    index = index_with({"d0": DOC[:512]})
    router = Router(index, BLOCK, rng=random.Random(0))
    loads = [colocated("d0"), colocated("d1", num_running=8)]
    hit = prompt(1, prefix=DOC[:512])  # 512 of 576 tokens cached on d0
    router.route(block_hashes(hit, BLOCK), len(hit), [], loads)
    assert router.hit_share == {"d0": pytest.approx(512 / 576)}
    cold = prompt(2, prefix=[])
    router.route(block_hashes(cold, BLOCK), len(cold), [], loads)
    assert router.hit_share == {"d0": pytest.approx(512 / 576 / 2)}  # the mean of its first placements
    for seed in range(3, 40):
        cold = prompt(seed, prefix=[])
        router.route(block_hashes(cold, BLOCK), len(cold), [], loads)
    assert router.hit_share["d0"] < 0.01  # then an EWMA: old hits fade


def test_decode_steps_between_measured_batch_sizes_are_interpolated():
    costs = StepCosts({}, {1: 0.02, 8: 0.04, 32: 0.08})
    assert [costs.decode_time_between(n) for n in (1, 4, 8, 20, 32, 56)] == pytest.approx(
        [0.02, 0.02 + 0.02 * 3 / 7, 0.04, 0.06, 0.08, 0.12])  # past 32: the slope of 8..32 goes on
    # A warm-up measured one size, or nothing is measured: a prior slope, so a bigger batch is never free.
    assert StepCosts({}, {1: 0.02}).decode_time_between(11) == pytest.approx(0.02 * (1 + 10 * PRIOR_DECODE_BATCH_SLOPE))
    assert StepCosts().decode_time_between(5) == pytest.approx(PRIOR_DECODE_STEP_S * (1 + 4 * PRIOR_DECODE_BATCH_SLOPE))


def test_a_worker_that_measured_only_its_warm_up_does_not_take_every_request():
    """Two workers whose warm-ups measured a lone step 5 ms apart: the faster one is not given the whole
    burst as if a bigger batch cost it nothing (the spread test through the real app sends 8 at once)."""
    router = Router(PrefixIndex(), BLOCK, rng=random.Random(0))
    loads = [WorkerLoad(f"d{i}", num_total_blocks=1024, step_costs=StepCosts({64: 500.0}, {1: 0.030 + 0.005 * i}))
             for i in range(2)]
    for seed in range(8):
        tokens = prompt(seed, prefix=[], suffix_blocks=2)
        route = router.route(block_hashes(tokens, BLOCK), len(tokens), [], loads, output_tokens=64)
        next(load for load in loads if load.worker_id == route.decode.worker_id).num_running += 1
    assert min(load.num_running for load in loads) >= 3, [load.num_running for load in loads]


def test_placement_expects_the_remaining_max_tokens_capped():
    from worker_runtime.protocol import GenerateRequest
    from engine.sampling_params import SamplingParams
    from router.placement.routing import expected_output_tokens
    request = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=40))
    assert expected_output_tokens(request) == 40
    request.output_token_ids = list(range(30))  # migrated after 30 tokens
    assert expected_output_tokens(request) == 10
    assert expected_output_tokens(GenerateRequest("r", [1], SamplingParams(max_tokens=100_000))) == EXPECTED_OUTPUT_TOKENS
    assert expected_output_tokens(GenerateRequest("r", [1], SamplingParams(max_tokens=None))) == EXPECTED_OUTPUT_TOKENS


def test_a_prefix_hit_on_a_decode_worker_busy_with_a_long_local_prompt_is_not_queued_behind_it():
    """The decode worker computes a cold 1,600-token prompt locally in ITL-sized chunks and the prefill
    queue is full. A request whose prefix that worker caches has a 16-token rest: it fits one step, goes
    before the long prompt's next chunk (engine/scheduler.py), and so prefills locally at once instead of
    waiting in the router for a prefill slot behind the cold prompts."""
    decode = decode_worker(num_running=4, queued_prefill_tokens=1600)
    full = prefill_worker(queued_prefill_tokens=3200, num_waiting=2)
    ttft, _ = local_prefill_cost(1616, 1600, decode, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    assert ttft < 0.1  # one step, not the 1,600 queued tokens' chunks
    assert by_cost(1616, decode, full, decode_cached=1600) == PrefillDecision(False, "stall_within_itl_slo")
    # A rest longer than a step's room, or a request already waiting there, queues behind the long prompt.
    assert local_prefill_cost(1616, 1000, decode, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)[0] > 2.0
    waiting = decode_worker(num_running=4, queued_prefill_tokens=1600, num_waiting=1)
    assert local_prefill_cost(1616, 1600, waiting, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)[0] > 2.0


def test_a_prefix_being_computed_on_the_prefill_worker_draws_the_requests_that_share_it():
    """A cold 1,536-token prefix goes to the prefill worker; a second request with the same prefix arrives
    while it is computed (nothing of it is cached anywhere yet). Counting the routed prompt's blocks as the
    prefill worker's, the second queues behind the first there and computes its 64-token suffix only,
    where before it was prefilled on the decode worker too (the prefix computed twice at once)."""
    index = PrefixIndex()
    router = Router(index, BLOCK, disagg=SLO, rng=random.Random(0))
    shared = DOC[:96 * BLOCK]
    first, second = shared + list(range(64)), shared + list(range(100, 164))
    busy_prefill = [prefill_worker(queued_prefill_tokens=len(first), num_waiting=1)]
    decode = [decode_worker(num_running=1)]
    cold = router.route(block_hashes(second, BLOCK), len(second), busy_prefill, decode)
    assert cold.prefill is None or cold.prefill.cached_tokens == 0  # nothing known: the prefix is priced whole
    index.begin_prompt("p0", "first", block_hashes(first, BLOCK))
    route = router.route(block_hashes(second, BLOCK), len(second), busy_prefill, decode)
    assert route.prefill is not None and route.prefill.cached_tokens == len(shared)
    queue_s = len(first) / 500
    assert queue_s < route.predicted_ttft_s < queue_s + measured().prefill_time(len(second) - len(shared), len(second)) + 0.3
    index.end_prompt("p0", "first")  # finished (its blocks arrive as KV events) or failed: no longer counted
    assert index.overlap(block_hashes(second, BLOCK), ["p0"], in_flight=True) == {"p0": 0}
    # Decode placement is by what decode workers hold only.
    index.begin_prompt("d0", "local", block_hashes(first, BLOCK))
    assert index.overlap(block_hashes(second, BLOCK), ["d0"]) == {"d0": 0}


def test_a_long_local_prefill_is_priced_beside_the_streams_that_join_while_it_runs():
    """Seen at 1 req/s: a cold 1,600-token prompt placed on a decode worker idle at that moment was predicted
    at 4.2 s; streams joined meanwhile, each shrinking its chunks, and it took 8.6 s in 97 chunks. Priced with
    the streams expected to arrive during it, it goes to the prefill worker, which is faster then."""
    prefill = prefill_worker(queued_prefill_tokens=500, num_waiting=1)  # ~1 s of queue, then ~3.3 s
    idle_now = decode_worker()
    assert by_cost(1600, idle_now, prefill) == PrefillDecision(False, "decode_idle")
    arriving = decode_worker(arrivals_per_s=1.0)
    alone, _ = local_prefill_cost(1600, 0, idle_now, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    beside, stall = local_prefill_cost(1600, 0, arriving, SLO.itl_slo_s, BLOCK, SLO.stall_ratio)
    assert beside > 1.5 * alone and stall == 0.0  # nothing runs there now to stall
    # its chunks beside the ~3 streams that join during it (half of the arrivals over its ~6 s)
    assert beside == pytest.approx(local_prefill_cost(1600, 0, decode_worker(num_running=3), SLO.itl_slo_s, BLOCK,
                                                      SLO.stall_ratio)[0])
    assert by_cost(1600, arriving, prefill).remote
    # A prompt of one step is not affected: no stream is expected to join during it.
    assert by_cost(100, arriving, prefill_worker()) == PrefillDecision(False, "decode_idle")
    assert local_prefill_cost(100, 0, arriving, SLO.itl_slo_s, BLOCK) == local_prefill_cost(100, 0, idle_now,
                                                                                             SLO.itl_slo_s, BLOCK)


def test_the_arrival_rate_counts_recent_placements_and_decays_when_they_stop():
    now = [0.0]
    rate = ArrivalRate(window=4, horizon_s=10.0, min_span_s=1.0, clock=lambda: now[0])
    assert rate.per_second() == 0.0
    for _ in range(6):
        rate.note()
        now[0] += 0.5
    now[0] -= 0.5
    assert rate.per_second() == pytest.approx(3 / 1.5)  # the last 4 placements, 0.5 s apart
    now[0] += 1.5
    assert rate.per_second() == pytest.approx(3 / 3.0)  # none since: the rate falls
    now[0] += 10.0
    assert rate.per_second() == 0.0  # all older than the horizon
    for _ in range(4):
        rate.note()  # a burst: four at once
    assert rate.per_second() == pytest.approx(3 / 1.0)  # over the shortest span


def test_the_router_gives_each_decode_worker_its_share_of_the_arrivals():
    now = [0.0]
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    router.arrivals = ArrivalRate(clock=lambda: now[0])
    tokens = prompt(2, prefix=[], suffix_blocks=100)  # 1,600 cold tokens
    hashes = block_hashes(tokens, BLOCK)
    prefill = [prefill_worker(queued_prefill_tokens=500, num_waiting=1)]
    assert router.route(hashes, len(tokens), prefill, [decode_worker()]).reason == "decode_idle"
    for _ in range(8):  # 2 req/s over two decode workers: 1 req/s joins each
        now[0] += 0.5
        router.route(block_hashes([7] * 16, BLOCK), 16, prefill, [decode_worker()])
    decodes = [decode_worker(), dataclasses.replace(decode_worker(), worker_id="d1")]
    assert [load.arrivals_per_s for load in with_arrivals(decodes, router.arrivals.per_second())] == \
        pytest.approx([1.0, 1.0], rel=0.15)
    route = router.route(hashes, len(tokens), prefill, decodes)
    assert route.prefill is not None
    draining = [decodes[0], dataclasses.replace(decodes[1], draining=True)]
    assert [load.arrivals_per_s for load in with_arrivals(draining, 2.0)] == [2.0, 0.0]


def test_the_ingress_queue_ahead_is_shared_by_both_paths_as_they_will_take_it():
    """Shedding's prediction: behind four prompts queued at the ingress, the local path (which the prefill
    waiters alone would leave free) takes its share of them too, so the first token is predicted past the TTFT
    SLO whichever path the request would take; but each path only its share, in proportion to how fast it
    computes prompts: counted whole on both, the wait was overstated and shedding refused requests at the knee
    that it would have served in time."""
    tokens = prompt(1, prefix=[], suffix_blocks=16)  # 256 cold tokens
    hashes = block_hashes(tokens, BLOCK)
    one_slot = prefill_worker(num_waiting=1, queued_prefill_tokens=256)
    decode = [decode_worker(num_running=6)]
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    slot_waiters = router.route(hashes, 256, [one_slot], decode, prefill_backlog={"p0": (4, 1024)}, record=False)
    assert slot_waiters.prefill is None and slot_waiters.predicted_ttft_s <= SLO.ttft_slo_s  # local is free
    queued = router.route(hashes, 256, [one_slot], decode, record=False, ingress_backlog=(6, 1536))
    assert queued.predicted_ttft_s > SLO.ttft_slo_s
    assert queued.predicted_ttft_s > slot_waiters.predicted_ttft_s
    whole_on_both = router.route(hashes, 256, spread_backlog([one_slot], (6, 1536)),
                                 spread_backlog(decode, (6, 1536)), record=False)
    assert queued.predicted_ttft_s < 0.9 * whole_on_both.predicted_ttft_s

    prefills, decodes = share_backlog([one_slot, prefill_worker(healthy=False)], decode, (6, 1536), SLO)
    remote_rate, local_rate = prefill_rate(one_slot, 256, True, SLO), prefill_rate(decode[0], 256, False, SLO)
    assert local_rate < remote_rate  # chunks beside six streams
    added = [prefills[0].queued_prefill_tokens - 256, decodes[0].queued_prefill_tokens]
    assert abs(sum(added) - 1536) <= 1 and added[0] / added[1] == pytest.approx(remote_rate / local_rate, rel=0.01)
    assert (prefills[1].num_waiting, prefills[1].queued_prefill_tokens) == (0, 0)  # not schedulable: no share
    shared = spread_backlog([one_slot, prefill_worker(), prefill_worker(healthy=False)], (3, 900))
    assert [(w.num_waiting, w.queued_prefill_tokens) for w in shared] == [(3, 706), (2, 450), (0, 0)]


def test_a_worker_holding_the_prefix_in_a_lower_tier_is_preferred_and_charged_its_promotion():
    """Both idle: the decode worker whose host tier holds the prompt's blocks wins over one that holds none, and
    its placement costs the promotion it measured on top of the same computation of the rest."""
    from engine.hashing import block_hashes
    from engine.kv_events import KVEvent, KVEventBatch
    from router.placement.index import PrefixIndex
    from router.placement.routing import Router
    from worker_runtime.protocol import WorkerLoad

    hashes = block_hashes(list(range(512)), 16)
    index = PrefixIndex()
    index.apply(KVEventBatch("d1", 0, [KVEvent("stored", hashes, tier="host")]))
    router = Router(index, 16)
    loads = [WorkerLoad("d0"), WorkerLoad("d1", promote_s_per_block=0.001)]
    decision = router.route(hashes, 512, [], loads)
    assert decision.decode.worker_id == "d1" and decision.decode.cached_tokens == 512
    index.apply(KVEventBatch("d0", 0, [KVEvent("stored", hashes)]))  # d0: the same blocks in its device cache
    assert router.route(hashes, 512, [], loads).decode.worker_id == "d0"



def test_a_worker_that_reads_the_shared_store_is_preferred_for_a_prefix_another_wrote_there():
    """A prefix that a gone worker wrote to the shared store: of two idle decode workers that never computed it,
    the one that reads the store wins (it promotes the blocks instead of computing them) at the store's measured
    promotion; one that does not read it counts none of them."""
    from engine.hashing import block_hashes
    from engine.kv_events import KVEvent, KVEventBatch
    from router.placement.index import PrefixIndex
    from router.placement.routing import Router
    from worker_runtime.protocol import WorkerLoad

    hashes = block_hashes(list(range(512)), 16)
    index = PrefixIndex()
    index.resync("d0", [], 0, {"host": []})
    index.resync("d1", [], 0, {"host": [], "remote": []})
    index.apply(KVEventBatch("gone", 0, [KVEvent("stored", hashes, tier="remote")]))
    index.remove_worker("gone")
    router = Router(index, 16)
    loads = [WorkerLoad("d0"), WorkerLoad("d1", promote_s_by_tier={"remote": 0.002})]
    decision = router.route(hashes, 512, [], loads)
    assert decision.decode.worker_id == "d1" and decision.decode.cached_tokens == 512
    assert index.lower_tiers("d1", hashes) == {"remote": 32} and index.lower_tiers("d0", hashes) == {}


def test_a_prefix_on_disk_is_priced_at_the_disk_tiers_speed_and_one_in_host_memory_at_the_hosts():
    """Both workers hold the prefix below their caches, one in host memory, one on disk, and promote at the same
    average speed: the blocks' tier decides (a disk read costs more than a memcpy), whichever worker holds which."""
    from engine.kv_events import KVEvent, KVEventBatch
    from worker_runtime.protocol import promote_seconds_by_tier

    hashes = block_hashes(list(range(512)), 16)
    speeds = {"host": 0.0002, "disk": 0.02}  # per block: 6 ms against 0.64 s for the 32 blocks
    for host_worker, disk_worker in (("d0", "d1"), ("d1", "d0")):
        index = PrefixIndex()
        index.apply(KVEventBatch(host_worker, 0, [KVEvent("stored", hashes, tier="host")]))
        index.apply(KVEventBatch(disk_worker, 0, [KVEvent("stored", hashes, tier="disk")]))
        assert index.lower_tiers(disk_worker, hashes) == {"disk": 32}
        loads = [WorkerLoad(w, promote_s_per_block=0.01, promote_s_by_tier=speeds) for w in ("d0", "d1")]
        for seed in range(4):
            decision = Router(index, 16, rng=random.Random(seed)).route(hashes, 512, [], loads)
            assert decision.decode.worker_id == host_worker and decision.decode.cached_tokens == 512
    assert WorkerLoad("d0", promote_s_by_tier=speeds).promote_s({"host": 2, "disk": 1}) == pytest.approx(0.0204)
    # Per tier: measured once a tier has promoted, else a prior from the block's bytes at the tier's speed.
    stats = {"bytes_per_block": 1_000_000, "tiers": {
        "host": {"hits": 4, "promote_seconds": 0.002}, "disk": {"hits": 0, "promote_seconds": 0.0}}}
    by_tier = promote_seconds_by_tier(stats)
    assert by_tier["host"] == pytest.approx(0.0005) and by_tier["disk"] == pytest.approx(0.002)  # 1 MB at 0.5 GB/s


# ---- peer prefix pulls priced in placement (issue 41) ----

def puller(load: WorkerLoad, pulls: bool = True) -> WorkerLoad:
    return dataclasses.replace(load, serves_prefixes=True, pulls_prefixes=pulls, kv_bytes_per_token=KV_BYTES)


def test_a_worker_that_would_compute_the_prompt_is_priced_pulling_what_a_busy_peer_holds():
    """d0 holds a 1,024-token prefix and runs 8 streams; d1 runs none. Computed on d1, the prefix costs ~2 s, so
    it goes to d0 and adds to its streams' steps; pulled to d1 (~25 ms of KV) it costs least there: "pull it here"
    against "go where it is", decided in placement, not after it."""
    index = index_with({"d0": DOC[:1024]})
    tokens = prompt(1, prefix=DOC[:1024])
    hashes = block_hashes(tokens, BLOCK)
    chosen = {}
    for pulls in (False, True):
        loads = [puller(colocated("d0", num_running=8), pulls), puller(colocated("d1"), pulls)]
        route = Router(index, BLOCK, rng=random.Random(0)).route(hashes, len(tokens), [], loads, output_tokens=16)
        chosen[pulls] = route.decode.worker_id, route.decode.cached_tokens, route.prefill
    assert chosen == {False: ("d0", 1024, None), True: ("d1", 0, None)}


def test_a_prefill_worker_is_priced_pulling_a_prefix_a_decode_worker_holds():
    """The remote path's predicted TTFT counts the prefill worker pulling the 1,024 prefix tokens the decode worker
    holds (a fraction of computing them), when it can pull; the decode worker, busy, still leaves the prompt to it."""
    index = index_with({"d0": DOC[:1024]})
    tokens = prompt(2, prefix=DOC[:1024], suffix_blocks=32)  # 512 new tokens after the prefix
    hashes = block_hashes(tokens, BLOCK)
    predicted = {}
    for pulls in (False, True):
        loads = [puller(colocated("d0", num_running=8), pulls)]
        pf = [puller(prefill_worker(step_costs=measured(500.0)), pulls)]
        route = Router(index, BLOCK, rng=random.Random(0)).route(hashes, len(tokens), pf, loads, output_tokens=16)
        assert route.prefill is not None and route.prefill.worker_id == pf[0].worker_id
        predicted[pulls] = route.predicted_ttft_s
    assert predicted[True] < 0.5 * predicted[False]


def test_a_local_prefill_beside_streams_is_priced_by_how_far_off_the_last_ones_of_its_size_came():
    """Seen on box D at 3 req/s: prompts sent to a busy decode worker because a full prefill queue looked
    later took 1.5-3x their predicted time there. Once a few local prefills of about its size measured three
    times their prediction, a 256-token prompt that went local behind two slot waiters waits for the prefill
    worker instead; a decode worker with no streams is priced as before, and so are prompts of another size
    (a cold prompt's crawl says nothing of a prefix hit's short suffix)."""
    tokens = prompt(1, prefix=[], suffix_blocks=16)  # 256 cold tokens
    hashes = block_hashes(tokens, BLOCK)
    one_slot = prefill_worker(num_waiting=1, queued_prefill_tokens=256)
    busy = [decode_worker(num_running=6)]
    router = Router(PrefixIndex(), BLOCK, disagg=SLO, rng=random.Random(0))
    before = router.route(hashes, 256, [one_slot], busy, prefill_backlog={"p0": (2, 512)})
    assert before.prefill is None and before.reason == "prefill_queue_full" and router.local_factor(256) == 1.0
    assert before.local_model_s == pytest.approx(before.predicted_ttft_s) and before.local_tokens == 256
    idle = router.route(hashes, 256, [one_slot], [decode_worker(num_running=0)], prefill_backlog={"p0": (2, 512)})
    assert idle.prefill is None and idle.local_model_s is None  # no streams beside it: not learnt from, not scaled
    for _ in range(LOCAL_ERRORS_MIN_SAMPLES - 1):
        router.observe_local_prefill(200, before.local_model_s, 3 * before.local_model_s)
    assert router.local_factor(256) == 1.0  # too few to go by
    router.observe_local_prefill(129, before.local_model_s, 3 * before.local_model_s)  # the same bucket
    assert router.local_factor(256) == pytest.approx(3.0) and router.local_factor(64) == 1.0
    after = router.route(hashes, 256, [one_slot], busy, prefill_backlog={"p0": (2, 512)})
    assert after.prefill is not None and after.wait
    assert router.route(hashes, 256, [one_slot], [decode_worker(num_running=0)],
                        prefill_backlog={"p0": (2, 512)}).predicted_ttft_s == pytest.approx(idle.predicted_ttft_s)
    # Had they come at half their prediction, the factor would go below 1 as well.
    for _ in range(LOCAL_ERRORS_WINDOW):
        router.observe_local_prefill(256, 1.0, 0.5)
    assert router.local_factor(256) == pytest.approx(0.5)


def test_prediction_errors_forget_what_is_older_than_their_horizon():
    now = [0.0]
    errors = PredictionErrors(window=8, min_samples=2, horizon_s=10.0, clock=lambda: now[0])
    errors.observe(1.0, 3.0)
    now[0] = 5.0
    errors.observe(1.0, 3.0)
    errors.observe(0.01, 1.0)  # too short to say anything
    assert errors.factor(0.5) == 3.0
    now[0] = 12.0  # the first one is past the horizon: one left, too few
    assert errors.factor(0.5) == 1.0 and errors.ratios == [3.0]
    for _ in range(20):
        errors.observe(1.0, 100.0)
    assert len(errors.ratios) == 8 and errors.factor(0.5) == PredictionErrors.BOUNDS[1]
