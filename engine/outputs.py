"""What the engine hands back: one record per step of a request (what Engine.step returns and what a worker
streams to the router, as is), and whole results from generate()."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.timeline import RequestTimeline


@dataclass(slots=True)
class RequestOutput:
    """One request's new tokens in one step (a delta: `new_*` hold only what this step added; a consumer
    that wants the whole output adds them up, as Engine.generate and the ingress do)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None  # set when the prompt's KV stays for a decode worker to pull
    index: int = 0  # the candidate (or beam) of its prompt
    cumulative_logprob: float | None = None  # beam search's score before the length penalty
    # The worker's copy of the request's timeline, on a prefill worker's first token and on the last output.
    timeline: RequestTimeline | None = None

    @property
    def times(self) -> dict[str, float]:
        return self.timeline.times if self.timeline is not None else {}

    def extend(self, later: RequestOutput) -> None:
        """Fold in the same request's next output, so that one item carries both (a consumer that fell
        behind gets what accumulated in one piece): the new tokens, text and logprobs add up, the rest
        is the later one's."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        self.new_logprobs = self.new_logprobs + later.new_logprobs
        self.finished, self.finish_reason, self.stop_reason = later.finished, later.finish_reason, later.stop_reason
        self.num_prompt_tokens = later.num_prompt_tokens or self.num_prompt_tokens
        self.num_cached_tokens, self.error = later.num_cached_tokens, later.error
        self.kv_transfer_params = later.kv_transfer_params
        self.timeline = later.timeline or self.timeline


@dataclass(slots=True)
class CompletionOutput:
    """The whole result of one prompt from Engine.generate; `candidates` holds all n when n > 1."""
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    cumulative_logprob: float | None = None
    candidates: list["CompletionOutput"] = field(default_factory=list)
