"""What crosses actor boundaries: the request created once at the ingress, and what workers return (a
request's stream is the engine's own RequestOutput records, engine/outputs.py); and the load record the
router derives from a worker's reported stats."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import Enum

from engine.lora_request import LoRARequest
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams, candidate_id, candidate_seed
from engine.spec_decode.stats import SpecDecodeStats
from engine.step_costs import PRIOR_KV_PULL_GBPS, PRIOR_KV_PULL_LATENCY_S, StepCosts
from engine.timeline import RequestTimeline


class DispatchPath(str, Enum):
    """How a placed request runs across its workers: decided once, when the router places it
    (router/placement/routing.py `dispatch_path`), and followed by the dispatcher and both workers."""
    LOCAL = "local"  # the decode worker prefills the prompt itself
    # Decode starts with the prefill: it reserves the prompt's blocks meanwhile and pulls when the prefill
    # worker's result (first token and KV handle) arrives.
    REMOTE = "remote"
    # The prefill worker leases the KV before the first token exists; decode pulls while it still computes.
    LAYERWISE = "layerwise"
    # Decode starts from the prefill worker's first token: a group of candidates (decode forks the others
    # from it) or a single-token request (which never reaches decode).
    SEQUENTIAL = "sequential"


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Where a decode worker pulls the first `num_blocks` prompt blocks from: the worker `worker_id` (its actor)."""
    worker_id: str
    actor: object
    num_blocks: int


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized request as the ingress built it; stages add timestamps to its `timeline`.

    `request_id` names this sequence group on the workers (unique per prompt and candidate); the HTTP
    request's id, which the client may choose, is `timeline.request_id` (by default the same)."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    timeline: RequestTimeline | None = None
    # Set when the request is migrated: tokens another worker generated and the client already has.
    # The new worker computes them as context and streams only what follows.
    output_token_ids: list[int] = field(default_factory=list)
    # Where the ingress placed it, in order: {"prefill": worker id or None, "decode": worker id} per
    # placement (more than one after a re-route or a migration). Workers ignore it.
    placements: list[dict] = field(default_factory=list)
    dispatch: DispatchPath = DispatchPath.LOCAL  # set by the router's placement; workers follow it
    priority: int = 0  # vLLM's meaning: lower is scheduled first (prefill and decode queues) and preempted last
    # Its tenant was below its share when the ingress let it on (router/api/flow_control.py): it goes ahead of the
    # prompts of its priority queued on workers, and a full prefill queue does not hold it back.
    ahead: bool = False
    # A peer holding more of the prompt's prefix than the decode worker: it pulls those blocks from there first
    # (router/placement/worker_view.py peer_prefix). Set per placement.
    prefix_source: PrefixSource | None = None
    # The LoRA adapter it runs with (engine/lora.py), named by the request's `model`; None: the base model.
    # Part of its prefix-block hashes (`lora_key`), on the router and on every worker.
    lora: LoRARequest | None = None

    def __post_init__(self):
        if self.timeline is None:
            self.timeline = RequestTimeline(self.request_id)

    @property
    def lora_key(self) -> str | None:
        return None if self.lora is None else self.lora.key

    @property
    def queue_priority(self) -> float:
        """Its place in an engine's waiting queue: its priority, or just ahead of that band's when `ahead`."""
        return self.priority - 0.5 if self.ahead else self.priority

    def stamp(self, stage: str, at: float | None = None) -> None:
        self.timeline.stamp(stage, at)

    @property
    def times(self) -> dict[str, float]:
        return self.timeline.times

    @property
    def num_outputs(self) -> int:
        """Sequences the request streams: its n candidates (or n best beams), each under its own `index`."""
        return self.sampling_params.n

    def candidate_params(self, index: int) -> SamplingParams:
        """The sampling params of candidate `index` of the request's n, run alone: its own seed
        (candidate_seed), as on a prefill, a decode or a migration target alike."""
        params = self.sampling_params
        return replace(params, n=1, seed=candidate_seed(params.seed, index))

    def candidate(self, index: int) -> GenerateRequest:
        """Candidate `index` of the request as a request of its own (placed, run and migrated alone): its own
        id and params, the same prompt, context and salt, a copy of the timeline."""
        return GenerateRequest(candidate_id(self.request_id, index), self.prompt_token_ids,
                               self.candidate_params(index), self.cache_salt, self.timeline.copy(),
                               priority=self.priority, ahead=self.ahead, lora=self.lora)

    @property
    def num_context_tokens(self) -> int:
        """Tokens a worker must hold KV for before it samples: the prompt and any migrated output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# The last item of a request on a decode worker's feed (DecodeWorker.open_feed, router/placement/feeds.py) when
# it is not an output: the request ended, or failed (its error is fetched with DecodeWorker.feed_error).
FEED_END, FEED_FAILED = "end", "failed"


@dataclass(slots=True)
class PrefillResult:
    """What a prefill worker hands back: the first token, and where to pull the KV from (None when done).

    Layer-wise, it comes back while the KV is still being written and before the first token exists:
    `first` is None, and the router puts the ObjectRef of the token into `first_ref` (a list, so that Ray
    hands it to the decode worker unresolved)."""
    first: RequestOutput | None
    kv_handle: object | None
    first_ref: list = field(default_factory=list)


@dataclass(slots=True)
class WorkerStats:
    """A worker's load and cache state, as the router and metrics read it."""
    worker_id: str
    pool: str
    num_waiting: int = 0
    num_running: int = 0
    queued_prefill_tokens: int = 0
    num_active_blocks: int = 0
    num_total_blocks: int = 1
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    prefill_yield_chunks: int = 0  # prompt chunks cut to a yield slice for a more urgent prompt (Scheduler)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    draining: bool = False
    # What the worker measures, for placement against the SLOs (engine/step_costs.py).
    step_costs: StepCosts = field(default_factory=StepCosts)
    kv_bytes_per_token: int = 0
    kv_pull_gbps: float = PRIOR_KV_PULL_GBPS  # a decode worker's pulls: bandwidth and fixed cost
    kv_pull_latency_s: float = PRIOR_KV_PULL_LATENCY_S
    spec_decode: SpecDecodeStats | None = None  # None until a request speculated on this worker
    # A busy CPU lender's pauses between steps for a prefill on its node (cpu.lend_busy_ms), their seconds,
    # and its steps begun before the borrower had let go of its cores (should stay 0).
    cpu_busy_lends: int = 0
    cpu_busy_lent_s: float = 0.0
    cpu_reclaim_timeouts: int = 0
    cpu_kernel_fallbacks: int = 0  # C kernels of the CPU path that failed to build: torch does their work (stay 0)
    tensor_parallel_size: int = 1  # ranks of the logical worker (engine/parallel/)
    tp_ranks_alive: int = 1  # of them, running (a rank's death fails the worker: its ping raises)
    tp_shm_too_large: int = 0  # CPU ranks' collectives too large for their shared memory: over Gloo (stay 0)
    kv_tiers: dict | None = None  # the KV tiers below the cache (engine/kv_tiers.py KVTiers.stats); None: none
    serves_prefixes: bool = False  # leases its cached prefix blocks to peers (EngineServer.lease_prefix)
    pulls_prefixes: bool = False  # pulls prefix blocks from a peer when a request names one (prefix_source)
    lora: dict | None = None  # its LoRA slots and counters (engine/lora.py LoRAManager.summary); None: no LoRA

    @property
    def kv_usage(self) -> float:
        return self.num_active_blocks / self.num_total_blocks


