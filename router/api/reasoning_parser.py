"""Reasoning output at the edge: the per-model marker settings, the effort-to-budget mapping, and the
parser that splits a choice's text into `reasoning_content` and `content` (as vLLM's reasoning parsers do)."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.reasoning import ReasoningMarkers
from router.api.markers import MarkerScanner

Effort = Literal["low", "medium", "high"]


class ReasoningOptions(BaseModel):
    """A model that thinks between `start` and `end` (its tokenizer's strings for them). `effort_tokens`
    maps a request's `reasoning_effort` to its `max_reasoning_tokens`: by default low 512, medium 2,048 and
    high 8,192 thinking tokens."""
    model_config = ConfigDict(extra="forbid")
    start: str = Field("<think>", min_length=1)
    end: str = Field("</think>", min_length=1)
    effort_tokens: dict[Effort, int] = Field(default_factory=lambda: {"low": 512, "medium": 2048, "high": 8192})

    def markers(self, tokenizer) -> ReasoningMarkers:
        return ReasoningMarkers.from_tokenizer(tokenizer, self.start, self.end)


class ReasoningParser:
    """One choice's text, streamed in any pieces, as (reasoning, content) pieces: the text between the
    markers is reasoning, the markers themselves are dropped, and everything after the first end marker is
    content. `thinking`: the prompt opened the thinking already (the chat template wrote the start marker)."""

    def __init__(self, start: str, end: str, thinking: bool):
        self.scanner = MarkerScanner(start, end, inside=thinking, once=True)

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self.scanner.feed(text))

    def finish(self) -> tuple[str, str]:
        """What was kept back: a choice cut inside its thinking has only reasoning."""
        return self._split(self.scanner.flush())

    @staticmethod
    def _split(events: list[tuple[str, str]]) -> tuple[str, str]:
        reasoning = "".join(text for kind, text in events if kind == "in")
        return reasoning, "".join(text for kind, text in events if kind == "out")
