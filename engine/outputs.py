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
    candidates: list["CompletionOutput"] = field(default_factory=list)
