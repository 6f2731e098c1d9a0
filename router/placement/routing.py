"""Placement policy: which worker of each pool gets a request, where its prefill runs, and how it is
dispatched across them.

The prefill and decode pools are placed separately, each by its own `PoolPolicy` over that pool's load
snapshot (router/placement/pool_policy.py: Dynamo's token cost).

With `placement: slo` (the default) the decode worker is chosen by what placing the request there
costs in seconds (`decode_seconds`, router/placement/cost_model.py): its predicted time to first token on
the path the SLO decision would take there, its own decode steps beside that worker's batch, and what it
adds to the streams already running (a local prefill's stall, one more sequence per step). A prefix hit
is then worth what its miss would cost on that worker, measured, rather than a token constant against
running sequences, and a miss on a full cache also costs what it evicts there, at that worker's measured
hit share (`displaced_seconds`), so a prefix stays with the worker that holds it unless the load says
otherwise.

`Router` ties the steps together for the ingress; `dispatch_path` then fixes how the placed request runs
across its workers (carried in `GenerateRequest.dispatch`).
"""
from __future__ import annotations

import dataclasses
import math
import random
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from router.placement.cost_model import (DisaggConfig, PrefillDecision, decide_prefill, decide_prefill_by_cost,
                                         decode_seconds, displaced_seconds, peer_pull_pays, predicted_ttft,
                                         prefill_rate)
from router.placement.calibration import PredictionErrors
from router.placement.cpu_lending import lent_threads
from router.placement.index import PrefixIndex
from router.placement.pool_policy import CostWeights, Placement, PoolPolicy
from worker_runtime.protocol import DispatchPath, GenerateRequest, WorkerLoad
from engine.step_costs import bucket
from engine.timeline import RequestTimeline

# A request's output length for placement when its max_tokens says nothing smaller (a client's default
# of the whole context must not make every batch look the same).
EXPECTED_OUTPUT_TOKENS = 128
TIE_TOLERANCE_S = 0.001  # costs this close count as equal; the worker with fewer sequences wins
HIT_SHARE_ALPHA = 0.1  # weight of the newest placement in a decode worker's measured prefix-hit share
# The local prefills' prediction errors placement learns from (Router.local_factor): the last this many, within
# this many seconds, from this many on; the factor is worked out again at most every LOCAL_FACTOR_TTL_S.
LOCAL_ERRORS_WINDOW = 32
LOCAL_ERRORS_HORIZON_S = 300.0
LOCAL_ERRORS_MIN_SAMPLES = 3
LOCAL_FACTOR_TTL_S = 1.0


