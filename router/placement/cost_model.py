"""The cost model of placement: what a path costs in seconds, predicted from the workers' measured
`StepCosts` (engine/step_costs.py), and the conditional-disaggregation call made from it.

Where a prompt is prefilled ("on a prefill worker, or let the decode worker prefill locally") is decided
from the workers' measured costs against the TTFT/ITL SLOs (`decide_prefill_by_cost`, the default), or by
Dynamo's fixed token thresholds (`decide_prefill`, an operator's override). `decode_seconds` is what
placing a request on a decode worker costs everyone it delays, and `displaced_seconds` what its new blocks
evict there.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Literal

from engine.step_costs import MIN_CHUNK_TOKENS, pull_seconds, stall_free_budget
from router.placement.cpu_lending import lent_to_busy_prefill
from worker_runtime.protocol import WorkerLoad


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
    # A chunked local prefill beside running streams: its uncached prompt tokens and its seconds as the step costs
    # predict them, before `local_factor` scaled them (measured against the first token to learn that factor;
    # Router.local_factor).
    local_tokens: int = field(default=0, compare=False)
    local_model_s: float | None = field(default=None, compare=False)


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


def predicted_ttft(decision: PrefillDecision, prompt_tokens: int, decode_cached_tokens: int,
                   prefill_cached_tokens: int, decode: WorkerLoad, prefill: WorkerLoad | None, config: DisaggConfig,
                   elapsed_s: float = 0.0, min_chunk: int = MIN_CHUNK_TOKENS) -> float:
    """The first token's predicted seconds from arrival on the path a decision took by another rule than cost
    (`decide_prefill`'s thresholds): what SLO-aware shedding and the request's timeline compare against."""
    if decision.remote and prefill is not None:
        return elapsed_s + remote_prefill_ttft(prompt_tokens, prefill_cached_tokens, decode_cached_tokens, prefill,
                                               decode)
    return elapsed_s + local_prefill_cost(prompt_tokens, decode_cached_tokens, decode, config.itl_slo_s, min_chunk,
                                          config.stall_ratio)[0]


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


# Rounds of the fixed point that prices streams joining a decode worker during its local prefill.
ARRIVAL_ROUNDS = 3


def local_prefill_cost(prompt_tokens: int, decode_cached_tokens: int, decode: WorkerLoad,
                       itl_slo_s: float, min_chunk: int, stall_ratio: float | None = None) -> tuple[float, float]:
    """(predicted seconds to the first token, seconds added to each running stream) when the decode
    worker prefills. Beside running streams the prompt goes in chunks that keep each step within the
    ITL SLO (the decode worker's stall-free budget), after the local prefills already queued there; one
    whose uncached rest fits a single chunk, with no other request waiting there, goes before the running
    prompts' next chunks (engine/scheduler.py) and waits for none of them.

    Streams that join the worker while the prompt is computed (`decode.arrivals_per_s`, the router's view of
    the arrival rate) shrink its later chunks: a prefill of T seconds runs beside the running streams plus
    half of the T * rate that arrive meanwhile, found by a few rounds of that fixed point. Without it a long
    prompt placed on a worker idle now was predicted at 4.2 s and, with 1 req/s of streams arriving, took
    8.6 s in 97 chunks."""
    ttft, stall = _local_prefill(prompt_tokens, decode_cached_tokens, decode, decode.num_running, itl_slo_s,
                                 min_chunk, stall_ratio)
    running = decode.num_running
    for _ in range(ARRIVAL_ROUNDS if decode.arrivals_per_s > 0 else 0):
        expected = decode.num_running + round(decode.arrivals_per_s * ttft / 2)
        if expected <= running:
            break
        running = expected
        ttft = _local_prefill(prompt_tokens, decode_cached_tokens, decode, running, itl_slo_s, min_chunk,
                              stall_ratio)[0]
    return ttft, stall


def _local_prefill(prompt_tokens: int, decode_cached_tokens: int, decode: WorkerLoad, num_running: int,
                   itl_slo_s: float, min_chunk: int, stall_ratio: float | None) -> tuple[float, float]:
    """`local_prefill_cost` with `num_running` streams beside the prompt throughout."""
    costs = decode.step_costs
    uncached = prompt_tokens - decode_cached_tokens
    speed = costs.prefill_speed(prompt_tokens)
    # The decode worker's own budget; chunks shrink as the prompt's context grows: its middle one's size.
    chunk = stall_free_budget(costs, itl_slo_s, stall_ratio, min_chunk)(num_running,
                                                                        (decode_cached_tokens + prompt_tokens) // 2)
    jumps = num_running and not decode.num_waiting and uncached <= chunk
    work = uncached + (0 if jumps else decode.queued_prefill_tokens)
    if not num_running:
        return math.ceil(work / chunk) * costs.decode_time(1) + work / speed, 0.0
    step_s = costs.decode_time(num_running) + min(chunk, work) / speed
    return math.ceil(work / chunk) * step_s, uncached / speed


def prefill_rate(load: WorkerLoad, prompt_tokens: int, remote: bool, config: DisaggConfig,
                 min_chunk: int = MIN_CHUNK_TOKENS) -> float:
    """Prompt tokens per second `load` computes prompts of about `prompt_tokens` at, for prompts queued ahead
    of its own: a prefill worker (`remote`) at its prefill speed (on the cores lent to it now, when it
    borrows), a decode worker in its chunked local prefill, each chunk a step beside its running streams."""
    costs = load.step_costs
    if remote:
        if load.borrow_threads_now is not None:
            costs = dataclasses.replace(costs, borrow_threads=load.borrow_threads_now)
        return costs.prefill_speed(max(prompt_tokens, 1), costs.borrowing)
    speed = costs.prefill_speed(max(prompt_tokens, 1))
    chunk = stall_free_budget(costs, config.itl_slo_s, config.stall_ratio, min_chunk)(load.num_running,
                                                                                     prompt_tokens // 2)
    return chunk / (costs.decode_time(max(load.num_running, 1)) + chunk / speed)


def decide_prefill_by_cost(prompt_tokens: int, decode_cached_tokens: int, prefill_cached_tokens: int,
                           decode: WorkerLoad, prefill: WorkerLoad | None, config: DisaggConfig,
                           elapsed_s: float = 0.0, min_chunk: int = MIN_CHUNK_TOKENS, *, remote_pull_s: float = 0.0,
                           local_pull_s: float = 0.0,
                           local_factor: Callable[[int], float] | None = None) -> PrefillDecision:
    """Remote prefill unless the remote path would miss the TTFT SLO where a local one would not, or a
    local one costs the decode worker's running streams nothing material: it has none and the remote
    path is no faster, or the whole prompt fits in one step within the ITL SLO and local is faster; or
    local is faster by more than the delay its chunks add to all running streams together (a deep
    prefill queue).

    A full prefill queue means waiting for a slot while the remote path still meets the TTFT SLO,
    counted from arrival (`elapsed_s` ago), then a local prefill if that meets it or comes sooner (under
    overload both paths then share the prompts, each at its predicted wait); otherwise it waits on.

    `remote_pull_s`, `local_pull_s`: the time the worker computing the prompt on each path first spends
    pulling prefix blocks from a peer (their tokens counted in its cached tokens; `peer_pull_pays`).
    `local_factor(uncached tokens)`: how far off the predictions of chunked local prefills of about that many
    tokens beside running streams came lately (`Router.local_factor`); such a prediction is scaled by it."""
    if prefill is None or not prefill.schedulable:
        return PrefillDecision(False, "no_prefill_worker")
    remote = elapsed_s + remote_pull_s + remote_prefill_ttft(prompt_tokens, prefill_cached_tokens,
                                                             decode_cached_tokens, prefill, decode)
    local, stall = local_prefill_cost(prompt_tokens, decode_cached_tokens, decode, config.itl_slo_s, min_chunk,
                                      config.stall_ratio)
    local_tokens, local_model_s = prompt_tokens - decode_cached_tokens, None
    if decode.num_running:
        local_model_s = local
        if local_factor is not None:
            local *= local_factor(local_tokens)
    local += elapsed_s + local_pull_s
    if lent_to_busy_prefill(decode, prefill):
        # Its core is in a borrowed prefill forward right now: a local prefill shares it (and slows that
        # forward) until the forward ends, within about one borrowed slice (cpu.borrow_slice_ms, by default
        # the ITL SLO).
        local += config.itl_slo_s

    def locally(reason: str) -> PrefillDecision:
        return PrefillDecision(False, reason, predicted_ttft_s=local, local_tokens=local_tokens,
                               local_model_s=local_model_s)

    if not decode.num_running and local <= remote:
        return locally("decode_idle")
    one_step = decode.step_costs.decode_time(decode.num_running) + stall
    step_limit = decode.step_costs.step_limit(decode.num_running, config.itl_slo_s, config.stall_ratio)
    if decode.num_running and one_step <= step_limit and local <= remote:
        return locally("stall_within_itl_slo")
    if decode.num_running and local + decode.num_running * stall < remote:
        # The prefill queue is deep: the chunked local prefill (each step within the ITL SLO) gets the first
        # token sooner by more than it delays every running stream together.
        return locally("remote_queue_costs_more")
    if prefill.num_waiting >= config.max_prefill_queue_size:
        if remote <= config.ttft_slo_s:
            return PrefillDecision(True, "prefill_queue_full", wait=True, predicted_ttft_s=remote)
        if local <= config.ttft_slo_s or local < remote:
            return locally("prefill_queue_full")
        # Lost either way, and a local prefill (behind the decode worker's own) would come no sooner: wait on.
        return PrefillDecision(True, "ttft_slo_missed_either_way", wait=True, predicted_ttft_s=remote)
    if remote <= config.ttft_slo_s:
        return PrefillDecision(True, "remote_within_ttft_slo", predicted_ttft_s=remote)
    if local <= config.ttft_slo_s:
        return locally("remote_misses_ttft_slo")
    return PrefillDecision(True, "ttft_slo_missed_either_way", predicted_ttft_s=remote)


# Added to a decode worker whose free KV blocks cannot hold the request: chosen only when all are full.
KV_FULL_PENALTY_S = 1000.0


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


PEER_LEASE_S = 0.005  # a peer's lease_prefix call (a Ray round trip) before the pull starts
MIN_PEER_BLOCKS = 2  # fewer blocks to gain are computed, not pulled


def peer_pull_pays(num_blocks: int, start_tokens: int, prompt_tokens: int, puller: WorkerLoad, holder: WorkerLoad,
                   holder_lower_blocks: int, block_size: int) -> tuple[bool, float, float]:
    """Whether `puller` gets `num_blocks` prompt blocks (from token `start_tokens` on) sooner by pulling them from
    `holder` (its lease, the holder bringing `holder_lower_blocks` of them back from its tiers, the pull at the
    puller's measured speed) than by computing them at its measured prefill speed; and both predictions, in
    seconds (pull, compute). Unknown KV sizes (no stats yet) never pull."""
    if num_blocks < MIN_PEER_BLOCKS or not puller.kv_bytes_per_token:
        return False, float("inf"), 0.0
    tokens = num_blocks * block_size
    pull = (PEER_LEASE_S + holder_lower_blocks * holder.promote_s_per_block
            + pull_seconds(tokens * puller.kv_bytes_per_token, puller.kv_pull_latency_s, puller.kv_pull_gbps))
    compute = puller.step_costs.prefill_time(tokens, start_tokens + tokens) if tokens else 0.0
    return pull < compute, pull, compute
