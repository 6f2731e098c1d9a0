"""What crosses actor boundaries: the request created once at the ingress, and what workers return."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.spec_decode.stats import SpecDecodeStats
from engine.step_costs import PRIOR_KV_PULL_GBPS, StepCosts


@dataclass(slots=True)
class GenerateRequest:
    """A tokenized request as the ingress built it; stages add timestamps to `times`."""
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    cache_salt: str | None = None
    times: dict[str, float] = field(default_factory=lambda: {"arrival": time.time()})
    # Set when the request is migrated: tokens another worker generated and the client already has.
    # The new worker computes them as context and streams only what follows.
    output_token_ids: list[int] = field(default_factory=list)

    def stamp(self, stage: str) -> None:
        self.times[stage] = time.time()

    @property
    def num_outputs(self) -> int:
        """Sequences the request streams: its n candidates (or n best beams), each under its own `index`."""
        return self.sampling_params.n

    @property
    def num_context_tokens(self) -> int:
        """Tokens a worker must hold KV for before it samples: the prompt and any migrated output."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)


@dataclass(slots=True)
class TokenDelta:
    """One step of a request's stream."""
    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    times: dict[str, float] = field(default_factory=dict)
    index: int = 0  # which of the request's n candidates it belongs to

    def extend(self, later: TokenDelta) -> None:
        """Fold in the same request's next delta (one SSE chunk may carry several tokens): tokens, text
        and logprobs add up, the rest is the later one's."""
        self.token_ids = self.token_ids + later.token_ids
        self.text += later.text
        self.logprobs = self.logprobs + later.logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens, self.error = later.num_cached_tokens, later.error
        self.times = {**self.times, **later.times}


@dataclass(slots=True)
class PrefillResult:
    """What a prefill worker hands back: the first token, and where to pull the KV from (None when done).

    Layer-wise, it comes back while the KV is still being written and before the first token exists:
    `first` is None, and the router puts the ObjectRef of the token into `first_ref` (a list, so that Ray
    hands it to the decode worker unresolved)."""
    first: TokenDelta | None
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
    kv_pull_gbps: float = PRIOR_KV_PULL_GBPS  # a decode worker's pulls
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
