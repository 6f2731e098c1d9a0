"""Placement within one pool by token cost, as Dynamo's KV router does: the prefill work a worker would
still have to do for this request (prompt tokens it does not cache, plus prefill tokens already queued
there), plus its current decode load (running sequences, KV usage). Lowest cost wins; ties are broken at
random so equal workers share the traffic."""
from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from router.placement.index import PrefixIndex
from worker_runtime.protocol import WorkerLoad


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
                 rng: random.Random | None = None, round_robin: bool = False, in_flight: bool = False):
        self.index = index
        self.block_size = block_size
        self.weights = weights or CostWeights()
        self.rng = rng or random.Random()
        self.round_robin = round_robin
        self.in_flight = in_flight  # count the blocks of prompts routed to a worker as its own (prefill pool)
        self._turn = 0

    def place(self, block_hashes: Sequence[int], prompt_tokens: int,
              loads: Sequence[WorkerLoad], lora_key: str | None = None) -> Placement | None:
        """The cheapest schedulable worker of `loads`, or None when none is schedulable. A request running LoRA
        adapter `lora_key` costs more where no slot holds it: the load, as prompt tokens of that worker's time."""
        candidates = [load for load in loads if load.healthy and not load.draining]
        if not candidates:
            return None
        # Blocks in a tier below a worker's cache count as cached: it brings them back before computing (a copy,
        # a hundredth or less of computing them).
        overlaps = self.index.overlap(block_hashes, [load.worker_id for load in candidates], self.in_flight,
                                      tiers=True)
        block_size = self.block_size
        if self.round_robin:
            chosen = sorted(candidates, key=lambda load: load.worker_id)[self._turn % len(candidates)]
            self._turn += 1
            return Placement(chosen.worker_id, overlaps[chosen.worker_id] * block_size, 0.0)
        w_prefill, w_decode, w_running = self.weights.prefill, self.weights.decode * block_size, self.weights.running
        # Hashes cover the prompt's full blocks only, so cached never exceeds prompt_tokens.
        costs = [w_prefill * (prompt_tokens - overlaps[load.worker_id] * block_size + load.queued_prefill_tokens
                              + self._lora_tokens(load, lora_key, prompt_tokens))
                 + w_decode * load.num_active_blocks + w_running * load.num_running for load in candidates]
        best = min(costs)
        tied = [i for i, cost in enumerate(costs) if cost == best]
        chosen = candidates[tied[0] if len(tied) == 1 else self.rng.choice(tied)]
        return Placement(chosen.worker_id, overlaps[chosen.worker_id] * block_size, best)

    @staticmethod
    def _lora_tokens(load: WorkerLoad, lora_key: str | None, prompt_tokens: int) -> float:
        """Loading the request's LoRA adapter where no slot holds it, as prompt tokens of that worker's time."""
        miss_s = load.lora_miss_s(lora_key)
        return miss_s * load.step_costs.prefill_speed(prompt_tokens) if miss_s else 0.0