PRIOR_LORA_LOAD_S = 0.005  # copying an adapter into a slot before a worker measured one (a small adapter)


def lora_load_seconds(lora: dict | None) -> float:
    """A worker's mean seconds to load an adapter into a slot (LoRAManager.summary), or the prior."""
    if not lora or not lora["loads"]:
        return PRIOR_LORA_LOAD_S
    return lora["load_seconds"] / lora["loads"]


PRIOR_PROMOTE_GBPS = 2.0  # a tier's copy back into the cache before one was measured (a memcpy; H2D on CUDA)
# Per tier, before its first promotion: host memory is a memcpy, the disk tier a read of a memory-mapped file
# (page cache or device), the shared store a network round trip per run of blocks.
PRIOR_TIER_GBPS = {"host": PRIOR_PROMOTE_GBPS, "disk": 0.5, "remote": 0.1}


def promote_seconds(tiers: dict | None) -> float:
    """Seconds a worker spends bringing one block back from its tiers (KVTiers.stats): measured over its
    promotions so far, else a prior from the block's bytes; 0 without tiers."""
    if not tiers:
        return 0.0
    hits = sum(t["hits"] for t in tiers["tiers"].values())
    if hits:
        return sum(t["promote_seconds"] for t in tiers["tiers"].values()) / hits
    return tiers["bytes_per_block"] / (PRIOR_PROMOTE_GBPS * 1e9)


