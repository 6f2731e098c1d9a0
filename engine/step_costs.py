"""What an engine's steps cost, as measured on its own forwards.

A step runs its decode tokens and prefill chunks in one forward, so its time is modelled as

    step_s(num_decodes, prefill_tokens, context) = decode_step_s(max(num_decodes, 1))
                                                   + prefill_tokens / prefill_tokens_per_s(context)

`decode_step_s` (per batch-size bucket) carries the fixed cost of a forward; `prefill_tokens_per_s` (per
context-length bucket, the context a chunk ends at) is the marginal speed of prompt tokens. Buckets are
powers of two. A prefill bucket holds an EWMA of its measurements; a decode bucket holds the median of its
last DECODE_WINDOW steps, since one slow step (a collection, a neighbour's wake-up on the core) moved an EWMA
by a fifth and the router compared workers by it: two identical decode workers read 34 and 47 ms at batch 1
seconds apart, and the difference, times a request's output, outweighed a 512-token prefix hit. Before any
measurement the priors below stand; a worker replaces them with a warm-up forward at start (Engine.warm_up). Workers report these costs in
their stats, the router places prefills with them, and a decode worker sizes its stall-free prefill
chunks with them (`prefill_budget`).
"""
from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.request import Request

# Priors for a worker that has measured nothing yet: a small model on one CPU core.
PRIOR_PREFILL_TOKENS_PER_S = 500.0
PRIOR_DECODE_STEP_S = 0.05
# What each sequence added to a batch adds to a decode step, as a share of a lone sequence's step, until two
# batch sizes are measured: a guess for a small model on CPU cores, where a step reads all weights once and
# each sequence adds its own matmul rows and attention (a GPU's is far smaller, and measured soon enough).
PRIOR_DECODE_BATCH_SLOPE = 0.1
PRIOR_KV_PULL_GBPS = 1.0  # DESIGN §3: gRPC streaming moves ~1 GB/s on loopback
PRIOR_KV_PULL_LATENCY_S = 0.005  # a pull's fixed cost (calls, lease, first chunk) before it is measured
LARGE_PULL_BYTES = 4 << 20  # pulls at least this big measure bandwidth; smaller ones, latency
# Until a worker has measured a forward on borrowed cores: the speed-up per thread it adds, of a perfect
# one. Measured on the dev box: a 256-token SmolLM2 prefill on 2 threads ran 1.77x its 1-thread speed.
PRIOR_BORROW_EFFICIENCY = 0.85
# The smallest prompt chunk a step beside decodes carries, whatever the room, so a prefill always progresses.
# Not a block: at a long prompt's end one 16-token chunk took 60 ms on a core where the room was 36 ms, and
# every such step stalled the streams at 3x their decode step.
MIN_CHUNK_TOKENS = 4
DECODE_WINDOW = 64  # plain decode steps per batch-size bucket whose median is the bucket's step time


def step_shape(scheduled: list[tuple[Request, int]]) -> tuple[int, int, int]:
    """(decode tokens, prefill tokens, the longest context a prefill chunk ends at) of a schedule: what a
    step's cost is measured and predicted by."""
    decodes = prefill = context = 0
    for req, n in scheduled:
        if n == 1 and req.num_computed_tokens > 0:
            decodes += 1
        else:
            prefill += n
            context = max(context, req.num_computed_tokens + n)
    return decodes, prefill, context


