"""What the engine hands back: incremental deltas from step(), whole results from generate()."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestOutput:
    """One request's progress in one step (`new_*`) and so far (`token_ids`, `text`)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[dict] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    kv_transfer_params: dict | None = None
    index: int = 0  # the candidate (or beam) of its prompt
    cumulative_logprob: float | None = None  # beam search's score before the length penalty

    def extend(self, later: RequestOutput) -> None:
        """Fold in the same request's next output, so that one item carries both (a consumer that fell
        behind gets what accumulated in one piece): the new tokens, text and logprobs add up, the rest
        is the later one's."""
        self.new_token_ids = self.new_token_ids + later.new_token_ids
        self.new_text += later.new_text
        self.new_logprobs = self.new_logprobs + later.new_logprobs
        self.token_ids, self.text, self.finished = later.token_ids, later.text, later.finished
        self.finish_reason, self.stop_reason, self.error = later.finish_reason, later.stop_reason, later.error
        self.num_prompt_tokens, self.num_cached_tokens = later.num_prompt_tokens, later.num_cached_tokens
        self.kv_transfer_params = later.kv_transfer_params


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
