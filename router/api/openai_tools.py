"""Tools in chat requests: function definitions, `tool_choice`, and what they turn into — the tools the
chat template renders, the output parser, and for `required` or a named function the JSON schema the
engine enforces (vLLM's forms: a named function's output is its arguments object; `required` is an
array of `{"name", "parameters"}` objects, one schema per tool under anyOf)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from jsonschema import SchemaError
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputs

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class ChatCompletionNamedToolChoiceParam(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


@dataclass(slots=True)
class ToolUse:
    """What a request's tools mean for its generation: `mode` is none, auto, required or named."""
    mode: str
    tools: list[dict]
    name: str | None = None
    structured: StructuredOutputs | None = None


def tool_use(tools: list[ChatCompletionToolsParam] | None, tool_choice: ToolChoice | None) -> ToolUse | None:
    """Validate the tools and the choice among them (InvalidRequestError naming the field); None: no tools."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return None
    names = [tool.function.name for tool in tools]
    for i, tool in enumerate(tools):
        if names.index(tool.function.name) != i:
            raise InvalidRequestError(f"two tools are named {tool.function.name!r}", f"tools[{i}].function.name")
        try:
            validator_for(parameters(tool)).check_schema(parameters(tool))
        except SchemaError as exc:
            raise InvalidRequestError(f"not a valid JSON schema: {exc.message}",
                                      f"tools[{i}].function.parameters") from None
    rendered = [tool.model_dump(exclude_none=True) for tool in tools]
    choice = tool_choice or "auto"
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        name = choice.function.name
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among tools "
                                      f"({', '.join(names)})", "tool_choice")
        schema = parameters(tools[names.index(name)])
        return ToolUse("named", rendered, name, StructuredOutputs(json=json.dumps(schema)))
    if choice == "required":
        return ToolUse("required", rendered, structured=StructuredOutputs(json=json.dumps(required_schema(tools))))
    return ToolUse(choice, rendered)


def parameters(tool: ChatCompletionToolsParam) -> dict:
    return tool.function.parameters or EMPTY_PARAMETERS


def required_schema(tools: list[ChatCompletionToolsParam]) -> dict:
    """At least one call, each to one of the tools with that tool's parameters."""
    calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                               "parameters": parameters(tool)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
