"""Placement policy: which worker of a pool gets a request, and where its prefill runs.

Cost follows Dynamo's KV router: the prefill work a worker would still have to
do for this request (prompt tokens it does not cache, plus prefill tokens
already queued there), plus its current decode load (running sequences, KV
usage). Lowest cost wins; ties are broken at random so equal workers share
the traffic. The prefill and decode pools are placed separately, each by its
own `PoolPolicy` over that pool's load snapshot.

With `placement: slo` (the default) the decode worker is chosen by what placing the request there
costs in seconds (`decode_seconds`): its predicted time to first token on the path the SLO decision
would take there, its own decode steps beside that worker's batch, and what it adds to the streams
already running (a local prefill's stall, one more sequence per step). A prefix hit is then worth what
its miss would cost on that worker, measured, rather than a token constant against running sequences,
and a miss on a full cache also costs what it evicts there, at that worker's measured hit share
(`displaced_seconds`), so a prefix stays with the worker that holds it unless the load says otherwise.

The conditional-disaggregation decision ("prefill on a prefill worker, or let
the decode worker prefill locally") is made from the workers' measured costs
against the TTFT/ITL SLOs (`decide_prefill_by_cost`, the default), or by
Dynamo's fixed token thresholds (`decide_prefill`, an operator's override);
`Router` ties the three steps together for the ingress.
"""
from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from engine.step_costs import (MIN_CHUNK_TOKENS, PRIOR_KV_PULL_GBPS, PRIOR_KV_PULL_LATENCY_S, StepCosts, pull_seconds,
                                stall_free_budget)
from router.index import PrefixIndex
from worker_runtime.protocol import DispatchPath, GenerateRequest


