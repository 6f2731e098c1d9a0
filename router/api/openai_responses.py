"""OpenAI response bodies and stream chunks for completions and chat, built from token deltas.

`Choice` accumulates one candidate's deltas; the formatters turn choices (whole, or one delta at a
time when streaming) into the exact shapes the official `openai` client parses.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from engine.outputs import RequestOutput


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = []


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = []


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tandem"
    max_model_len: int
    revision: str | None = None  # "sha256:..." of the weights (engine.model_loader.model_revision)
    root: str | None = None  # a LoRA adapter's directory (vLLM's ModelCard.root)
    parent: str | None = None  # a LoRA adapter's base model (vLLM's ModelCard.parent)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


@dataclass(slots=True)
class Choice:
    """One candidate's output so far. `prompt` indexes the prompt it answers (for usage)."""
    index: int
    prompt: int
    text: str = ""
    num_tokens: int = 0
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int | None = None
    error: str | None = None  # why it ended with finish_reason "error"
    token_ids: list[int] = field(default_factory=list)
    first_token_time: float | None = None  # epoch seconds, as the ingress received them
    finish_time: float | None = None

    def add(self, delta: RequestOutput) -> None:
        self.text += delta.new_text
        if delta.new_token_ids:
            self.token_ids.extend(delta.new_token_ids)
            self.first_token_time = self.first_token_time or time.time()
        self.num_tokens += len(delta.new_token_ids)
        self.logprobs.extend(delta.new_logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens or self.num_prompt_tokens
        if self.num_cached_tokens is None:  # the worker that prefilled says what it reused
            self.num_cached_tokens = delta.num_cached_tokens
        if delta.finished:
            self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error
            self.finish_time = time.time()


def usage(choices: list[Choice], prompt_lengths: list[int]) -> Usage:
    """Each prompt counts once however many candidates it has; cached tokens as its first candidate saw."""
    completion = sum(c.num_tokens for c in choices)
    prompt = sum(prompt_lengths)
    cached = {}
    for c in sorted(choices, key=lambda c: c.index):
        cached.setdefault(c.prompt, c.num_cached_tokens or 0)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


class Formatter:
    """Shared by both endpoints: response ids, token strings for logprobs."""

    prefix = "cmpl"

    def __init__(self, model: str, tokenizer):
        self.model = model
        self.tokenizer = tokenizer
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class CompletionFormatter(Formatter):
    """/v1/completions bodies and chunks."""

    def response(self, choices: list[Choice], usage_: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage_, choices=[
            CompletionChoice(index=c.index, text=c.text, logprobs=self._logprobs(c.logprobs, 0),
                             finish_reason=c.finish_reason, stop_reason=c.stop_reason) for c in choices])

    def chunk(self, choice: Choice, delta: RequestOutput, offset: int) -> CompletionResponse | None:
        """`offset`: characters of this choice already streamed (for logprobs' text_offset)."""
        if not (delta.new_text or delta.finished or delta.new_logprobs):
            return None
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[
            CompletionChoice(index=choice.index, text=delta.new_text,
                             logprobs=self._logprobs(delta.new_logprobs, offset),
                             finish_reason=delta.finish_reason if delta.finished else None,
                             stop_reason=delta.stop_reason if delta.finished else None)])

    def first_chunk(self, choice: Choice) -> None:
        return None

    def usage_chunk(self, usage_: Usage) -> CompletionResponse:
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[], usage=usage_)

    def _logprobs(self, entries: list[dict], offset: int) -> CompletionLogprobs | None:
        if not entries:
            return None
        out = CompletionLogprobs()
        for entry in entries:
            token = self.token_str(entry["token_id"])
            out.tokens.append(token)
            out.token_logprobs.append(entry["logprob"])
            out.top_logprobs.append({self.token_str(t): lp for t, lp in entry["top_logprobs"].items()})
            out.text_offset.append(offset)
            offset += len(token)
        return out


class ChatFormatter(Formatter):
    """/v1/chat/completions bodies and chunks. `new_output()` makes a choice's ChatOutput
    (router/api/chat_output.py), which splits its text into reasoning, content and tool calls."""

    prefix = "chatcmpl"

    def __init__(self, model: str, tokenizer, new_output):
        super().__init__(model, tokenizer)
        self.new_output = new_output
        self.outputs = {}

    def response(self, choices: list[Choice], usage_: Usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, usage=usage_,
                                      choices=[self._choice(c) for c in choices])

    def _choice(self, c: Choice) -> ChatChoice:
        out = self.new_output()
        out.finish(c.text, c.finish_reason)
        whole = out.whole
        message = ChatMessageOut(content=whole.content or (None if whole.tool_calls else ""),
                                 reasoning_content=whole.reasoning or None, tool_calls=whole.tool_calls)
        return ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c.logprobs),
                          finish_reason=out.finish_reason, stop_reason=c.stop_reason)

    def first_chunk(self, choice: Choice) -> ChatCompletionChunk:
        """OpenAI opens each choice's stream with the role."""
        return self._chunk(ChatChunkChoice(index=choice.index, delta=ChatDelta(role="assistant", content="")))

    def chunk(self, choice: Choice, delta: RequestOutput, offset: int) -> ChatCompletionChunk | None:
        out = self.outputs.get(choice.index)
        if out is None:
            out = self.outputs[choice.index] = self.new_output()
        piece = out.finish(delta.new_text, delta.finish_reason) if delta.finished else out.feed(delta.new_text)
        if not (piece or delta.finished or delta.new_logprobs):
            return None
        calls = [DeltaToolCall(index=piece.first_index + i, id=call.id, type="function",
                               function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))
                 for i, call in enumerate(piece.tool_calls)]
        chat_delta = ChatDelta(content=piece.content or None, reasoning_content=piece.reasoning or None,
                               tool_calls=calls or None)
        return self._chunk(ChatChunkChoice(
            index=choice.index, delta=chat_delta,
            logprobs=self._logprobs(delta.new_logprobs), finish_reason=out.finish_reason if delta.finished else None,
            stop_reason=delta.stop_reason if delta.finished else None))

    def usage_chunk(self, usage_: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage_)

    def _chunk(self, choice: ChatChunkChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def _logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        if not entries:
            return None
        return ChatLogprobs(content=[
            TokenLogprob(**self._top(entry["token_id"], entry["logprob"]),
                         top_logprobs=[TopLogprob(**self._top(t, lp)) for t, lp in entry["top_logprobs"].items()])
            for entry in entries])

    def _top(self, token_id: int, logprob: float) -> dict:
        token = self.token_str(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
