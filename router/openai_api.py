"""The OpenAI API at the edge: request bodies as pydantic models, their SamplingParams, and error bodies.

Bodies are validated strictly (unknown fields and wrong types are errors, not silently ignored), and
every error names the offending field the way OpenAI's API does:
`{"error": {"message", "type", "param", "code"}}`. Range checks live in one place,
`SamplingParams.validate`; its field names are mapped back to the request's own names.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.errors import InvalidRequestError, first_field_error
from engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error the client can act on, rendered as an OpenAI-style JSON body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def bad_request(cls, message: str, param: str | None) -> APIError:
        return cls(400, message, param=param)

    @classmethod
    def from_invalid(cls, exc: InvalidRequestError, renames: dict[str, str] | None = None) -> APIError:
        """An engine validation error, with the engine's field name translated to the request's."""
        field = (renames or {}).get(exc.field, exc.field)
        message = str(exc)
        if field != exc.field and exc.field and message.startswith(exc.field):
            message = field + message[len(exc.field):]
        return cls.bad_request(message, field)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _GenerationRequest(_Body):
    """Fields both endpoints share: OpenAI's sampling fields and vLLM's extensions."""
    model: str
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    use_beam_search: bool = False
    length_penalty: float = 1.0

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                         renames: dict[str, str], best_of: int | None = None) -> SamplingParams:
        try:
            params = SamplingParams(
                n=self.n, temperature=_default(self.temperature, 1.0), top_p=_default(self.top_p, 1.0),
                top_k=_default(self.top_k, 0), min_p=_default(self.min_p, 0.0),
                presence_penalty=_default(self.presence_penalty, 0.0),
                frequency_penalty=_default(self.frequency_penalty, 0.0),
                repetition_penalty=_default(self.repetition_penalty, 1.0), logit_bias=self._logit_bias(),
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, use_beam_search=self.use_beam_search,
                best_of=best_of, length_penalty=self.length_penalty)
            params.validate(vocab_size)
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc, renames) from None
        return params

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token): bias for token, bias in self.logit_bias.items()}
        except ValueError:
            raise APIError.bad_request("logit_bias keys must be token ids (integers as strings)",
                                       "logit_bias") from None


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions."""
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]
        if not prompt:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        return list(prompt)

    def sampling_params(self, max_tokens: int | None, vocab_size: int) -> SamplingParams:
        if self.echo:
            raise APIError.bad_request("echo is not supported", "echo")
        if self.suffix:
            raise APIError.bad_request("suffix is not supported", "suffix")
        return self._sampling_params(max_tokens, self.logprobs, vocab_size, {}, self.best_of)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict:
        """The message as a chat template reads it: text parts joined, `developer` as `system`."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None, vocab_size: int) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}
        return self._sampling_params(max_tokens, logprobs, vocab_size, renames)


def parse_body(model: type[_Body], body: bytes) -> _Body:
    """Validate a JSON body; the first problem becomes a 400 naming its top-level field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = first_field_error(exc)
        if first.type == "json_invalid":
            raise APIError.bad_request(f"the body is not valid JSON: {first.message}", None) from None
        message = f"{first.path}: {first.message}" if first.path else first.message
        raise APIError.bad_request(message, first.loc[0] if first.loc else None) from None


def request_body_schema(model: type[_Body]) -> dict:
    """The OpenAPI `requestBody` of an endpoint that reads its body itself, from the model that parses it
    (references inlined: the schema stands alone in the operation)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        return [inline(value) for value in node] if isinstance(node, list) else node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}


def _default(value, default):
    return default if value is None else value


def sse(payload: BaseModel | str) -> str:
    """One server-sent event in OpenAI's framing."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def error_event(exc: APIError) -> str:
    return sse(json.dumps(exc.body()))
