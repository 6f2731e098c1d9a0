"""Tool calls read from a choice's text, streamed in any pieces. `feed` and `finish` return the content
that is not a call and the calls completed so far; a call is handed out only once its JSON is complete
and parses, so a call cut off by max_tokens never becomes a `ToolCall`: its text comes back as content.

`TOOL_PARSERS` holds the formats `tool_call_parser` may name for `tool_choice: auto` (vLLM's
`--tool-call-parser`); `required` and a named function read the JSON the engine constrained the output to.
"""
from __future__ import annotations

import json

from router.api.markers import MarkerScanner
from router.api.openai_responses import FunctionCall, ToolCall


class HermesToolParser:
    """Hermes / Qwen style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number of them;
    the text around them is content. A block that does not hold such an object stays content, tags and all."""

    start, end = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.scanner = MarkerScanner(self.start, self.end)
        self.block: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        return self._read(self.scanner.feed(text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self._read(self.scanner.flush())
        if self.block is not None:  # cut off inside a call
            content, self.block = content + self.start + self.block, None
        return content, calls

    def _read(self, events: list[tuple[str, str]]) -> tuple[str, list[ToolCall]]:
        content, calls = "", []
        for kind, text in events:
            if kind == "out":
                content += text
            elif kind == "start":
                self.block = ""
            elif kind == "in":
                self.block += text
            else:
                call = parse_call(self.block, "arguments")
                if call is None:
                    content += self.start + self.block + self.end
                else:
                    calls.append(call)
                self.block = None
        return content, calls


class NamedToolParser:
    """`tool_choice` naming a function: the whole output is that function's arguments object."""

    def __init__(self, name: str):
        self.name = name
        self.text = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.text += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        arguments = _loads(self.text)
        if not isinstance(arguments, dict):
            return self.text, []
        return "", [ToolCall(function=FunctionCall(name=self.name, arguments=_dumps(arguments)))]


class RequiredToolParser(NamedToolParser):
    """`tool_choice: required`: the output is an array of `{"name", "parameters"}` objects."""

    def __init__(self):
        super().__init__("")

    def finish(self) -> tuple[str, list[ToolCall]]:
        items = _loads(self.text)
        calls = [parse_call(item, "parameters") for item in items] if isinstance(items, list) and items else [None]
        if None in calls:
            return self.text, []
        return "", calls


TOOL_PARSERS = {"hermes": HermesToolParser}


def parse_call(source: str | dict, arguments_key: str) -> ToolCall | None:
    """A call from `{"name": ..., arguments_key: {...}}` (an object, or its JSON text); None if it is none."""
    obj = _loads(source) if isinstance(source, str) else source
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(function=FunctionCall(name=obj["name"], arguments=_dumps(arguments)))


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)
