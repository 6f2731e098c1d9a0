"""The reasoning budget: a model that thinks between a start and an end marker (`<think>` ... `</think>`)
stops thinking after `max_reasoning_tokens` tokens, because the engine then forces the end marker's tokens.

The budget's state is a function of the request's tokens alone (prompt and output), so a request resumed
elsewhere with the tokens it already produced (a remote prefill's first token, a migration) replays them
and continues with exactly the budget it had left. Markers are matched on token ids: a marker the model
spells with other tokens than the tokenizer's own encoding is not seen.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BEFORE, THINKING, DONE = "before", "thinking", "done"


@dataclass(slots=True, frozen=True)
class ReasoningMarkers:
    """The marker pair of one model, as text and as the token ids the tokenizer encodes it to."""
    start: str
    end: str
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer, start: str, end: str) -> ReasoningMarkers:
        """Encode the markers without special tokens (BOS) around them."""
        encode = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
        return cls(start, end, encode(start), encode(end))

    def thinking_after(self, token_ids: list[int]) -> bool:
        """Whether `token_ids` (a prompt) leave the model thinking: the last start marker comes after the
        last end marker, as in a chat template whose generation prompt opens the thinking."""
        return _last(token_ids, self.start_ids) > _last(token_ids, self.end_ids)


@dataclass(slots=True)
class ReasoningBudget:
    """One request's budget: `max_tokens` thinking tokens, counted between the markers."""
    markers: ReasoningMarkers
    max_tokens: int
    phase: str = BEFORE
    num_reasoning_tokens: int = 0
    num_forced: int = 0
    tail: list[int] = field(default_factory=list)

    @classmethod
    def replay(cls, markers: ReasoningMarkers, max_tokens: int, prompt_ids: list[int],
               output_ids: list[int]) -> ReasoningBudget:
        """The budget after `output_ids`, for a request whose prompt is `prompt_ids`."""
        budget = cls(markers, max_tokens, THINKING if markers.thinking_after(prompt_ids) else BEFORE)
        for token in output_ids:
            budget.advance(token)
        return budget

    def forced_token(self) -> int | None:
        """The token the next step must produce, or None when the model samples freely."""
        if self.phase == THINKING and self.num_reasoning_tokens >= self.max_tokens:
            return self.markers.end_ids[self.num_forced]
        return None

    def advance(self, token: int) -> None:
        """Account for the next output token."""
        if self.phase == DONE:
            return
        if self.forced_token() is not None:
            self.num_forced += 1
            if self.num_forced == len(self.markers.end_ids):
                self.phase = DONE
            return
        self.tail = (self.tail + [token])[-max(len(self.markers.start_ids), len(self.markers.end_ids)):]
        if self.phase == BEFORE:
            if _ends_with(self.tail, self.markers.start_ids):
                self.phase, self.tail = THINKING, []
            return
        self.num_reasoning_tokens += 1
        if _ends_with(self.tail, self.markers.end_ids):  # the model closed its thinking itself
            self.num_reasoning_tokens -= len(self.markers.end_ids)
            self.phase = DONE


def force_reasoning_end(logits: torch.Tensor, reqs: list) -> torch.Tensor:
    """`logits` where each row whose request spent its budget can only yield the next end-marker token (it
    becomes the row's one finite logit, so greedy and seeded sampling alike pick it, and the request's
    generator still takes its one draw per token). Its logprob then reads 0: it had probability 1."""
    forced = [(i, t) for i, req in enumerate(reqs)
              if req.reasoning is not None and (t := req.reasoning.forced_token()) is not None]
    if not forced:
        return logits
    logits = logits.clone()  # the forward's output is an inference tensor
    for i, token in forced:
        logits[i].fill_(float("-inf"))
        logits[i, token] = 0.0
    return logits


def _ends_with(tokens: list[int], suffix: tuple[int, ...]) -> bool:
    return bool(suffix) and len(tokens) >= len(suffix) and tuple(tokens[-len(suffix):]) == suffix


def _last(tokens: list[int], marker: tuple[int, ...]) -> int:
    """The end position of the last occurrence of `marker` in `tokens`, or -1."""
    n = len(marker)
    for end in range(len(tokens), n - 1, -1):
        if n and tuple(tokens[end - n:end]) == marker:
            return end
    return -1
