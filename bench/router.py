"""Router benchmark: decision latency, and prefix hit rate / load balance in simulation.

(a) Latency of one routing decision (index overlap + cost over every worker)
    with 64 workers and ~1M indexed blocks.
(b) A multi-tenant shared-prefix trace replayed on 8..256 simulated workers,
    each with a finite ref-counted LRU block cache (blocks of running sequences
    are pinned, the rest is evictable prefix cache), a FIFO prefill server and
    a decode batch that slows down as it grows. Routers compared: ours (exact
    index fed by the workers' KV events + Dynamo-style cost), round-robin,
    least-loaded, a Ray Serve PrefixCacheAffinityRouter-like prompt prefix
    tree (defaults, and with imbalanced_threshold=16), and an oracle that
    reads every cache and maximises the hit (the 100% reference for hit rate).
    Loads are read without delay by every router; real metrics lag.

Run: .venv/bin/python bench/router.py            (default, about a minute)
     .venv/bin/python bench/router.py --workers 8 --requests-per-worker 50
"""
from __future__ import annotations

import argparse
import bisect
import gc
import heapq
import itertools
import math
import random
import statistics
import sys
import time
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.hashing import block_hashes, extend_block_hashes  # noqa: E402
from engine.kv_events import KVEvent, KVEventBatch  # noqa: E402
from router.placement.index import PrefixIndex  # noqa: E402
from router.placement.pool_policy import PoolPolicy  # noqa: E402
from worker_runtime.protocol import WorkerLoad  # noqa: E402

BLOCK_SIZE = 16


# ---- (a) decision latency ---------------------------------------------------------

