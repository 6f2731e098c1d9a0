"""One chat choice's output as the client sees it: its text split into reasoning, content and tool calls,
streamed piece by piece or read whole (the same code, so both agree), and the finish reason that follows.

Order: the reasoning parser takes the thinking off the front, the tool parser reads the rest. A choice
that made tool calls and stopped by itself finishes with `tool_calls` (`stop` for a named function, as
OpenAI answers); one cut by max_tokens keeps `length`, with only the calls that completed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from router.api.openai_api import APIError
from router.api.openai_responses import ToolCall
from router.api.openai_tools import ToolUse
from router.api.reasoning_parser import ReasoningOptions, ReasoningParser
from router.api.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser


@dataclass(slots=True)
class ChatPiece:
    """What one stretch of output adds: `tool_calls` are complete calls, `first_index` the index of the
    first of them among the choice's calls."""
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    first_index: int = 0

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class ChatOutput:
    """`reasoning` and `tools` are the choice's parsers (None: not in use); `tool_mode` is the request's
    tool use (auto, required, named, or None)."""

    def __init__(self, reasoning: ReasoningParser | None, tools, tool_mode: str | None):
        self.reasoning, self.tools, self.tool_mode = reasoning, tools, tool_mode
        self.whole = ChatPiece()
        self.finish_reason: str | None = None

    def feed(self, text: str) -> ChatPiece:
        reasoning, content = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._add(reasoning, content, finished=False)

    def finish(self, text: str, finish_reason: str | None) -> ChatPiece:
        """The last text, then everything kept back; sets `finish_reason`."""
        piece = self.feed(text)
        reasoning, content = self.reasoning.finish() if self.reasoning is not None else ("", "")
        last = self._add(reasoning, content, finished=True)
        piece.reasoning, piece.content = piece.reasoning + last.reasoning, piece.content + last.content
        piece.tool_calls += last.tool_calls
        called = self.whole.tool_calls and self.tool_mode != "named"
        self.finish_reason = "tool_calls" if finish_reason == "stop" and called else finish_reason
        return piece

    def _add(self, reasoning: str, content: str, finished: bool) -> ChatPiece:
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if finished:
                tail, more = self.tools.finish()
                content, calls = content + tail, calls + more
        piece = ChatPiece(reasoning, content, calls, len(self.whole.tool_calls))
        self.whole.reasoning += reasoning
        self.whole.content += content
        self.whole.tool_calls += calls
        return piece


class ChatParsing:
    """The served model's output formats: its reasoning markers (None: it does not think between
    markers) and the `tool_call_parser` for `tool_choice: auto` (None: auto is refused)."""

    def __init__(self, tokenizer, reasoning: ReasoningOptions | None, tool_call_parser: str | None):
        self.options = reasoning
        self.markers = reasoning.markers(tokenizer) if reasoning is not None else None
        self.tool_call_parser = tool_call_parser

    def reasoning_budget(self, req) -> int | None:
        """A chat request's max_reasoning_tokens: given, or from its reasoning_effort."""
        field = "max_reasoning_tokens" if req.max_reasoning_tokens is not None else "reasoning_effort"
        if req.max_reasoning_tokens is None and req.reasoning_effort is None:
            return None
        if self.options is None:
            raise APIError.bad_request(f"{field} needs a model that thinks between markers; this server has no "
                                       f"`reasoning` configured for its model", field)
        if req.max_reasoning_tokens is not None and req.reasoning_effort is not None:
            raise APIError.bad_request("give max_reasoning_tokens or reasoning_effort, not both",
                                       "reasoning_effort")
        if req.max_reasoning_tokens is not None:
            return req.max_reasoning_tokens
        return self.options.effort_tokens[req.reasoning_effort]

    def check_tools(self, tools: ToolUse | None) -> None:
        if tools is not None and tools.mode == "auto" and self.tool_call_parser is None:
            raise APIError.bad_request('tool_choice "auto" needs a tool_call_parser configured on the server; '
                                       'use "required", a named function or "none"', "tool_choice")

    def output(self, tools: ToolUse | None, prompt_ids: list[int]) -> ChatOutput:
        """A fresh ChatOutput for one choice of a request with these tools and this prompt. A constrained
        tool choice's output is the call's JSON from its first token: no thinking to split off."""
        mode = tools.mode if tools is not None else None
        reasoning = None
        if self.markers is not None and mode not in ("required", "named"):
            reasoning = ReasoningParser(self.markers.start, self.markers.end, self.markers.thinking_after(prompt_ids))
        parser = {"auto": lambda: TOOL_PARSERS[self.tool_call_parser](), "required": RequiredToolParser,
                  "named": lambda: NamedToolParser(tools.name)}.get(mode)
        return ChatOutput(reasoning, parser() if parser else None, mode)