@dataclass(slots=True)
class WorkerLoad:
    """One worker's load as last reported to the router."""
    worker_id: str
    queued_prefill_tokens: int = 0  # prompt tokens accepted but not yet computed
    num_waiting: int = 0  # requests not yet scheduled (vllm:num_requests_waiting)
    num_running: int = 0  # sequences in the running batch (vllm:num_requests_running)
    num_active_blocks: int = 0  # KV blocks held by its requests; cached free blocks excluded
    num_total_blocks: int = 0
    healthy: bool = True
    draining: bool = False
    step_costs: StepCosts = field(default_factory=StepCosts)  # measured by the worker (priors until then)
    kv_bytes_per_token: int = 0
    kv_pull_gbps: float = PRIOR_KV_PULL_GBPS  # a decode worker's measured pulls: bandwidth and fixed cost
    kv_pull_latency_s: float = PRIOR_KV_PULL_LATENCY_S
    # A CPU prefill worker's threads if it started a forward now, borrowing the cores that the decode
    # workers of its node lend while idle, as the router sees them now (`lent_threads`); None: unknown.
    borrow_threads_now: int | None = None

    @property
    def idle(self) -> bool:
        """Nothing running, waiting or queued: a lending decode worker's cores are lent."""
        return not (self.num_running or self.num_waiting or self.queued_prefill_tokens)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, as vllm:kv_cache_usage_perc."""
        return self.num_active_blocks / self.num_total_blocks if self.num_total_blocks else 0.0

    @property
    def schedulable(self) -> bool:
        """Unhealthy and draining workers receive no new requests."""
        return self.healthy and not self.draining


@dataclass(slots=True)
class CostWeights:
    """Each load term in prefill-token equivalents, as in Dynamo's KV router.

    `prefill` plays the role of Dynamo's overlap_score_weight: raising it
    favours cache hits, lowering it favours spreading load. `decode` weighs
    the KV tokens a worker's requests hold (memory pressure). `running`
    weighs the batch itself: KV usage counts a shared prefix block once, so
    a worker batching many requests on one hot prefix looks light by KV
    usage alone. Defaults come from bench/router.py's simulation, where they
    keep the hit rate within ~3% of an oracle at max/mean load <= ~1.15.
    """
    prefill: float = 1.0  # per uncached prompt token and per queued prefill token
    decode: float = 0.1  # per active KV token
    running: float = 384.0  # per running sequence


@dataclass(slots=True)
class Placement:
    """The chosen worker and what it already caches of the prompt."""
    worker_id: str
    cached_tokens: int
    cost: float


class PoolPolicy:
    """Places requests within one pool: lowest cost wins, random among ties. `round_robin` ignores cost
    and takes the schedulable workers in turn (the baseline prefix-aware routing is measured against)."""

    def __init__(self, index: PrefixIndex, block_size: int, weights: CostWeights | None = None,
                 rng: random.Random | None = None, round_robin: bool = False):
        self.index = index
        self.block_size = block_size
        self.weights = weights or CostWeights()
        self.rng = rng or random.Random()
        self.round_robin = round_robin
        self._turn = 0

    def place(self, block_hashes: Sequence[int], prompt_tokens: int,
              loads: Sequence[WorkerLoad]) -> Placement | None:
        """The cheapest schedulable worker of `loads`, or None when none is schedulable."""
        candidates = [load for load in loads if load.healthy and not load.draining]
        if not candidates:
            return None
        overlaps = self.index.overlap(block_hashes, [load.worker_id for load in candidates])
        block_size = self.block_size
        if self.round_robin:
            chosen = sorted(candidates, key=lambda load: load.worker_id)[self._turn % len(candidates)]
            self._turn += 1
            return Placement(chosen.worker_id, overlaps[chosen.worker_id] * block_size, 0.0)
        w_prefill, w_decode, w_running = self.weights.prefill, self.weights.decode * block_size, self.weights.running
        # Hashes cover the prompt's full blocks only, so cached never exceeds prompt_tokens.
        costs = [w_prefill * (prompt_tokens - overlaps[load.worker_id] * block_size + load.queued_prefill_tokens)
                 + w_decode * load.num_active_blocks + w_running * load.num_running for load in candidates]
        best = min(costs)
        tied = [i for i, cost in enumerate(costs) if cost == best]
        chosen = candidates[tied[0] if len(tied) == 1 else self.rng.choice(tied)]
        return Placement(chosen.worker_id, overlaps[chosen.worker_id] * block_size, best)


@dataclass(slots=True)
class DisaggConfig:
    """Conditional disaggregation: how the router decides where a prompt is prefilled.

    `placement="slo"` decides from measured costs against `ttft_slo_s` and `itl_slo_s`
    (`decide_prefill_by_cost`). `placement="thresholds"` uses Dynamo's fixed rule (`decide_prefill`):
    prefill runs remotely only when the decode worker would have more than `max_local_prefill_length`
    tokens to compute and caches less than `max_remote_prefill_cache_hit_ratio` of the prompt. Either
    way a prefill worker with `max_prefill_queue_size` requests waiting is full.
    """
    max_local_prefill_length: int = 2048
    max_remote_prefill_cache_hit_ratio: float = 0.7
    max_prefill_queue_size: int = 2
    placement: Literal["slo", "thresholds"] = "slo"
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.25
    stall_ratio: float = 2.0


@dataclass(slots=True)
class PrefillDecision:
    """Remote or local prefill, with the reason (a metrics label). `wait`: remote, but the prefill
    queue is full; the ingress waits for a slot and asks again."""
    remote: bool
    reason: str
    wait: bool = False
    # On the path taken, when placed by cost: recorded in the request's timeline, not part of the decision.
    predicted_ttft_s: float | None = field(default=None, compare=False)


def decide_prefill(prompt_tokens: int, decode_cached_tokens: int, prefill: WorkerLoad | None,
                   config: DisaggConfig) -> PrefillDecision:
    """Dynamo's fixed thresholds: where the prompt is prefilled, given the decode worker's prefix hit.

    `prefill` is the prefill worker the prefill pool would use, or None when
    no prefill worker is schedulable.
    """
    uncached = prompt_tokens - decode_cached_tokens
    if uncached <= config.max_local_prefill_length:
        return PrefillDecision(False, "short_uncached_prompt")
    if decode_cached_tokens >= config.max_remote_prefill_cache_hit_ratio * prompt_tokens:
        return PrefillDecision(False, "mostly_cached_on_decode")
    if prefill is None or not prefill.schedulable:
        return PrefillDecision(False, "no_prefill_worker")
    if prefill.num_waiting >= config.max_prefill_queue_size:
        return PrefillDecision(False, "prefill_queue_full")
    return PrefillDecision(True, "long_uncached_prompt")


def remote_prefill_ttft(prompt_tokens: int, prefill_cached_tokens: int, decode_cached_tokens: int,
                        prefill: WorkerLoad, decode: WorkerLoad) -> float:
    """Predicted seconds to the first token on the remote path: the prefill worker's queue (its queued
    prompt tokens at its measured speed), the compute of the part it does not cache, and the pull of the
    KV the decode worker lacks (its measured pull latency and GB/s). A CPU prefill worker that can borrow
    idle decode cores right now computes at its borrowed speed: the router's live view says so
    (`WorkerLoad.borrow_threads_now`), else its last stats."""
    costs = prefill.step_costs
    if prefill.borrow_threads_now is not None:
        costs = dataclasses.replace(costs, borrow_threads=prefill.borrow_threads_now)
    borrowing = costs.borrowing
    mean_queued = prefill.queued_prefill_tokens / max(prefill.num_waiting, 1)
    queue_s = prefill.queued_prefill_tokens / costs.prefill_speed(max(mean_queued, 1), borrowing)
    compute_s = costs.prefill_time(prompt_tokens - prefill_cached_tokens, prompt_tokens, borrowing)
    bytes_per_token = decode.kv_bytes_per_token or prefill.kv_bytes_per_token
    pull_s = pull_seconds((prompt_tokens - decode_cached_tokens) * bytes_per_token, decode.kv_pull_latency_s,
                          decode.kv_pull_gbps)
    return queue_s + compute_s + pull_s


def local_prefill_cost(prompt_tokens: int, decode_cached_tokens: int, decode: WorkerLoad,
                       itl_slo_s: float, min_chunk: int, stall_ratio: float | None = None) -> tuple[float, float]:
    """(predicted seconds to the first token, seconds added to each running stream) when the decode
    worker prefills. Beside running streams the prompt goes in chunks that keep each step within the
    ITL SLO (the decode worker's stall-free budget), after the local prefills already queued there."""
    costs = decode.step_costs
    uncached = prompt_tokens - decode_cached_tokens
    work = decode.queued_prefill_tokens + uncached
    speed = costs.prefill_speed(prompt_tokens)
    # The decode worker's own budget; chunks shrink as the prompt's context grows: its middle one's size.
    chunk = stall_free_budget(costs, itl_slo_s, stall_ratio, min_chunk)(decode.num_running,
                                                                        (decode_cached_tokens + prompt_tokens) // 2)
    if not decode.num_running:
        return math.ceil(work / chunk) * costs.decode_time(1) + work / speed, 0.0
    step_s = costs.decode_time(decode.num_running) + min(chunk, work) / speed
    return math.ceil(work / chunk) * step_s, uncached / speed


def decide_prefill_by_cost(prompt_tokens: int, decode_cached_tokens: int, prefill_cached_tokens: int,
                           decode: WorkerLoad, prefill: WorkerLoad | None, config: DisaggConfig,
                           elapsed_s: float = 0.0, min_chunk: int = MIN_CHUNK_TOKENS) -> PrefillDecision:
    """Remote prefill unless the remote path would miss the TTFT SLO where a local one would not, or a
    local one costs the decode worker's running streams nothing material: it has none and the remote
    path is no faster, or the whole prompt fits in one step within the ITL SLO and local is faster; or
    local is faster by more than the delay its chunks add to all running streams together (a deep
    prefill queue).

    A full prefill queue means waiting for a slot while the remote path still meets the TTFT SLO,
    counted from arrival (`elapsed_s` ago), then a local prefill if that meets it or comes sooner (under
    overload both paths then share the prompts, each at its predicted wait); otherwise it waits on."""
    if prefill is None or not prefill.schedulable:
        return PrefillDecision(False, "no_prefill_worker")
    remote = elapsed_s + remote_prefill_ttft(prompt_tokens, prefill_cached_tokens, decode_cached_tokens,
                                             prefill, decode)
    local, stall = local_prefill_cost(prompt_tokens, decode_cached_tokens, decode, config.itl_slo_s, min_chunk,
                                      config.stall_ratio)
    local += elapsed_s
    if lent_to_busy_prefill(decode, prefill):
        # Its core is in a borrowed prefill forward right now: a local prefill shares it (and slows that
        # forward) until the forward ends, within about one borrowed slice (cpu.borrow_slice_ms, by default
        # the ITL SLO).
        local += config.itl_slo_s
    if not decode.num_running and local <= remote:
        return PrefillDecision(False, "decode_idle", predicted_ttft_s=local)
    one_step = decode.step_costs.decode_time(decode.num_running) + stall
    step_limit = decode.step_costs.step_limit(decode.num_running, config.itl_slo_s, config.stall_ratio)
    if decode.num_running and one_step <= step_limit and local <= remote:
        return PrefillDecision(False, "stall_within_itl_slo", predicted_ttft_s=local)
    if decode.num_running and local + decode.num_running * stall < remote:
        # The prefill queue is deep: the chunked local prefill (each step within the ITL SLO) gets the first
        # token sooner by more than it delays every running stream together.
        return PrefillDecision(False, "remote_queue_costs_more", predicted_ttft_s=local)
    if prefill.num_waiting >= config.max_prefill_queue_size:
        if remote <= config.ttft_slo_s:
            return PrefillDecision(True, "prefill_queue_full", wait=True, predicted_ttft_s=remote)
        if local <= config.ttft_slo_s or local < remote:
            return PrefillDecision(False, "prefill_queue_full", predicted_ttft_s=local)
        # Lost either way, and a local prefill (behind the decode worker's own) would come no sooner: wait on.
        return PrefillDecision(True, "ttft_slo_missed_either_way", wait=True, predicted_ttft_s=remote)
    if remote <= config.ttft_slo_s:
        return PrefillDecision(True, "remote_within_ttft_slo", predicted_ttft_s=remote)
    if local <= config.ttft_slo_s:
        return PrefillDecision(False, "remote_misses_ttft_slo", predicted_ttft_s=local)
    return PrefillDecision(True, "ttft_slo_missed_either_way", predicted_ttft_s=remote)


# A request's output length for placement when its max_tokens says nothing smaller (a client's default
# of the whole context must not make every batch look the same).
EXPECTED_OUTPUT_TOKENS = 128
# Added to a decode worker whose free KV blocks cannot hold the request: chosen only when all are full.
KV_FULL_PENALTY_S = 1000.0
TIE_TOLERANCE_S = 0.001  # costs this close count as equal; the worker with fewer sequences wins
HIT_SHARE_ALPHA = 0.1  # weight of the newest placement in a decode worker's measured prefix-hit share


def decode_seconds(prompt_tokens: int, decode_cached_tokens: int, decode: WorkerLoad, decision: PrefillDecision,
                   output_tokens: int, config: DisaggConfig, block_size: int, elapsed_s: float = 0.0,
                   displaced_s: float = 0.0) -> float:
    """What placing the request on `decode` costs, in seconds summed over everyone it delays: its own
    time to first token on the path `decision` takes there, its own decode steps beside the worker's batch,
    the stall a local prefill puts on each running stream, the slower steps one more sequence gives
    them for (on average) half the request's output, and `displaced_s`, what the cached blocks its own
    blocks evict there will cost later requests (`displaced_seconds`). A worker short of free KV blocks
    for it is penalised by KV_FULL_PENALTY_S (it would preempt)."""
    batch = decode.num_running + decode.num_waiting
    if decision.remote:
        ttft, stall = decision.predicted_ttft_s or 0.0, 0.0
    else:
        ttft, stall = local_prefill_cost(prompt_tokens, decode_cached_tokens, decode, config.itl_slo_s,
                                         MIN_CHUNK_TOKENS, config.stall_ratio)
        ttft += elapsed_s
    costs = decode.step_costs
    step, step_with = costs.decode_time_between(max(batch, 1)), costs.decode_time_between(batch + 1)
    seconds = (ttft + decode.num_running * stall + output_tokens * step_with
               + batch * output_tokens / 2 * max(0.0, step_with - step) + displaced_s)
    needed = _blocks_needed(prompt_tokens, decode_cached_tokens, output_tokens, block_size)
    if decode.num_total_blocks and decode.num_active_blocks + needed > decode.num_total_blocks:
        seconds += KV_FULL_PENALTY_S
    return seconds


def displaced_seconds(prompt_tokens: int, decode_cached_tokens: int, output_tokens: int, decode: WorkerLoad,
                      indexed_blocks: int, hit_share: float, block_size: int) -> float:
    """What the request's new blocks on `decode` take from later requests: the cached blocks they evict
    once the worker's empty blocks run out, each a prefix hit lost with the worker's measured hit share
    (`hit_share`: of the prompt tokens placed there lately, the share found cached), then prefilled again.
    Without it the choice is myopic: a worker one sequence lighter wins a request whose prefix another
    worker caches, its miss evicts what its own traffic reuses, and every prefix ends up on both workers,
    each holding fewer (on two workers that each hold 60% of eight prefixes, the hit rate fell from ~80%
    to ~63%)."""
    if hit_share <= 0 or not decode.num_total_blocks:
        return 0.0
    needed = _blocks_needed(prompt_tokens, decode_cached_tokens, output_tokens, block_size)
    empty = decode.num_total_blocks - max(decode.num_active_blocks, indexed_blocks)
    evicted = max(0, needed - max(0, empty))
    return hit_share * evicted * block_size / decode.step_costs.prefill_speed(prompt_tokens) if evicted else 0.0


def _blocks_needed(prompt_tokens: int, cached_tokens: int, output_tokens: int, block_size: int) -> int:
    """New KV blocks the request takes on a worker that caches `cached_tokens` of its prompt."""
    return -(-(prompt_tokens + output_tokens - cached_tokens) // block_size)


class NoDecodeWorker(RuntimeError):
    """No decode worker is healthy and accepting requests; the ingress answers 503."""


@dataclass(slots=True)
class RouteDecision:
    """Where one request goes. `prefill` is None when the decode worker prefills locally; `wait`: the
    chosen prefill worker's queue is full, and the ingress should wait for a slot and route again."""
    decode: Placement
    prefill: Placement | None
    reason: str
    wait: bool = False
    predicted_ttft_s: float | None = None


def dispatch_path(request: GenerateRequest, remote: bool, layerwise: bool) -> DispatchPath:
    """How a request placed with (`remote`) or without a prefill worker runs across its workers, when the
    prefill workers lease KV before the first token (`layerwise`, transfer.layerwise) or after it. Decode
    starts beside the prefill unless it needs the first token first: a single-token request never reaches
    decode (nothing to pull, so no early lease either), and a group of candidates forks from the first
    one's token."""
    if not remote:
        return DispatchPath.LOCAL
    if request.num_outputs > 1 or request.sampling_params.max_tokens == 1:
        return DispatchPath.SEQUENTIAL
    return DispatchPath.LAYERWISE if layerwise else DispatchPath.REMOTE


class Router:
    """Places a request on both pools and makes the conditional-disaggregation call."""

    def __init__(self, index: PrefixIndex, block_size: int, disagg: DisaggConfig | None = None,
                 prefill_weights: CostWeights | None = None, decode_weights: CostWeights | None = None,
                 rng: random.Random | None = None, routing: Literal["prefix_aware", "round_robin"] = "prefix_aware"):
        self.rng = rng = rng or random.Random()
        self.index = index
        self.block_size = block_size
        self.disagg = disagg or DisaggConfig()
        round_robin = routing == "round_robin"
        self.prefill_policy = PoolPolicy(index, block_size, prefill_weights, rng, round_robin)
        self.decode_policy = PoolPolicy(index, block_size, decode_weights, rng, round_robin)
        # Per decode worker: of the prompt tokens placed there, the share it cached (an EWMA).
        self.hit_share: dict[str, float] = {}
        self._placements: dict[str, int] = {}

    def route(self, block_hashes: Sequence[int], prompt_tokens: int, prefill_loads: Sequence[WorkerLoad],
              decode_loads: Sequence[WorkerLoad], elapsed_s: float = 0.0,
              output_tokens: int = EXPECTED_OUTPUT_TOKENS,
              prefill_backlog: Mapping[str, tuple[int, int]] | None = None) -> RouteDecision:
        """Pick the decode worker and decide whether a prefill worker computes the prompt. `elapsed_s`:
        how long ago the request arrived (its TTFT runs from then); `output_tokens`: what it will likely
        generate (its remaining max_tokens, at most EXPECTED_OUTPUT_TOKENS); `prefill_backlog`: per prefill
        worker, the (requests, prompt tokens) waiting at the ingress for a slot there ahead of this one,
        which it would queue behind (`with_backlog`)."""
        if prefill_backlog:
            prefill_loads = [with_backlog(load, prefill_backlog.get(load.worker_id)) for load in prefill_loads]
        prefill = self.prefill_policy.place(block_hashes, prompt_tokens, prefill_loads)
        prefill_load = None if prefill is None else lent_threads(_load_of(prefill, prefill_loads), decode_loads)
        prefill_cached = prefill.cached_tokens if prefill else 0
        if self.disagg.placement == "slo" and not self.decode_policy.round_robin:
            decode, decision = self._place_decode_by_cost(block_hashes, prompt_tokens, prefill_cached, prefill_load,
                                                          decode_loads, elapsed_s, output_tokens)
        else:
            decode = self.decode_policy.place(block_hashes, prompt_tokens, decode_loads)
            if decode is None:
                raise NoDecodeWorker("no decode worker is healthy and accepting requests")
            if self.disagg.placement == "thresholds":
                decision = decide_prefill(prompt_tokens, decode.cached_tokens, prefill_load, self.disagg)
            else:
                decision = decide_prefill_by_cost(prompt_tokens, decode.cached_tokens, prefill_cached,
                                                  _load_of(decode, decode_loads), prefill_load, self.disagg, elapsed_s)
        if not decision.wait and prompt_tokens > 0:
            self._note_hit(decode.worker_id, decode.cached_tokens / prompt_tokens)
        return RouteDecision(decode, prefill if decision.remote else None, decision.reason, decision.wait,
                             decision.predicted_ttft_s)

    def _note_hit(self, worker_id: str, share: float) -> None:
        """Fold one placement into the worker's hit share: the mean of its first placements, then an EWMA."""
        old, count = self.hit_share.get(worker_id, 0.0), self._placements.get(worker_id, 0) + 1
        self._placements[worker_id] = count
        self.hit_share[worker_id] = old + max(HIT_SHARE_ALPHA, 1 / count) * (share - old)

    def _place_decode_by_cost(self, block_hashes: Sequence[int], prompt_tokens: int, prefill_cached: int,
                              prefill: WorkerLoad | None, decode_loads: Sequence[WorkerLoad], elapsed_s: float,
                              output_tokens: int) -> tuple[Placement, PrefillDecision]:
        """The decode worker where the request costs least in seconds (`decode_seconds`), each with the
        prefill decision it would get there; among costs within TIE_TOLERANCE_S, the worker with the fewest
        sequences, then a random one."""
        candidates = [load for load in decode_loads if load.schedulable]
        if not candidates:
            raise NoDecodeWorker("no decode worker is healthy and accepting requests")
        overlaps = self.index.overlap(block_hashes, [load.worker_id for load in candidates])
        options = []
        for load in candidates:
            cached = overlaps[load.worker_id] * self.block_size
            decision = decide_prefill_by_cost(prompt_tokens, cached, prefill_cached, load, prefill, self.disagg,
                                              elapsed_s)
            displaced = displaced_seconds(prompt_tokens, cached, output_tokens, load,
                                          self.index.num_blocks(load.worker_id),
                                          self.hit_share.get(load.worker_id, 0.0), self.block_size)
            seconds = decode_seconds(prompt_tokens, cached, load, decision, output_tokens, self.disagg,
                                     self.block_size, elapsed_s, displaced)
            options.append((seconds, load.num_running + load.num_waiting, load.worker_id, cached, decision))
        best = min(option[0] for option in options)
        near = [option for option in options if option[0] <= best + TIE_TOLERANCE_S]
        fewest = min(option[1] for option in near)
        tied = [option for option in near if option[1] == fewest]
        seconds, _, worker_id, cached, decision = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        return Placement(worker_id, cached, seconds), decision


def with_backlog(prefill: WorkerLoad, backlog: tuple[int, int] | None) -> WorkerLoad:
    """`prefill` as a request sees it behind `backlog`, the (requests, prompt tokens) that wait at the
    ingress for a slot on it and will take the next ones: they count as queued there, so a request
    routed behind them predicts the remote path's wait (and its queue as full) as it will be."""
    if not backlog or not backlog[0]:
        return prefill
    requests, tokens = backlog
    return dataclasses.replace(prefill, num_waiting=prefill.num_waiting + requests,
                               queued_prefill_tokens=prefill.queued_prefill_tokens + tokens)


def lent_threads(prefill: WorkerLoad, decode_loads: Sequence[WorkerLoad]) -> WorkerLoad:
    """`prefill` with `borrow_threads_now`: its own threads plus those of every idle lending decode worker
    on its node, from the router's live loads. A decode worker's stats snapshot goes stale as soon as its
    batch empties or fills, and a prefill worker's report of what is lent dates from its last stats poll,
    which, under a steady trickle of requests, always finds the decode worker busy with the previous one."""
    costs = prefill.step_costs
    if not (costs.borrows and costs.cpu_node):
        return prefill
    lent = sum(d.step_costs.lend_threads for d in decode_loads if _lends_now(d, costs))
    return dataclasses.replace(prefill, borrow_threads_now=costs.own_threads + lent if lent else 0)


def lent_to_busy_prefill(decode: WorkerLoad, prefill: WorkerLoad) -> bool:
    """Whether `decode` lends its cores to `prefill` and that one is computing a prompt now, so a forward
    of its own would share its cores with a borrowed one."""
    costs = prefill.step_costs
    return bool(costs.borrows and costs.cpu_node and decode.step_costs.lend_threads and _lends_now(decode, costs)
                and (prefill.num_running or prefill.queued_prefill_tokens))


def _lends_now(decode: WorkerLoad, borrower: StepCosts) -> bool:
    """Whether `decode`'s cores are lent to workers of `borrower`'s node right now: it is there, healthy and idle."""
    return decode.step_costs.cpu_node == borrower.cpu_node and decode.healthy and decode.idle


def _load_of(placement: Placement, loads: Sequence[WorkerLoad]) -> WorkerLoad:
    return next(load for load in loads if load.worker_id == placement.worker_id)