def promote_seconds_by_tier(tiers: dict | None) -> dict[str, float]:
    """Per tier below a worker's cache (KVTiers.stats), the seconds it spends bringing one block back from it:
    measured over that tier's promotions so far, else a prior from the block's bytes at the tier's speed."""
    if not tiers:
        return {}
    return {name: t["promote_seconds"] / t["hits"] if t["hits"]
            else tiers["bytes_per_block"] / (PRIOR_TIER_GBPS.get(name, PRIOR_PROMOTE_GBPS) * 1e9)
            for name, t in tiers["tiers"].items()}


@dataclass(slots=True)
class WorkerLoad:
    """One worker's load as the router places against it: derived from its last `WorkerStats`
    (`reported`), plus what the router adds (requests it routed there since, lent cores it sees)."""
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
    # A decode worker: the streams the router expects to join it per second (its share of the recent
    # arrival rate), which a long local prefill will run beside.
    arrivals_per_s: float = 0.0
    # What bringing one block back from a tier below its cache costs it (measured; a prior until then): on
    # average, and per tier (host, disk, remote).
    promote_s_per_block: float = 0.0
    promote_s_by_tier: dict[str, float] = field(default_factory=dict)
    serves_prefixes: bool = False  # WorkerStats.serves_prefixes, pulls_prefixes
    pulls_prefixes: bool = False
    lora_keys: frozenset[str] = frozenset()  # the adapters its LoRA slots hold (LoRARequest.key)
    lora_load_s: float = PRIOR_LORA_LOAD_S  # its measured seconds to load an adapter into a slot

    @classmethod
    def reported(cls, worker_id: str, stats: WorkerStats | None, healthy: bool) -> WorkerLoad:
        """The load `stats` report (None before the first report: idle, at prior costs); `healthy` is the
        router's word on whether the worker takes requests."""
        if stats is None:
            return cls(worker_id, healthy=healthy)
        return cls(worker_id, queued_prefill_tokens=stats.queued_prefill_tokens, num_waiting=stats.num_waiting,
                   num_running=stats.num_running, num_active_blocks=stats.num_active_blocks,
                   num_total_blocks=stats.num_total_blocks, healthy=healthy, step_costs=stats.step_costs,
                   kv_bytes_per_token=stats.kv_bytes_per_token, kv_pull_gbps=stats.kv_pull_gbps,
                   kv_pull_latency_s=stats.kv_pull_latency_s, promote_s_per_block=promote_seconds(stats.kv_tiers),
                   promote_s_by_tier=promote_seconds_by_tier(stats.kv_tiers),
                   serves_prefixes=stats.serves_prefixes, pulls_prefixes=stats.pulls_prefixes,
                   lora_keys=frozenset(stats.lora["keys"]) if stats.lora else frozenset(),
                   lora_load_s=lora_load_seconds(stats.lora))

    def promote_s(self, blocks_by_tier: dict[str, int]) -> float:
        """What bringing back these blocks from its tiers costs it: each tier's at that tier's speed."""
        return sum(n * self.promote_s_by_tier.get(tier, self.promote_s_per_block) for tier, n in blocks_by_tier.items())

    def lora_miss_s(self, lora_key: str | None) -> float:
        """What running adapter `lora_key` here costs before its first step: nothing when a slot holds it."""
        return 0.0 if lora_key is None or lora_key in self.lora_keys else self.lora_load_s

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
class KVEventsReply:
    """Answer to a router's poll: new batches, or a full snapshot when it fell behind."""
    worker_id: str
    batches: list = field(default_factory=list)
    snapshot: list[int] | None = None
    seq: int = 0
    tiers: dict[str, list[int]] | None = None  # with a snapshot: per tier below the device cache, its blocks