class ArrivalRate:
    """Requests placed per second lately: over the last `window` placements, and none older than `horizon_s`;
    the time since the oldest runs to now, so the rate decays when arrivals stop, and spans `min_span_s` at
    least, so that a burst reads as that many requests, not as a sustained rate of thousands a second."""

    def __init__(self, window: int = 16, horizon_s: float = 30.0, min_span_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self.times: deque[float] = deque(maxlen=window)
        self.horizon_s = horizon_s
        self.min_span_s = min_span_s
        self.clock = clock

    def note(self) -> None:
        self.times.append(self.clock())

    def per_second(self) -> float:
        now = self.clock()
        while self.times and now - self.times[0] > self.horizon_s:
            self.times.popleft()
        if len(self.times) < 2:
            return 0.0
        return (len(self.times) - 1) / max(now - self.times[0], self.min_span_s)


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
    # A chunked local prefill beside streams: its uncached tokens and unscaled prediction (Router.local_factor)
    local_tokens: int = 0
    local_model_s: float | None = None

    def record(self, timeline: RequestTimeline, block_size: int) -> None:
        """The decision, in the request's timeline."""
        timeline.decode_worker = self.decode.worker_id
        timeline.decode_overlap_blocks = self.decode.cached_tokens // block_size
        if self.prefill is not None:
            timeline.prefill_worker = self.prefill.worker_id
            timeline.prefill_overlap_blocks = self.prefill.cached_tokens // block_size
            timeline.prefill_path = "remote"
        else:
            timeline.prefill_worker, timeline.prefill_overlap_blocks = None, 0
            timeline.prefill_path = "local"
        timeline.routing_reason = self.reason
        timeline.predicted_ttft_s = self.predicted_ttft_s


def expected_output_tokens(request: GenerateRequest) -> int:
    """What the request will likely still generate, for placement: its remaining max_tokens, capped."""
    max_tokens = request.sampling_params.max_tokens
    if max_tokens is None:
        return EXPECTED_OUTPUT_TOKENS
    return max(1, min(max_tokens - len(request.output_token_ids), EXPECTED_OUTPUT_TOKENS))


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
        # A prompt routed to a prefill worker is as good as cached there for the requests sharing its prefix
        # that arrive while it is computed: they queue behind it and find its blocks.
        self.prefill_policy = PoolPolicy(index, block_size, prefill_weights, rng, round_robin,
                                         in_flight=not round_robin)
        self.decode_policy = PoolPolicy(index, block_size, decode_weights, rng, round_robin)
        # Per decode worker: of the prompt tokens placed there, the share it cached (an EWMA).
        self.hit_share: dict[str, float] = {}
        self._placements: dict[str, int] = {}
        # Streams join decode workers at this rate: a long local prefill runs beside those that join meanwhile.
        self.arrivals = ArrivalRate()
        # How far off the step costs' predictions of chunked local prefills beside streams came, per power-of-two
        # bucket of their uncached tokens (`local_factor`), and each bucket's factor as last worked out.
        self.local_errors: dict[int, PredictionErrors] = {}
        self._local_factors: dict[int, tuple[float, float]] = {}  # bucket -> (when worked out, value)

    def local_factor(self, uncached_tokens: int) -> float:
        """What a chunked local prefill of `uncached_tokens` beside running streams is predicted times: the median
        of measured ÷ predicted seconds of the last LOCAL_ERRORS_WINDOW of about its size (the same power-of-two
        bucket, within LOCAL_ERRORS_HORIZON_S), 1 with fewer than LOCAL_ERRORS_MIN_SAMPLES. Such a prefill is
        priced from the decode worker's step costs as they are when it is placed; under load streams join it and
        its chunks shrink more than the arrival rate counts (box D, random prompts at 3 req/s: a 256-token prompt
        predicted at 0.8 s took 1.7 s in 13 steps), and a prompt sent there because it looked sooner than a full
        prefill queue came later instead. Per size: a cold 1,600-token prompt that crawled at 3x its prediction
        says nothing of a 64-token suffix after a prefix hit, whose predictions held (one factor for both sent the
        hits to wait for the prefill worker)."""
        key = bucket(uncached_tokens)
        now = time.monotonic()
        cached = self._local_factors.get(key)
        if cached is None or now - cached[0] > LOCAL_FACTOR_TTL_S:
            errors = self.local_errors.get(key)
            cached = self._local_factors[key] = now, 1.0 if errors is None else errors.factor(0.5)
        return cached[1]

    def observe_local_prefill(self, uncached_tokens: int, model_s: float, measured_s: float) -> None:
        """A chunked local prefill of `uncached_tokens` had its first token `measured_s` after it was placed,
        predicted at `model_s` (RouteDecision.local_model_s)."""
        key = bucket(uncached_tokens)
        errors = self.local_errors.get(key)
        if errors is None:
            errors = self.local_errors[key] = PredictionErrors(LOCAL_ERRORS_WINDOW, LOCAL_ERRORS_MIN_SAMPLES,
                                                               LOCAL_ERRORS_HORIZON_S)
        errors.observe(model_s, measured_s)
        self._local_factors.pop(key, None)

    def route(self, block_hashes: Sequence[int], prompt_tokens: int, prefill_loads: Sequence[WorkerLoad],
              decode_loads: Sequence[WorkerLoad], elapsed_s: float = 0.0,
              output_tokens: int = EXPECTED_OUTPUT_TOKENS,
              prefill_backlog: Mapping[str, tuple[int, int]] | None = None, record: bool = True,
              ingress_backlog: tuple[int, int] | None = None, lora_key: str | None = None) -> RouteDecision:
        """Pick the decode worker and decide whether a prefill worker computes the prompt (`record=False`: a
        prediction only, which changes none of the router's measures). `elapsed_s`:
        how long ago the request arrived (its TTFT runs from then); `output_tokens`: what it will likely
        generate (its remaining max_tokens, at most EXPECTED_OUTPUT_TOKENS); `prefill_backlog`: per prefill
        worker, the (requests, prompt tokens) waiting at the ingress for a slot there ahead of this one,
        which it would queue behind (`with_backlog`); `ingress_backlog`: the (requests, prompt tokens) queued at
        the ingress ahead of it, placed before it: the workers that will take it share it as queued prompts
        (`share_backlog`; each pool all of it with `placement="thresholds"`, where a prompt's length fixes its
        path). `lora_key`: the LoRA adapter it runs with; a worker whose slots do not hold it pays the adapter's
        load (WorkerLoad.lora_miss_s)."""
        if prefill_backlog:
            prefill_loads = [with_backlog(load, prefill_backlog.get(load.worker_id)) for load in prefill_loads]
        if ingress_backlog and ingress_backlog[0]:
            if self.disagg.placement == "slo":
                prefill_loads, decode_loads = share_backlog(prefill_loads, decode_loads, ingress_backlog,
                                                            self.disagg)
            else:  # a prompt's path is fixed by its length: the backlog's prompts of its kind go where it goes
                prefill_loads, decode_loads = (spread_backlog(prefill_loads, ingress_backlog),
                                               spread_backlog(decode_loads, ingress_backlog))
        decode_loads = with_arrivals(decode_loads, self.arrivals.per_second())
        prefill = self.prefill_policy.place(block_hashes, prompt_tokens, prefill_loads, lora_key)
        prefill_load = None if prefill is None else lent_threads(_load_of(prefill, prefill_loads), decode_loads)
        prefill_cached = prefill.cached_tokens if prefill else 0
        if self.disagg.placement == "slo" and not self.decode_policy.round_robin:
            peers = PeerHolders(self.index, block_hashes, prompt_tokens, [*prefill_loads, *decode_loads],
                                self.block_size)
            prefill_pull_s = 0.0
            if prefill_load is not None:
                prefill_cached, prefill_pull_s = peers.pull(prefill_load, prefill_cached // self.block_size)
            decode, decision = self._place_decode_by_cost(block_hashes, prompt_tokens, prefill_cached, prefill_load,
                                                          decode_loads, elapsed_s, output_tokens, lora_key, peers,
                                                          prefill_pull_s)
        else:
            decode = self.decode_policy.place(block_hashes, prompt_tokens, decode_loads, lora_key)
            if decode is None:
                raise NoDecodeWorker("no decode worker is healthy and accepting requests")
            if self.disagg.placement == "thresholds":
                decision = decide_prefill(prompt_tokens, decode.cached_tokens, prefill_load, self.disagg)
                decision.predicted_ttft_s = predicted_ttft(decision, prompt_tokens, decode.cached_tokens, prefill_cached,
                                                           _load_of(decode, decode_loads), prefill_load, self.disagg,
                                                           elapsed_s)
            else:
                decision = decide_prefill_by_cost(prompt_tokens, decode.cached_tokens, prefill_cached,
                                                  _load_of(decode, decode_loads), prefill_load, self.disagg, elapsed_s,
                                                  local_factor=self.local_factor)
        if record and not decision.wait:
            self.arrivals.note()
            if prompt_tokens > 0:
                self._note_hit(decode.worker_id, decode.cached_tokens / prompt_tokens)
        return RouteDecision(decode, prefill if decision.remote else None, decision.reason, decision.wait,
                             decision.predicted_ttft_s, decision.local_tokens,
                             None if decision.remote else decision.local_model_s)

    def _note_hit(self, worker_id: str, share: float) -> None:
        """Fold one placement into the worker's hit share: the mean of its first placements, then an EWMA."""
        old, count = self.hit_share.get(worker_id, 0.0), self._placements.get(worker_id, 0) + 1
        self._placements[worker_id] = count
        self.hit_share[worker_id] = old + max(HIT_SHARE_ALPHA, 1 / count) * (share - old)

    def _place_decode_by_cost(self, block_hashes: Sequence[int], prompt_tokens: int, prefill_cached: int,
                              prefill: WorkerLoad | None, decode_loads: Sequence[WorkerLoad], elapsed_s: float,
                              output_tokens: int, lora_key: str | None = None, peers: PeerHolders | None = None,
                              prefill_pull_s: float = 0.0) -> tuple[Placement, PrefillDecision]:
        """The decode worker where the request costs least in seconds (`decode_seconds`), each with the
        prefill decision it would get there; among costs within TIE_TOLERANCE_S, the worker with the fewest
        sequences, then a random one. With `peers`, a worker that would compute the prompt itself is also priced
        pulling what a peer holds beyond its own blocks, where that pays (`PeerHolders.pull`): "pull it here"
        against "go where it is". `prefill_pull_s`: the prefill worker's own such pull (its tokens are in
        `prefill_cached`)."""
        candidates = [load for load in decode_loads if load.schedulable]
        if not candidates:
            raise NoDecodeWorker("no decode worker is healthy and accepting requests")
        overlaps = self.index.tier_overlap(block_hashes, [load.worker_id for load in candidates])
        options = []
        for load in candidates:
            on_device, anywhere = overlaps[load.worker_id]
            cached = anywhere * self.block_size  # blocks in a tier below its cache come back before its prefill
            promote_s = load.promote_s(self.index.lower_tiers(load.worker_id, block_hashes[on_device:anywhere])) \
                if anywhere > on_device else 0.0
            extra_s = promote_s + load.lora_miss_s(lora_key)
            seconds, decision = self._decode_option(prompt_tokens, cached, prefill_cached, load, prefill, elapsed_s,
                                                    output_tokens, prefill_pull_s=prefill_pull_s)
            pulled, pull_s = peers.pull(load, anywhere) if peers is not None else (cached, 0.0)
            if pulled > cached:  # computed here after pulling a peer's blocks: priced when it is the local path
                with_pull, local = self._decode_option(prompt_tokens, pulled, prefill_cached, load, prefill,
                                                       elapsed_s, output_tokens, prefill_pull_s, pull_s)
                if not local.remote and with_pull < seconds:
                    seconds, decision = with_pull, local
            options.append((seconds + extra_s, load.num_running + load.num_waiting, load.worker_id, cached,
                            decision))
        best = min(option[0] for option in options)
        near = [option for option in options if option[0] <= best + TIE_TOLERANCE_S]
        fewest = min(option[1] for option in near)
        tied = [option for option in near if option[1] == fewest]
        seconds, _, worker_id, cached, decision = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        return Placement(worker_id, cached, seconds), decision

    def _decode_option(self, prompt_tokens: int, cached: int, prefill_cached: int, load: WorkerLoad,
                       prefill: WorkerLoad | None, elapsed_s: float, output_tokens: int, prefill_pull_s: float = 0.0,
                       local_pull_s: float = 0.0) -> tuple[float, PrefillDecision]:
        """(seconds, decision) of placing the request on decode worker `load`, which holds `cached` of its
        prompt tokens (`local_pull_s` of them pulled from a peer first, on the local path)."""
        decision = decide_prefill_by_cost(prompt_tokens, cached, prefill_cached, load, prefill, self.disagg, elapsed_s,
                                          remote_pull_s=prefill_pull_s, local_pull_s=local_pull_s,
                                          local_factor=self.local_factor)
        displaced = displaced_seconds(prompt_tokens, cached, output_tokens, load, self.index.num_blocks(load.worker_id),
                                      self.hit_share.get(load.worker_id, 0.0), self.block_size)
        seconds = decode_seconds(prompt_tokens, cached, load, decision, output_tokens, self.disagg, self.block_size,
                                 elapsed_s, displaced)
        return seconds + (0.0 if decision.remote else local_pull_s), decision


class PeerHolders:
    """Which workers hold how much of one prompt's leading blocks (cache or tiers), to price a worker pulling the
    rest of the deepest holder's run instead of computing it (cost_model.peer_pull_pays, as
    WorkerView.peer_prefix then decides for the worker that computes the prompt)."""

    def __init__(self, index: PrefixIndex, block_hashes: Sequence[int], prompt_tokens: int,
                 loads: Sequence[WorkerLoad], block_size: int):
        self.prompt_tokens, self.block_size = prompt_tokens, block_size
        usable = block_hashes[:max(0, (prompt_tokens - 1) // block_size)]
        holders = {load.worker_id: load for load in loads if load.serves_prefixes}
        overlaps = index.tier_overlap(usable, list(holders)) if usable and holders else {}
        self.depths = sorted(((overlaps[w][1], overlaps[w][0], holders[w]) for w in overlaps if overlaps[w][1]),
                             key=lambda depth: -depth[0])

    def pull(self, puller: WorkerLoad, have_blocks: int) -> tuple[int, float]:
        """(cached tokens, pull seconds) for `puller`, which holds `have_blocks` of the prompt: the deepest other
        holder's run when pulling what it lacks of it pays, else its own blocks and no pull."""
        bs = self.block_size
        if puller.pulls_prefixes:
            for anywhere, on_device, holder in self.depths:
                if holder.worker_id == puller.worker_id:
                    continue
                if anywhere <= have_blocks:
                    break
                pays, pull_s, _ = peer_pull_pays(anywhere - have_blocks, have_blocks * bs, self.prompt_tokens,
                                                 puller, holder, anywhere - max(on_device, have_blocks), bs)
                if pays:
                    return anywhere * bs, pull_s
                break
        return have_blocks * bs, 0.0


def with_backlog(prefill: WorkerLoad, backlog: tuple[int, int] | None) -> WorkerLoad:
    """`prefill` as a request sees it behind `backlog`, the (requests, prompt tokens) that wait at the
    ingress for a slot on it and will take the next ones: they count as queued there, so a request
    routed behind them predicts the remote path's wait (and its queue as full) as it will be."""
    if not backlog or not backlog[0]:
        return prefill
    requests, tokens = backlog
    return dataclasses.replace(prefill, num_waiting=prefill.num_waiting + requests,
                               queued_prefill_tokens=prefill.queued_prefill_tokens + tokens)


def spread_backlog(loads: Sequence[WorkerLoad], backlog: tuple[int, int]) -> list[WorkerLoad]:
    """`loads` with `backlog` (requests, prompt tokens) shared evenly by the schedulable ones as queued."""
    schedulable = sum(load.schedulable for load in loads) or 1
    requests, tokens = backlog
    share = (-(-requests // schedulable), tokens // schedulable)
    return [with_backlog(load, share) if load.schedulable else load for load in loads]


def share_backlog(prefill_loads: Sequence[WorkerLoad], decode_loads: Sequence[WorkerLoad],
                  backlog: tuple[int, int], config: DisaggConfig) -> tuple[list[WorkerLoad], list[WorkerLoad]]:
    """The ingress backlog (requests, prompt tokens) as the schedulable workers of both pools will take it when
    placed by cost, where both paths take prompts under load: each worker's share in proportion to the rate it
    computes them at (`prefill_rate`), so that every share drains in about the time the pooled backlog does.
    Counting the whole backlog on each pool instead put a request at the knee twice as far off as it was, with
    one prefill and one decode worker, and shedding refused 17-31% of the requests it would have served in time
    (bench/RESULTS.md row 60)."""
    requests, tokens = backlog
    mean = tokens // max(requests, 1)
    rates = [(load, prefill_rate(load, mean, remote, config) if load.schedulable else 0.0)
             for loads, remote in ((prefill_loads, True), (decode_loads, False)) for load in loads]
    total = sum(rate for _, rate in rates)
    if total <= 0:
        return list(prefill_loads), list(decode_loads)
    shared = [with_backlog(load, (math.ceil(requests * rate / total), round(tokens * rate / total)))
              if rate > 0 else load for load, rate in rates]
    return shared[:len(prefill_loads)], shared[len(prefill_loads):]


def with_arrivals(decode_loads: Sequence[WorkerLoad], per_second: float) -> Sequence[WorkerLoad]:
    """The decode loads with each schedulable worker's share of `per_second` arrivals as the streams expected
    to join it (`WorkerLoad.arrivals_per_s`)."""
    schedulable = sum(load.schedulable for load in decode_loads)
    if per_second <= 0 or not schedulable:
        return decode_loads
    return [dataclasses.replace(load, arrivals_per_s=per_second / schedulable) if load.schedulable else load
            for load in decode_loads]


def _load_of(placement: Placement, loads: Sequence[WorkerLoad]) -> WorkerLoad:
    return next(load for load in loads if load.worker_id == placement.worker_id)
