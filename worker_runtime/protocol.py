"""What crosses actor boundaries: the request created once at the ingress, and what workers return (a
request's stream is the engine's own RequestOutput records, engine/outputs.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.spec_decode.stats import SpecDecodeStats
from engine.step_costs import PRIOR_KV_PULL_GBPS, PRIOR_KV_PULL_LATENCY_S, StepCosts
from engine.timeline import RequestTimeline


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

    def __post_init__(self):
        if self.timeline is None:
            self.timeline = RequestTimeline(self.request_id)

    def stamp(self, stage: str, at: float | None = None) -> None:
        self.timeline.stamp(stage, at)

    @property
    def times(self) -> dict[str, float]:
        return self.timeline.times

    @property
    def num_outputs(self) -> int:
        """Sequences the request streams: its n candidates (or n best beams), each under its own `index`."""
        return self.sampling_params.n

    @property
    def num_context_tokens(self) -> int:
        """Tokens a worker must hold KV for before it samples: the prompt and any migrated output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


# The last item of a request on a decode worker's feed (DecodeWorker.open_feed, router/feeds.py) when it is
# not an output: the request ended, or failed (its error is fetched with DecodeWorker.feed_error).
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
    prompt_tokens: int = 0
    generation_tokens: int = 0
    draining: bool = False
    # What the worker measures, for placement against the SLOs (engine/step_costs.py).
    step_costs: StepCosts = field(default_factory=StepCosts)
    kv_bytes_per_token: int = 0
    kv_pull_gbps: float = PRIOR_KV_PULL_GBPS  # a decode worker's pulls: bandwidth and fixed cost
    kv_pull_latency_s: float = PRIOR_KV_PULL_LATENCY_S
    spec_decode: SpecDecodeStats | None = None  # None until a request speculated on this worker

    @property
    def kv_usage(self) -> float:
        return self.num_active_blocks / self.num_total_blocks


@dataclass(slots=True)
class KVEventsReply:
    """Answer to a router's poll: new batches, or a full snapshot when it fell behind."""
    worker_id: str
    batches: list = field(default_factory=list)
    snapshot: list[int] | None = None
    seq: int = 0
