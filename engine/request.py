"""Per-request state carried through scheduling, model runs and output processing."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.reasoning import ReasoningBudget
from engine.sampling_params import SamplingParams, candidate_id
from engine.timeline import RequestTimeline

if TYPE_CHECKING:
    import torch

    from engine.lora_request import LoRARequest
    from engine.spec_decode.state import SpecState
    from engine.structured import StructuredOutputRequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    cache_salt: str | None = None
    generator: torch.Generator | None = None
    all_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    # leading blocks given back because no layer's sliding window reaches them any more (BlockManager
    # .release_outside_window); their block_table entries stay, read by no query
    num_released_blocks: int = 0
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    output_logprobs: list[dict] = field(default_factory=list)
    do_remote_decode: bool = False
    reasoning: ReasoningBudget | None = None  # set by OutputProcessor.add when max_reasoning_tokens is given
    structured_output_request: StructuredOutputRequest | None = None  # its grammar state, when constrained
    # Where its time goes (engine/timeline.py): a served request's is its GenerateRequest's, which the worker
    # stamps around the engine; the engine stamps its first scheduling and counts its prompt's forwards.
    # Candidates and beams of one prompt share it.
    timeline: RequestTimeline | None = None
    scheduled: bool = False  # admitted by this engine's scheduler at least once
    index: int = 0  # which of its prompt's n candidates (or returned beams) it is
    # The other candidates of its prompt: forked from it once its prompt is computed (Forking.fork).
    pending_forks: list["Request"] = field(default_factory=list)
    beam_search: object | None = None  # the BeamSearch this request is a beam of
    cumulative_logprob: float = 0.0  # of its output tokens, kept for beams
    priority: float = 0  # vLLM's meaning: lower is scheduled first and preempted last (x.5: ahead of band x+1)
    # The priority it came with and when it was queued: while it waits, `priority` improves by one band per
    # EngineConfig.priority_aging_s (Scheduler._age_waiting).
    base_priority: float | None = None
    queued_at: float = 0.0
    spec: SpecState | None = None  # its speculative decoding, when it speculates (engine/spec_decode/)
    spec_token_ids: list[int] = field(default_factory=list)  # this step's draft, verified by the forward
    lora: LoRARequest | None = None  # the adapter it runs with (engine/lora.py); None: the base model
    lora_slot: int = -1  # the device slot holding it while the request runs

    def __post_init__(self):
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.timeline is None:
            self.timeline = RequestTimeline(self.request_id)

    def take_state(self, parent: Request) -> None:
        """Continue from `parent`'s tokens and progress (a fork); the blocks are the block manager's."""
        self.all_token_ids = list(parent.all_token_ids)
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_tokens = parent.num_cached_tokens
        self.cumulative_logprob = parent.cumulative_logprob
        self.scheduled = parent.scheduled

    def take_pending(self, parent: Request) -> Request:
        """Stand in for `parent` (which will not run) as the candidate the others fork from; returns self."""
        self.pending_forks = [c for c in parent.pending_forks if c is not self]
        parent.pending_forks = []
        return self

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


def output_ids(req: Request) -> list[str]:
    """The request ids `req`'s outputs come under: its own and its pending candidates', or a search's n."""
    if req.beam_search is not None:
        return [candidate_id(req.beam_search.request_id, i) for i in range(req.beam_search.n)]
    return [req.request_id, *(c.request_id for c in req.pending_forks)]
