"""Placement policy: which worker of a pool gets a request, and where its prefill runs.

Cost follows Dynamo's KV router: the prefill work a worker would still have to
do for this request (prompt tokens it does not cache, plus prefill tokens
already queued there), plus its current decode load (running sequences, KV
usage). Lowest cost wins; ties are broken at random so equal workers share
the traffic. The prefill and decode pools are placed separately, each by its
own `PoolPolicy` over that pool's load snapshot.

The conditional-disaggregation decision ("prefill on a prefill worker, or let
the decode worker prefill locally") lives in `decide_prefill`, and `Router`
ties the three steps together for the ingress.
"""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.index import PrefixIndex


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
    """Places requests within one pool: lowest cost wins, random among ties."""

    def __init__(self, index: PrefixIndex, block_size: int, weights: CostWeights | None = None,
                 rng: random.Random | None = None):
        self.index = index
        self.block_size = block_size
        self.weights = weights or CostWeights()
        self.rng = rng or random.Random()

    def place(self, block_hashes: Sequence[int], prompt_tokens: int,
              loads: Sequence[WorkerLoad]) -> Placement | None:
        """The cheapest schedulable worker of `loads`, or None when none is schedulable."""
        candidates = [load for load in loads if load.healthy and not load.draining]
        if not candidates:
            return None
        overlaps = self.index.overlap(block_hashes, [load.worker_id for load in candidates])
        block_size = self.block_size
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
    """Conditional disaggregation thresholds (Dynamo's names and semantics).

    Prefill runs remotely only when all hold: the decode worker would have
    more than `max_local_prefill_length` tokens to compute, it caches less
    than `max_remote_prefill_cache_hit_ratio` of the prompt, a prefill worker
    is schedulable, and that worker has fewer than `max_prefill_queue_size`
    requests waiting. Otherwise the decode worker prefills locally and no KV
    moves between pools.
    """
    max_local_prefill_length: int = 2048
    max_remote_prefill_cache_hit_ratio: float = 0.7
    max_prefill_queue_size: int = 2


@dataclass(slots=True)
class PrefillDecision:
    """Remote or local prefill, with the reason (a metrics label)."""
    remote: bool
    reason: str


def decide_prefill(prompt_tokens: int, decode_cached_tokens: int, prefill: WorkerLoad | None,
                   config: DisaggConfig) -> PrefillDecision:
    """Decide where the prompt is prefilled, given the decode worker's prefix hit.

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


class NoDecodeWorker(RuntimeError):
    """No decode worker is healthy and accepting requests; the ingress answers 503."""


@dataclass(slots=True)
class RouteDecision:
    """Where one request goes. `prefill` is None when the decode worker prefills locally."""
    decode: Placement
    prefill: Placement | None
    reason: str


class Router:
    """Places a request on both pools and makes the conditional-disaggregation call."""

    def __init__(self, index: PrefixIndex, block_size: int, disagg: DisaggConfig | None = None,
                 prefill_weights: CostWeights | None = None, decode_weights: CostWeights | None = None,
                 rng: random.Random | None = None):
        rng = rng or random.Random()
        self.index = index
        self.disagg = disagg or DisaggConfig()
        self.prefill_policy = PoolPolicy(index, block_size, prefill_weights, rng)
        self.decode_policy = PoolPolicy(index, block_size, decode_weights, rng)

    def route(self, block_hashes: Sequence[int], prompt_tokens: int,
              prefill_loads: Sequence[WorkerLoad], decode_loads: Sequence[WorkerLoad]) -> RouteDecision:
        """Pick the decode worker, then decide whether a prefill worker computes the prompt."""
        decode = self.decode_policy.place(block_hashes, prompt_tokens, decode_loads)
        if decode is None:
            raise NoDecodeWorker("no decode worker is healthy and accepting requests")
        prefill = self.prefill_policy.place(block_hashes, prompt_tokens, prefill_loads)
        prefill_load = None if prefill is None else next(
            load for load in prefill_loads if load.worker_id == prefill.worker_id)
        decision = decide_prefill(prompt_tokens, decode.cached_tokens, prefill_load, self.disagg)
        return RouteDecision(decode, prefill if decision.remote else None, decision.reason)
