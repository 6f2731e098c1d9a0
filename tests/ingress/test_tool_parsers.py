"""Tool calls and reasoning read from model text, without a cluster: the parsers give the same result
whichever way the text is split into streamed pieces, never build a call from a cut JSON, and validate
the request's tools."""
import json

import jsonschema
import pytest

from engine.outputs import RequestOutput
from router.api.chat_output import ChatOutput, ChatParsing
from router.api.openai_api import APIError, ChatCompletionRequest, parse_body
from router.api.openai_responses import ChatFormatter, Choice, Usage
from router.api.reasoning_parser import ReasoningOptions, ReasoningParser
from router.api.tool_parsers import HermesToolParser, NamedToolParser, RequiredToolParser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_TEXT = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')


def splits(text: str):
    """The text whole, in two pieces at every position, and one character at a time."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)


def run(parser, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = "", []
    for piece in pieces:
        text, new = parser.feed(piece)
        content, calls = content + text, calls + new
    text, new = parser.finish()
    calls += new
    return content + text, [(c.function.name, json.loads(c.function.arguments)) for c in calls]


@pytest.mark.parametrize("pieces", list(splits(HERMES_TEXT)), ids=lambda p: str(len(p)))
def test_hermes_calls_parse_the_same_however_the_text_is_split(pieces):
    assert run(HermesToolParser(), pieces) == (
        "Let me check. \n", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_hermes_call_cut_off_is_content_not_a_call():
    cut = HERMES_TEXT[:HERMES_TEXT.index("get_time") + 4]
    for pieces in splits(cut):
        content, calls = run(HermesToolParser(), pieces)
        assert calls == [("get_weather", {"city": "Paris"})]
        assert content == "Let me check. \n" + cut[cut.rindex("<tool_call>"):]


def test_hermes_block_that_is_not_a_call_stays_content():
    text = "a<tool_call>{not json}</tool_call>b<tool_call>[1]</tool_call>"
    assert run(HermesToolParser(), [text]) == (text, [])


def test_text_that_only_begins_like_a_marker_is_content():
    assert run(HermesToolParser(), ["x <tool", "_cal"]) == ("x <tool_cal", [])


@pytest.mark.parametrize("thinking", [True, False])
def test_reasoning_splits_from_content_however_the_text_is_split(thinking):
    text = ("" if thinking else "<think>") + "I ponder <b>.</think>\n\nThe answer </think> <think> is 4."
    for pieces in splits(text):
        parser = ReasoningParser("<think>", "</think>", thinking)
        parts = [parser.feed(p) for p in pieces] + [parser.finish()]
        reasoning, content = "".join(r for r, _ in parts), "".join(c for _, c in parts)
        assert (reasoning, content) == ("I ponder <b>.", "\n\nThe answer </think> <think> is 4.")


def test_a_choice_cut_inside_its_thinking_is_all_reasoning():
    parser = ReasoningParser("<think>", "</think>", thinking=True)
    assert parser.feed("still thinking </thi") == ("still thinking ", "")
    assert parser.finish() == ("</thi", "")


def test_named_and_required_parsers_read_the_constrained_json_and_never_a_cut_one():
    assert run(NamedToolParser("get_weather"), ['{"city": ', '"Paris"}']) == ("", [("get_weather", {"city": "Paris"})])
    assert run(NamedToolParser("get_weather"), ['{"city": "Pa']) == ('{"city": "Pa', [])
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    assert run(RequiredToolParser(), [text]) == ("", [("get_time", {}), ("get_weather", {"city": "Oslo"})])
    assert run(RequiredToolParser(), [text[:-3]]) == (text[:-3], [])
    assert run(RequiredToolParser(), ["[]"]) == ("[]", [])


@pytest.mark.parametrize("mode, reason, expected", [
    ("auto", "stop", "tool_calls"), ("auto", "length", "length"), ("named", "stop", "stop"),
    (None, "stop", "stop")])
def test_finish_reason_says_tool_calls_only_for_calls_the_model_finished(mode, reason, expected):
    tools = {"auto": HermesToolParser(), "named": NamedToolParser("get_time"), None: None}[mode]
    out = ChatOutput(None, tools, mode)
    out.finish(HERMES_TEXT if mode == "auto" else "{}", reason)
    assert out.finish_reason == expected


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_body(ChatCompletionRequest, json.dumps(body).encode())


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_and_tool_choice_are_a_400_naming_the_field(fields, param):
    with pytest.raises(APIError) as raised:
        request(**fields).tool_use()
    assert (raised.value.status, raised.value.param) == (400, param)


def test_required_schema_accepts_calls_of_the_tools_and_nothing_else():
    use = request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False).tool_use()
    schema = json.loads(use.structured.json)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Rome"}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "other", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    named = request(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.tool_use().structured.json) == WEATHER["function"]["parameters"]


def test_assistant_tool_calls_and_tool_results_reach_the_template_as_objects():
    req = request(messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = req.template_messages()
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("message, param", [
    ({"role": "tool", "content": "sunny"}, "messages[0].tool_call_id"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
        "name": "f", "arguments": "{not json"}}]}, "messages[0].tool_calls[0].function.arguments"),
])
def test_bad_tool_messages_are_a_400_naming_the_field(message, param):
    with pytest.raises(APIError) as raised:
        request(messages=[message]).template_messages()
    assert (raised.value.status, raised.value.param) == (400, param)


def test_streamed_chunks_add_up_to_the_whole_response(tokenizer):
    """The same text as one response and as a stream of one-character deltas: reasoning, content and calls
    agree, and each call arrives in one delta with its id, name and complete arguments."""
    parsing = ChatParsing(tokenizer, ReasoningOptions(), "hermes")
    use = request(tools=[WEATHER, TIME]).tool_use()
    prompt = tokenizer.encode("<|im_start|>assistant\n") + list(parsing.markers.start_ids)
    text = "hmm</think>" + HERMES_TEXT
    fmt = ChatFormatter("m", tokenizer, lambda: parsing.output(use, prompt))
    usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
    whole = fmt.response([Choice(0, 0, text=text, finish_reason="stop")], usage).choices[0]
    assert (whole.message.reasoning_content, whole.message.content) == ("hmm", "Let me check. \n")
    assert whole.finish_reason == "tool_calls"
    streamed = {"reasoning": "", "content": "", "calls": {}}
    for i, char in enumerate(text):
        last = i == len(text) - 1
        chunk = fmt.chunk(Choice(0, 0), RequestOutput("r", [1], char, last, "stop" if last else None), 0)
        if chunk is None:
            continue
        delta = chunk.choices[0].delta
        streamed["reasoning"] += delta.reasoning_content or ""
        streamed["content"] += delta.content or ""
        for call in delta.tool_calls or []:
            streamed["calls"][call.index] = (call.function.name, json.loads(call.function.arguments))
        finish = chunk.choices[0].finish_reason
    assert (streamed["reasoning"], streamed["content"], finish) == ("hmm", "Let me check. \n", "tool_calls")
    assert streamed["calls"] == {i: (c.function.name, json.loads(c.function.arguments))
                                 for i, c in enumerate(whole.message.tool_calls)}


@pytest.mark.parametrize("options, fields, param", [
    (None, {"max_reasoning_tokens": 4}, "max_reasoning_tokens"),
    (None, {"reasoning_effort": "low"}, "reasoning_effort"),
    (ReasoningOptions(), {"max_reasoning_tokens": 4, "reasoning_effort": "low"}, "reasoning_effort"),
    (ReasoningOptions(), {"reasoning_effort": "extreme"}, "reasoning_effort"),
    (ReasoningOptions(), {"max_reasoning_tokens": -1}, "max_reasoning_tokens"),
])
def test_a_reasoning_budget_the_server_cannot_honour_is_a_400_naming_the_field(tokenizer, options, fields, param):
    with pytest.raises(APIError) as raised:
        ChatParsing(tokenizer, options, "hermes").reasoning_budget(request(**fields))
    assert (raised.value.status, raised.value.param) == (400, param)


def test_reasoning_effort_maps_to_the_documented_budgets(tokenizer):
    parsing = ChatParsing(tokenizer, ReasoningOptions(), "hermes")
    budgets = {e: parsing.reasoning_budget(request(reasoning_effort=e)) for e in ("low", "medium", "high")}
    assert budgets == {"low": 512, "medium": 2048, "high": 8192}
    assert parsing.reasoning_budget(request(max_reasoning_tokens=0)) == 0
    assert parsing.reasoning_budget(request()) is None


def test_auto_without_a_tool_call_parser_is_refused_but_required_is_not(tokenizer):
    parsing = ChatParsing(tokenizer, None, None)
    with pytest.raises(APIError) as raised:
        parsing.check_tools(request(tools=[WEATHER]).tool_use())
    assert raised.value.param == "tool_choice"
    parsing.check_tools(request(tools=[WEATHER], tool_choice="required").tool_use())


def test_the_cluster_config_gives_the_markers_to_the_engine_and_knows_its_parsers():
    from cluster.config import ClusterConfig
    config = ClusterConfig(reasoning={"start": "<s1>", "end": "</s1>"})
    assert config.engine_config(config.decode).reasoning_markers == ("<s1>", "</s1>")
    assert ClusterConfig().engine_config(ClusterConfig().decode).reasoning_markers is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        ClusterConfig(tool_call_parser="nonesuch")


def test_a_constrained_tool_choice_reads_its_json_even_where_the_prompt_opened_thinking(tokenizer):
    parsing = ChatParsing(tokenizer, ReasoningOptions(), "hermes")
    thinking_prompt = list(parsing.markers.start_ids)
    out = parsing.output(request(tools=[TIME], tool_choice="required").tool_use(), thinking_prompt)
    out.finish('[{"name": "get_time", "parameters": {}}]', "stop")
    assert [c.function.name for c in out.whole.tool_calls] == ["get_time"] and not out.whole.reasoning
    assert out.finish_reason == "tool_calls"
