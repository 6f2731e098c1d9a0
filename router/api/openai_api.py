"""The OpenAI API at the edge: request bodies as pydantic models, their SamplingParams, and error bodies.

Bodies are validated strictly (unknown fields and wrong types are errors, not silently ignored), and
every error names the offending field the way OpenAI's API does:
`{"error": {"message", "type", "param", "code"}}`. Range checks live in one place,
`SamplingParams.validate`; its field names are mapped back to the request's own names.
"""
from __future__ import annotations

import inspect
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError, first_field_error
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.structured import validate_structured
from router.api.openai_tools import ChatCompletionToolsParam, ToolChoice, ToolUse, tool_use
from router.api.reasoning_parser import Effort


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


# Fields OpenAI's API or vLLM's define that change nothing this server outputs: accepted (typed) and
# logged at debug, as vLLM does, so clients that send them work unchanged.
IGNORED_FIELDS = ("metadata", "store", "service_tier", "user", "prompt_cache_key", "safety_identifier",
                  "request_id", "parallel_tool_calls")
# Fields that would change the output and that this server does not implement: a 400 saying so, never
# an answer that silently differs from what was asked.
UNSUPPORTED_FIELDS = ("audio", "modalities", "prediction", "web_search_options", "functions", "function_call",
                      "verbosity", "prompt_logprobs", "allowed_token_ids", "bad_words", "documents",
                      "return_tokens_as_token_ids", "mm_processor_kwargs", "chat_template", "logits_processors",
                      "vllm_xargs", "kv_transfer_params")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage so far in every chunk, as vLLM sends it


class JSONSchemaFormat(_Body):
    """OpenAI's `response_format.json_schema`; `strict` is accepted, the schema is always enforced."""
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsBody(_Body):
    """vLLM's `structured_outputs` object: exactly one constraint."""
    json_: dict | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}  # vLLM's older names


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep only the prompt's last k tokens
    speculative: StrictBool | None = None  # speculative decoding: null follows the decode pool's default
    spaces_between_special_tokens: Literal[True] = True
    # accepted, not acted on (IGNORED_FIELDS)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's meaning: lower runs first (the ingress queue, prefill and decode queues, preemption last)
    priority: int = 0
    request_id: str | None = None

    def ignored_fields(self) -> list[str]:
        """The IGNORED_FIELDS this request set (for a debug log line)."""
        return sorted(self.model_fields_set.intersection(IGNORED_FIELDS))

    @property
    def continuous_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None, vocab_size: int,
                         renames: dict[str, str], best_of: int | None = None,
                         controls: dict | None = None) -> SamplingParams:
        """The request's SamplingParams, built and checked once: its own fields, then `controls` (fields the
        endpoint sets itself: a tool_choice grammar, a reasoning budget; None values are not set), then the
        token ids against the served model's vocabulary."""
        controls = {name: value for name, value in (controls or {}).items() if value is not None}
        try:
            structured, _ = self.structured()
            if "structured" in controls and structured is not None:
                raise APIError.bad_request('tool_choice "required" or a named function constrains the output '
                                           "itself; it cannot be combined with response_format or "
                                           "structured_outputs", "tool_choice")
            fields = dict(
                n=self.n, temperature=_default(self.temperature, 1.0), top_p=_default(self.top_p, 1.0),
                top_k=_default(self.top_k, 0), min_p=_default(self.min_p, 0.0),
                presence_penalty=_default(self.presence_penalty, 0.0),
                frequency_penalty=_default(self.frequency_penalty, 0.0),
                repetition_penalty=_default(self.repetition_penalty, 1.0), logit_bias=self._logit_bias(),
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop or [],
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens, structured=structured,
                use_beam_search=self.use_beam_search, best_of=best_of, length_penalty=self.length_penalty,
                speculative=self.speculative)
            params = SamplingParams(**{**fields, **controls})
            params.check_vocab(vocab_size)
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc, renames) from None
        return params

    def structured(self) -> tuple[StructuredOutputs | None, str | None]:
        """The output constraint and the field that gave it; more than one is a 400 naming the second."""
        found: list[tuple[str, StructuredOutputs]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputs(json_object=True)))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError.bad_request("response_format of type json_schema needs json_schema.schema",
                                           "response_format")
            found.append(("response_format", _constraint("json", fmt.json_schema.schema_)))
        if (so := self.structured_outputs) is not None:
            given = {kind: value for kind, value in (("json", so.json_), ("json_object", so.json_object or None),
                                                     ("regex", so.regex), ("choice", so.choice),
                                                     ("grammar", so.grammar)) if value is not None}
            if len(given) != 1:
                raise APIError.bad_request("structured_outputs needs exactly one of json, json_object, regex, "
                                           f"choice, grammar; got {sorted(given) or 'none'}", "structured_outputs")
            found.append(("structured_outputs", _constraint(*given.popitem())))
        found += [(name, _constraint(kind, getattr(self, name))) for name, kind in GUIDED_FIELDS.items()
                  if getattr(self, name) is not None]
        if len(found) > 1:
            raise APIError.bad_request(f"give one output constraint, not {' and '.join(n for n, _ in found)}",
                                       found[1][0])
        return found[0][1] if found else None, found[0][0] if found else None

    def check_structured(self) -> None:
        """Refuse a constraint that does not compile (a bad schema, regex or grammar) with a 400 naming its
        field. It compiles the grammar without the vocabulary, so it runs on the tokenizer pool."""
        structured, field = self.structured()
        if structured is not None:
            try:
                validate_structured(structured)
            except InvalidRequestError as exc:
                raise APIError.bad_request(f"{field}: {exc}", field) from None

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
    add_special_tokens: bool = True

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

    def sampling_params(self, max_tokens: int | None, vocab_size: int, controls: dict | None = None) -> SamplingParams:
        if self.echo:
            raise APIError.bad_request("echo is not supported", "echo")
        if self.suffix:
            raise APIError.bad_request("suffix is not supported", "suffix")
        return self._sampling_params(max_tokens, self.logprobs, vocab_size, {}, self.best_of, controls)