def bucket(n: float) -> int:
    """The power-of-two bucket holding `n` (the smallest power of two not below it; at least 1)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _nearest(table: dict[int, float], key: int, within: int | None = None) -> float | None:
    """The value of the bucket nearest `key` in log scale; the larger bucket on a tie (the slower one).
    None when the table is empty, or when the nearest bucket is more than `within` buckets away."""
    if not table:
        return None
    if key in table:
        return table[key]
    nearest = min(table, key=lambda b: (abs(math.log2(b) - math.log2(key)), -b))
    if within is not None and abs(math.log2(nearest) - math.log2(key)) > within:
        return None
    return table[nearest]


@dataclass(slots=True)
class StepCosts:
    """Measured step costs of one engine: per bucket, the median of the last DECODE_WINDOW decode steps,
    and an EWMA of prefill speeds (weight `alpha` for the newest measurement)."""
    prefill_tokens_per_s: dict[int, float] = field(default_factory=dict)  # context bucket -> tokens/s
    decode_step_s: dict[int, float] = field(default_factory=dict)  # batch-size bucket -> seconds
    alpha: float = 0.2
    # A CPU worker that borrows idle neighbours' cores (worker_runtime/cpu_cores.py) prefills faster while they
    # are lent: its steps on borrowed cores are measured apart, and its stats say how many threads a
    # forward would get right now (`borrow_threads`, 0 when nothing is lent) against its own threads.
    borrowed_prefill_tokens_per_s: dict[int, float] = field(default_factory=dict)
    own_threads: int = 1
    borrow_threads: int = 0
    # Who lends to whom, so the router can tell from its own live view of the decode workers whether cores
    # are lent right now (a stats snapshot taken while a lender was busy goes stale at once): the pinned
    # worker's node (host and core-lock directory; "" when not pinned), the threads a decode worker lends
    # while idle, and whether a prefill worker borrows.
    cpu_node: str = ""
    lend_threads: int = 0
    borrows: bool = False
    # The last DECODE_WINDOW plain decode steps of each bucket (the measuring engine's own; not copied).
    _decode_samples: dict[int, deque] = field(default_factory=dict, repr=False, compare=False)

    def observe(self, num_decodes: int, prefill_tokens: int, prefill_context: int, seconds: float,
                borrowed: bool = False) -> None:
        """Take one step's time (`borrowed`: it ran on borrowed cores too). A step with prefill chunks is
        charged its decode part at the current estimate, the rest to its prefill tokens."""
        if seconds <= 0:
            return
        if not prefill_tokens:
            if num_decodes and not borrowed:
                key = bucket(num_decodes)
                samples = self._decode_samples.setdefault(key, deque(maxlen=DECODE_WINDOW))
                samples.append(seconds)
                self.decode_step_s[key] = statistics.median(samples)
            return
        fixed = self.decode_time(max(num_decodes, 1))
        # The decode part is an estimate (a median, of steps that ran apart): the prompt tokens get at least half
        # the step, or their share of its tokens where that is less (a small chunk beside many decodes). Half of
        # every step was too much there: a chunk of 4 tokens that took 22 ms beside a 36 ms batch was charged
        # 29 ms, the speed so measured sized the next chunk smaller still, and under load local prefills crawled in
        # chunks of 4-8 tokens (a 256-token prompt in 32 steps, 64 tokens after a 1,536-token hit in 16).
        share = min(0.5, prefill_tokens / (prefill_tokens + num_decodes))
        prefill_s = max(seconds - fixed, seconds * share)
        table = self.borrowed_prefill_tokens_per_s if borrowed else self.prefill_tokens_per_s
        self._update(table, bucket(prefill_context), prefill_tokens / prefill_s)

    @property
    def borrowing(self) -> bool:
        """Whether the worker's next forwards would run on borrowed cores as well (as its stats said)."""
        return self.borrow_threads > self.own_threads

    def decode_time(self, num_decodes: int) -> float:
        """Seconds of a step running `num_decodes` decode tokens (and the fixed cost of any forward)."""
        measured = _nearest(self.decode_step_s, bucket(num_decodes))
        return PRIOR_DECODE_STEP_S if measured is None else measured

    def decode_time_between(self, num_decodes: int) -> float:
        """`decode_time`, interpolated linearly between the measured buckets (each at its own size), so
        that one more sequence always costs its share and not a whole bucket's jump or nothing. Beyond the
        largest measured size the slope of the last two goes on; with one (a warm-up's) or none, the prior
        slope: a batch nobody measured is not free."""
        keys = sorted(self.decode_step_s)
        if not keys:
            return PRIOR_DECODE_STEP_S * (1 + PRIOR_DECODE_BATCH_SLOPE * (max(num_decodes, 1) - 1))
        table = self.decode_step_s
        if num_decodes <= keys[0]:
            return table[keys[0]]
        for low, high in zip(keys, keys[1:]):
            if num_decodes <= high:
                return table[low] + (table[high] - table[low]) * (num_decodes - low) / (high - low)
        last = keys[-1]
        if len(keys) > 1:
            slope = max(0.0, (table[last] - table[keys[-2]]) / (last - keys[-2]))
        else:
            slope = PRIOR_DECODE_BATCH_SLOPE * table[last]
        return table[last] + slope * (num_decodes - last)

    def prefill_speed(self, context: int, borrowing: bool = False) -> float:
        """Prompt tokens per second for chunks ending at about `context` tokens; with `borrowing`, on the
        cores lent now as well (measured within a factor of two of `context`, else the own speed scaled by
        PRIOR_BORROW_EFFICIENCY)."""
        measured = _nearest(self.prefill_tokens_per_s, bucket(context))
        own = PRIOR_PREFILL_TOKENS_PER_S if measured is None else measured
        if not borrowing:
            return own
        # Only a measurement at about this length: a short prompt's borrowed forward is mostly fixed cost,
        # and its speed says nothing of a long one's (seen: a 16-token warm-up put 432 tok/s, slower than
        # one core, on every prompt).
        borrowed = _nearest(self.borrowed_prefill_tokens_per_s, bucket(context), within=1)
        if borrowed is not None:
            return borrowed
        extra = (self.borrow_threads - self.own_threads) / max(self.own_threads, 1)
        return own * (1 + PRIOR_BORROW_EFFICIENCY * max(extra, 0))

    def prefill_time(self, num_tokens: int, context: int | None = None, borrowing: bool = False) -> float:
        """Seconds of compute for `num_tokens` prompt tokens of a prompt of `context` tokens, as one
        forward with no decodes beside it (`borrowing`: on the cores lent now as well)."""
        if num_tokens <= 0:
            return 0.0
        return self.decode_time(1) + num_tokens / self.prefill_speed(context or num_tokens, borrowing)

    def step_limit(self, num_decodes: int, step_s: float, stall_ratio: float | None = None) -> float:
        """The longest step beside `num_decodes` decodes that stalls nobody: `step_s` (the ITL SLO), and
        at most `stall_ratio` times a plain decode step, so the streams' ITL tail stays near their median."""
        return step_s if stall_ratio is None else min(step_s, stall_ratio * self.decode_time(num_decodes))

    def prefill_budget(self, num_decodes: int, step_s: float, min_tokens: int, stall_ratio: float | None = None,
                       borrowing: bool = False, start: int = 0) -> int:
        """Prompt tokens a step beside `num_decodes` decodes may carry and still take at most `step_limit`
        (stall-free batching; `borrowing`: at the speed on borrowed cores), for a chunk starting `start`
        tokens into its prompt; never fewer than `min_tokens`, so a prefill always progresses.

        A chunk's speed is the speed at the context it ends at: each of its tokens attends everything
        before it, so late chunks of a long prompt are slower (SmolLM2 on one core beside 10 decodes: 32
        tokens took 40 ms at the start of a 1,536-token prompt and 100 ms at its end)."""
        room = self.step_limit(num_decodes, step_s, stall_ratio) - self.decode_time(num_decodes)
        tokens = min_tokens
        for _ in range(2):  # the speed depends on where the chunk ends, which depends on its length
            tokens = max(min_tokens, int(room * self.prefill_speed(start + max(tokens, 1), borrowing)))
        return tokens

    def borrowed_step_cap(self, slice_ms: float | None, block_size: int) -> int | None:
        """Prompt tokens a forward on borrowed cores may carry: what the borrowed speed computes within
        `slice_ms` (at least a block), so a lender that turns busy waits at most about that long for its
        core to be its own again. None without a slice (no cap)."""
        if not slice_ms:
            return None
        return self.prefill_budget(0, slice_ms / 1000, block_size, borrowing=True)

    def copy(self) -> StepCosts:
        """A snapshot another thread may read (or pickle) while this one keeps measuring."""
        return StepCosts(dict(self.prefill_tokens_per_s), dict(self.decode_step_s), self.alpha,
                         dict(self.borrowed_prefill_tokens_per_s), self.own_threads, self.borrow_threads,
                         self.cpu_node, self.lend_threads, self.borrows)

    def _update(self, table: dict[int, float], key: int, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else old + self.alpha * (value - old)


def stall_free_budget(costs: StepCosts, itl_slo_s: float, stall_ratio: float | None,
                      min_tokens: int = MIN_CHUNK_TOKENS):
    """A decode worker's prefill budget (Scheduler.prefill_budget; the router predicts local prefills with
    it): beside running streams, the prompt tokens that keep a step within the ITL SLO and `stall_ratio`
    plain decode steps; with none running, within the ITL SLO still, since a stream that joins meanwhile (a
    remotely prefilled request) waits for the step (seen: seven queued prompts in one 1.9 s step, and the
    stream that joined waited it out)."""
    def budget(num_decodes: int, start: int) -> int:
        return costs.prefill_budget(num_decodes, itl_slo_s, min_tokens, stall_ratio if num_decodes else None,
                                    start=start)
    return budget


@dataclass(slots=True)
class TransferSpeed:
    """A decode worker's KV pulls, modelled as seconds = latency_s + bytes / (gbps * 1e9) and learned from
    the pulls it makes (EWMAs; the priors until then). A small pull is all latency (one block of SmolLM2
    moved at 0.04 GB/s "bandwidth"), so only pulls of at least LARGE_PULL_BYTES teach the bandwidth; the
    others teach the latency."""
    gbps: float = PRIOR_KV_PULL_GBPS
    latency_s: float = PRIOR_KV_PULL_LATENCY_S
    alpha: float = 0.2
    _seen: set = field(default_factory=set)  # which of "latency" and "bandwidth" were measured

    def observe(self, num_bytes: int, seconds: float) -> None:
        if num_bytes <= 0 or seconds <= 0:
            return
        if num_bytes >= LARGE_PULL_BYTES:
            # At most 10x the pull's own rate: a latency estimate near the pull's time must not blow it up.
            value = num_bytes / max(seconds - self.latency_s, seconds / 10) / 1e9
            self.gbps = self._ewma("bandwidth", self.gbps, value)
        else:
            self.latency_s = self._ewma("latency", self.latency_s, max(0.0, seconds - num_bytes / (self.gbps * 1e9)))

    def seconds(self, num_bytes: int) -> float:
        return pull_seconds(num_bytes, self.latency_s, self.gbps)

    def _ewma(self, kind: str, old: float, value: float) -> float:
        if kind not in self._seen:
            self._seen.add(kind)
            return value
        return old + self.alpha * (value - old)


def pull_seconds(num_bytes: int, latency_s: float, gbps: float) -> float:
    """Predicted seconds of a KV pull of `num_bytes` (none for nothing to pull)."""
    return 0.0 if num_bytes <= 0 else latency_s + num_bytes / (gbps * 1e9)