def bench_latency(num_workers: int = 64, blocks_per_worker: int = 16384, decisions: int = 20000,
                  seed: int = 0) -> tuple[float, float, int]:
    """p50/p99 µs of PoolPolicy.place over `num_workers` workers; returns (p50, p99, indexed blocks)."""
    rng = random.Random(seed)
    docs = [[rng.getrandbits(64) for _ in range(128)] for _ in range(256)]
    index = PrefixIndex()
    for w in range(num_workers):
        held: list[int] = []
        for doc in rng.sample(docs, 8):  # shared documents, partially cached
            held += doc[:rng.randint(16, 128)]
        held += [rng.getrandbits(64) for _ in range(blocks_per_worker - len(held))]
        index.apply(KVEventBatch(f"decode-{w}", 0, [KVEvent("stored", held)]))
    entries = sum(index.num_blocks(w) for w in index.workers())
    loads = [WorkerLoad(f"decode-{w}", queued_prefill_tokens=rng.randint(0, 4096), num_running=rng.randint(0, 32),
                        num_active_blocks=rng.randint(0, 8192), num_total_blocks=8192)
             for w in range(num_workers)]
    policy = PoolPolicy(index, BLOCK_SIZE, rng=random.Random(seed))
    requests = []
    for _ in range(decisions):
        shared = rng.choice(docs)[:rng.randint(0, 128)]
        requests.append(shared + [rng.getrandbits(64) for _ in range(128 - len(shared))])
    samples = []
    for hashes in requests:  # a 2k-token prompt: 128 blocks of 16
        t0 = time.perf_counter_ns()
        policy.place(hashes, 2048, loads)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return samples[len(samples) // 2] / 1e3, samples[int(len(samples) * 0.99)] / 1e3, entries


# ---- (b) trace ----------------------------------------------------------------------

@dataclass(slots=True)
class Request:
    arrival: float
    tokens_head: list[int]  # shared document (or empty)
    tokens_tail: array  # unique part
    hashes: list[int]
    output_tokens: int
    cached_tokens: int = 0
    est_uncached: int = 0
    prefill_done: float = 0.0

    @property
    def prompt_tokens(self) -> int:
        return len(self.tokens_head) + len(self.tokens_tail)

    def tokens(self) -> tuple[int, ...]:
        return tuple(self.tokens_head) + tuple(self.tokens_tail)


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def make_trace(num_requests: int, rate: float, seed: int, tenants: int = 16, docs_per_tenant: int = 4,
               shared_fraction: float = 0.85) -> list[Request]:
    """Tenants with a few long shared documents (Zipf popularity) plus unrelated prompts."""
    rng = random.Random(seed)
    docs = []  # (tenant, tokens, hashes)
    for t in range(tenants):
        for _ in range(docs_per_tenant):
            tokens = [rng.randrange(32000) for _ in range(rng.randint(512, 4096))]
            docs.append((f"tenant-{t}", tokens, block_hashes(tokens, BLOCK_SIZE, f"tenant-{t}")))
    doc_weights = [tw * dw for tw in zipf_weights(tenants, 1.1) for dw in zipf_weights(docs_per_tenant, 1.1)]
    cumulative = list(itertools.accumulate(doc_weights))
    trace, now = [], 0.0
    for _ in range(num_requests):
        now += rng.expovariate(rate)
        output_tokens = rng.randint(16, 256)
        if rng.random() < shared_fraction:
            salt, head, head_hashes = docs[bisect.bisect(cumulative, rng.random() * cumulative[-1])]
            tail = array("I", (rng.randrange(32000) for _ in range(rng.randint(32, 512))))
            hashes = extend_block_hashes(list(head_hashes), head + tail.tolist(), BLOCK_SIZE, salt)
        else:
            salt, head = f"tenant-{rng.randrange(tenants)}", []
            tail = array("I", (rng.randrange(32000) for _ in range(rng.randint(256, 2048))))
            hashes = block_hashes(tail, BLOCK_SIZE, salt)
        trace.append(Request(now, head, tail, hashes, output_tokens))
    return trace


# ---- (b) simulated worker -----------------------------------------------------------

@dataclass(slots=True)
class ServiceModel:
    capacity_blocks: int = 4096  # KV blocks per worker (running sequences + prefix cache)
    prefill_tokens_per_s: float = 8000.0
    prefill_overhead_s: float = 0.005
    itl_s: float = 0.02  # inter-token latency of a lone sequence
    batch_knee: int = 64  # ITL doubles every `batch_knee` running sequences


class SimWorker:
    """One worker: FIFO prefill, a decode batch, and a ref-counted LRU block cache that emits KV events."""

    def __init__(self, name: str, model: ServiceModel, index: PrefixIndex):
        self.name, self.model, self.index = name, model, index
        self.load = WorkerLoad(name, num_total_blocks=model.capacity_blocks)
        self.refs: dict[int, int] = {}  # hashed block -> number of running sequences using it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # refs == 0, oldest first
        self.unhashed = 0  # blocks in use that are not in the table (partial, new, output)
        self.queue: deque[Request] = deque()
        self.prefilling: Request | None = None
        self.seq = -1
        self.inflight = 0
        self.area = 0.0  # integral of in-flight requests over time
        self.last_t = 0.0
        self.overcommitted = 0

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self.refs:
                break
            n += 1
        return n

    def _publish(self, kind: str, hashes: list[int]) -> None:
        if hashes:
            self.seq += 1
            self.index.apply(KVEventBatch(self.name, self.seq, [KVEvent(kind, hashes)]))

    def _advance(self, now: float, delta: int) -> None:
        self.area += self.inflight * (now - self.last_t)
        self.last_t, self.inflight = now, self.inflight + delta

    def enqueue(self, req: Request, now: float) -> None:
        self._advance(now, +1)
        req.est_uncached = req.prompt_tokens - self.cached_prefix(req.hashes) * BLOCK_SIZE
        self.load.queued_prefill_tokens += req.est_uncached
        self.queue.append(req)
        self.load.num_waiting = len(self.queue)

    def start_prefill(self, now: float) -> float | None:
        """Start the next queued prefill; returns its finish time."""
        if self.prefilling is not None or not self.queue:
            return None
        req = self.prefilling = self.queue.popleft()
        self.load.num_waiting = len(self.queue)
        hit = self.cached_prefix(req.hashes)
        for h in req.hashes[:hit]:
            if self.refs[h] == 0:
                del self.evictable[h]
            self.refs[h] += 1
        req.cached_tokens = hit * BLOCK_SIZE
        uncached = req.prompt_tokens - req.cached_tokens
        self.load.queued_prefill_tokens += uncached - req.est_uncached
        req.est_uncached = uncached
        need = len(req.hashes) - hit + self._extra_blocks(req)
        removed = []
        while self._used() + need > self.model.capacity_blocks and self.evictable:
            h, _ = self.evictable.popitem(last=False)
            del self.refs[h]
            removed.append(h)
        if self._used() + need > self.model.capacity_blocks:
            self.overcommitted += 1  # the engine would preempt; the simulation lets it run
        self.unhashed += need
        self._update_usage()
        self._publish("removed", removed)
        return now + uncached / self.model.prefill_tokens_per_s + self.model.prefill_overhead_s

    def finish_prefill(self, now: float) -> tuple[Request, float]:
        """Store the prompt's new blocks and move the request to the decode batch."""
        req, self.prefilling = self.prefilling, None
        req.prefill_done = now
        self.load.queued_prefill_tokens -= req.est_uncached
        stored = []
        for h in req.hashes[req.cached_tokens // BLOCK_SIZE:]:
            if h in self.refs:
                if self.refs[h] == 0:
                    del self.evictable[h]
                self.refs[h] += 1
            else:
                self.refs[h] = 1
                stored.append(h)
            self.unhashed -= 1
        self._publish("stored", stored)
        itl = self.model.itl_s * (1 + self.load.num_running / self.model.batch_knee)
        self.load.num_running += 1
        self._update_usage()
        return req, now + req.output_tokens * itl

    def finish_decode(self, req: Request, now: float) -> None:
        self._advance(now, -1)
        for h in reversed(req.hashes):  # tail blocks become the oldest: evicted first
            self.refs[h] -= 1
            if self.refs[h] == 0:
                self.evictable[h] = None
        self.unhashed -= self._extra_blocks(req)
        self.load.num_running -= 1
        self._update_usage()

    def _used(self) -> int:
        return len(self.refs) + self.unhashed

    def _update_usage(self) -> None:
        # Like vLLM's kv_cache_usage_perc: evictable cached blocks count as free.
        self.load.num_active_blocks = self._used() - len(self.evictable)

    @staticmethod
    def _extra_blocks(req: Request) -> int:
        partial = 1 if req.prompt_tokens % BLOCK_SIZE else 0
        return partial + -(-req.output_tokens // BLOCK_SIZE)


# ---- (b) routers --------------------------------------------------------------------

class RoundRobin:
    def __init__(self, workers: list[SimWorker], rng: random.Random, index: PrefixIndex):
        self.n, self.next = len(workers), 0

    def choose(self, req: Request) -> int:
        self.next = (self.next + 1) % self.n
        return self.next


def least_inflight(workers: list[SimWorker], candidates, rng: random.Random) -> int:
    fewest = min(workers[i].inflight for i in candidates)
    return rng.choice([i for i in candidates if workers[i].inflight == fewest])


class LeastLoaded:
    def __init__(self, workers: list[SimWorker], rng: random.Random, index: PrefixIndex):
        self.workers, self.rng, self.all = workers, rng, range(len(workers))

    def choose(self, req: Request) -> int:
        return least_inflight(self.workers, self.all, self.rng)


class Ours:
    """router.placement.pool_policy.PoolPolicy over the exact index the workers' KV events feed."""

    def __init__(self, workers: list[SimWorker], rng: random.Random, index: PrefixIndex):
        self.policy = PoolPolicy(index, BLOCK_SIZE, rng=rng)
        self.loads = [w.load for w in workers]
        self.position = {w.name: i for i, w in enumerate(workers)}

    def choose(self, req: Request) -> int:
        return self.position[self.policy.place(req.hashes, req.prompt_tokens, self.loads).worker_id]


class Oracle:
    """Reads every cache exactly (the index equals them: events apply synchronously) and maximises the hit."""

    def __init__(self, workers: list[SimWorker], rng: random.Random, index: PrefixIndex):
        self.workers, self.rng, self.index = workers, rng, index
        self.names = [w.name for w in workers]

    def choose(self, req: Request) -> int:
        overlaps = list(self.index.overlap(req.hashes, self.names).values())
        best = max(overlaps)
        return least_inflight(self.workers, [i for i, o in enumerate(overlaps) if o == best], self.rng)


class _Node:
    __slots__ = ("edge", "children", "tenants")

    def __init__(self, edge: tuple[int, ...], tenants: set[int]):
        self.edge, self.children, self.tenants = edge, {}, tenants


def _common_prefix(edge: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    if tokens[start:start + len(edge)] == edge:
        return len(edge)
    lo, hi = 0, min(len(edge), len(tokens) - start)  # binary search on slice equality
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if tokens[start:start + mid] == edge[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixTree:
    """Ray Serve's PrefixCacheAffinityRouter, in its default configuration.

    A multi-tenant radix tree of the prompts routed to each replica (tokens
    stand in for characters), without eviction (do_eviction=False). When the
    replicas' queue lengths differ by more than `imbalanced_threshold`
    (default inf), power of two choices. Otherwise, match rate >= 10%: the
    replicas with the longest match; else the replicas with the fewest tree
    characters; the shortest queue among those wins.
    """
    match_rate_threshold = 0.1
    imbalanced_threshold = math.inf

    def __init__(self, workers: list[SimWorker], rng: random.Random, index: PrefixIndex):
        self.workers, self.rng = workers, rng
        self.root = _Node((), set(range(len(workers))))
        self.chars = [0] * len(workers)

    def choose(self, req: Request) -> int:
        tokens = req.tokens()
        queues = [w.inflight for w in self.workers]
        matched, tenants = self._match(tokens)
        if max(queues) - min(queues) > self.imbalanced_threshold:
            candidates = self.rng.sample(range(len(self.workers)), min(2, len(self.workers)))
        elif matched / len(tokens) >= self.match_rate_threshold:
            candidates = list(tenants)
        else:
            fewest = min(self.chars)
            candidates = [i for i, c in enumerate(self.chars) if c == fewest]
        chosen = least_inflight(self.workers, candidates, self.rng)
        self._insert(tokens, chosen)
        return chosen

    def _match(self, tokens: tuple[int, ...]) -> tuple[int, set[int]]:
        node, i = self.root, 0
        while i < len(tokens) and (child := node.children.get(tokens[i])) is not None:
            k = _common_prefix(child.edge, tokens, i)
            node, i = child, i + k
            if k < len(child.edge):
                break
        return i, node.tenants

    def _insert(self, tokens: tuple[int, ...], tenant: int) -> None:
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                node.children[tokens[i]] = _Node(tokens[i:], {tenant})
                self.chars[tenant] += len(tokens) - i
                return
            k = _common_prefix(child.edge, tokens, i)
            if k < len(child.edge):  # split the edge at the first difference
                middle = _Node(child.edge[:k], set(child.tenants))
                child.edge = child.edge[k:]
                middle.children[child.edge[0]] = child
                node.children[tokens[i]] = middle
                child = middle
            if tenant not in child.tenants:
                child.tenants.add(tenant)
                self.chars[tenant] += k
            node, i = child, i + k


class BalancedPrefixTree(PrefixTree):
    """The same router with its imbalance fallback switched on."""
    imbalanced_threshold = 16


ROUTERS = {"ours": Ours, "round-robin": RoundRobin, "least-loaded": LeastLoaded,
           "prefix-tree": PrefixTree, "prefix-tree/16": BalancedPrefixTree, "oracle": Oracle}


# ---- (b) simulation -----------------------------------------------------------------

def simulate(trace: list[Request], num_workers: int, router_name: str, model: ServiceModel,
             seed: int) -> dict[str, float]:
    index = PrefixIndex()
    workers = [SimWorker(f"worker-{i}", model, index) for i in range(num_workers)]
    router = ROUTERS[router_name](workers, random.Random(seed), index)
    heap: list[tuple[float, int, int, Request | None]] = []
    order = itertools.count()

    def start_next(w: int, now: float) -> None:
        done = workers[w].start_prefill(now)
        if done is not None:
            heapq.heappush(heap, (done, next(order), w, None))

    def run_until(t: float) -> None:
        while heap and heap[0][0] <= t:
            now, _, w, req = heapq.heappop(heap)
            if req is None:  # prefill finished
                req, done = workers[w].finish_prefill(now)
                heapq.heappush(heap, (done, next(order), w, req))
                start_next(w, now)
            else:
                workers[w].finish_decode(req, now)

    for req in trace:
        run_until(req.arrival)
        w = router.choose(req)
        workers[w].enqueue(req, req.arrival)
        start_next(w, req.arrival)
    end = trace[-1].arrival
    for worker in workers:  # load is averaged over the arrival window, not the drain
        worker._advance(end, 0)
    concurrency = [worker.area / end for worker in workers]
    run_until(math.inf)
    assert all(index.num_blocks(w.name) == len(w.refs) for w in workers), "index diverged from caches"
    ttft = sorted(req.prefill_done - req.arrival for req in trace)
    return {
        "hit": sum(r.cached_tokens for r in trace) / sum(r.prompt_tokens for r in trace),
        "imbalance": max(concurrency) / statistics.fmean(concurrency),
        "ttft_mean": statistics.fmean(ttft),
        "ttft_p99": ttft[int(len(ttft) * 0.99)],
        "overcommit": sum(w.overcommitted for w in workers) / len(trace),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="8,32,128,256")
    parser.add_argument("--requests-per-worker", type=int, default=40)
    parser.add_argument("--min-requests", type=int, default=3000)
    parser.add_argument("--rate-per-worker", type=float, default=5.0, help="arrivals per second per worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-latency", action="store_true")
    args = parser.parse_args()

    if not args.skip_latency:
        p50, p99, entries = bench_latency(seed=args.seed)
        print(f"(a) decision latency, 64 workers, {entries:,} indexed blocks, 128-block prompt: "
              f"p50 {p50:.1f} µs  p99 {p99:.1f} µs\n")
        gc.collect()

    model = ServiceModel()
    print("(b) simulation: hit = prefix-cached prompt tokens / prompt tokens; load = time-averaged "
          "in-flight requests per worker")
    print(f"{'workers':>7} {'router':<14} {'hit':>6} {'% oracle':>8} {'max/mean':>8} "
          f"{'TTFT mean':>9} {'TTFT p99':>9} {'no-room':>7} {'secs':>5}")
    for num_workers in map(int, args.workers.split(",")):
        num_requests = max(args.min_requests, args.requests_per_worker * num_workers)
        trace = make_trace(num_requests, args.rate_per_worker * num_workers, args.seed)
        results = {}
        for name in ROUTERS:
            t0 = time.perf_counter()
            results[name] = simulate(trace, num_workers, name, model, args.seed)
            results[name]["secs"] = time.perf_counter() - t0
        oracle_hit = results["oracle"]["hit"]
        for name, r in results.items():
            print(f"{num_workers:>7} {name:<14} {r['hit']:>6.1%} {r['hit'] / oracle_hit:>8.1%} "
                  f"{r['imbalance']:>8.2f} {r['ttft_mean']:>8.2f}s {r['ttft_p99']:>8.2f}s {r['overcommit']:>7.1%} {r['secs']:>5.1f}")
        print()


if __name__ == "__main__":
    main()