class ContentPart(_Body):
    type: Literal["text"]
    text: str


class FunctionCallIn(_Body):
    name: str
    arguments: str


class ToolCallIn(_Body):
    id: str
    type: Literal["function"]
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call

    def template_dict(self, param: str = "messages") -> dict:
        """The message as a chat template reads it: text parts joined, `developer` as `system`, tool calls
        with their arguments as objects (what templates render with `tojson`). `param` names the message."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.role == "tool":
            if self.tool_call_id is None:
                raise APIError.bad_request("a tool message needs the tool_call_id it answers",
                                           f"{param}.tool_call_id")
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls and self.role != "assistant":
            raise APIError.bad_request("only assistant messages carry tool_calls", f"{param}.tool_calls")
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, f"{param}.tool_calls[{i}]")
                                     for i, call in enumerate(self.tool_calls)]
        return message


def _template_call(call: ToolCallIn, param: str) -> dict:
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise APIError.bad_request("function.arguments must be JSON text", f"{param}.function.arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


# apply_chat_template's own parameters (and the template's `messages`): chat_template_kwargs are the
# template's variables, and may not reach these (return_tensors, truncation, ...).
_TEMPLATE_PARAMETERS = frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {
    "self", "kwargs"} | {"messages"}


class ChatTemplateControls(_Body):
    """vLLM's controls of the chat template, shared by chat completions and /tokenize."""
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None

    def template_options(self) -> dict:
        """Keyword arguments for the tokenizer's `apply_chat_template` besides the messages."""
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError.bad_request("continue_final_message needs add_generation_prompt to be false",
                                       "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError.bad_request("continue_final_message needs the last message to be the assistant's",
                                       "continue_final_message")
        if taken := _TEMPLATE_PARAMETERS.intersection(self.chat_template_kwargs or {}):
            raise APIError.bad_request(f"chat_template_kwargs may not set {sorted(taken)}", "chat_template_kwargs")
        return {**(self.chat_template_kwargs or {}), "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    def template_messages(self) -> list[dict]:
        return [m.template_dict(f"messages[{i}]") for i, m in enumerate(self.messages)]


class ChatCompletionRequest(_GenerationRequest, ChatTemplateControls):
    """POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted, not acted on (IGNORED_FIELDS): every call is returned
    echo: bool = False
    max_reasoning_tokens: int | None = Field(None, ge=0)
    reasoning_effort: Effort | None = None

    def tool_use(self) -> ToolUse | None:
        try:
            return tool_use(self.tools, self.tool_choice)
        except InvalidRequestError as exc:
            raise APIError.from_invalid(exc) from None

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int | None, vocab_size: int, controls: dict | None = None) -> SamplingParams:
        if self.echo:
            raise APIError.bad_request("echo is not supported", "echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError.bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs", "max_tokens": self.max_tokens_param}
        return self._sampling_params(max_tokens, logprobs, vocab_size, renames, controls=controls)


def parse_body(model: type[_Body], body: bytes) -> _Body:
    """Validate a JSON body; the first problem becomes a 400 naming its top-level field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = first_field_error(exc)
        if first.type == "json_invalid":
            raise APIError.bad_request(f"the body is not valid JSON: {first.message}", None) from None
        if first.type == "extra_forbidden" and len(first.loc) == 1:
            name = first.loc[0]
            why = "is not supported by this server" if name in UNSUPPORTED_FIELDS else "is not a field of this request"
            raise APIError.bad_request(f"`{name}` {why}", name) from None
        message = f"{first.path}: {first.message}" if first.path else first.message
        raise APIError.bad_request(message, first.loc[0] if first.loc else None) from None


def request_body_schema(model: type[_Body], example: dict | None = None) -> dict:
    """The OpenAPI `requestBody` of an endpoint that reads its body itself, from the model that parses it
    (references inlined: the schema stands alone in the operation), with a request that works as its
    `example` (the docs show it; a schema fuzzer sends it first)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(defs[node["$ref"].rsplit("/", 1)[1]])
            return {key: inline(value) for key, value in node.items()}
        return [inline(value) for value in node] if isinstance(node, list) else node

    body = {"schema": inline(schema)}
    if example is not None:
        body["example"] = example
    return {"requestBody": {"required": True, "content": {"application/json": body}}}


def _constraint(kind: str, value) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs(json=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutputs(choice=tuple(value))
    return StructuredOutputs(**{kind: value})


def _default(value, default):
    return default if value is None else value


def sse(payload: BaseModel | str) -> str:
    """One server-sent event in OpenAI's framing."""
    data = payload if isinstance(payload, str) else payload.model_dump_json()
    return f"data: {data}\n\n"


def error_event(exc: APIError) -> str:
    return sse(json.dumps(exc.body()))
