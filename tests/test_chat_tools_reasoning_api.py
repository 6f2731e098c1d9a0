"""Tool calls and the reasoning budget through the OpenAI API, with the official client, on a colocated
and a disaggregated application over the tiny agent model (tests/conftest.py: <think>, </think>,
<tool_call>, </tool_call> as tokens; a template that renders tools and opens the thinking).

A random model does not write `<tool_call>` by itself: the agent model is rigged so that once it writes
<tool_call> (a logit bias makes it), it goes on with a whole call, token by token, which tool_choice
auto's parser reads. Its generation prompt opens the thinking, so these requests close it at once
(max_reasoning_tokens 0). `required` and named functions need structured outputs (issue 14's capability 1).
"""
from __future__ import annotations

import json
import re
import socket

import jsonschema
import openai
import pytest
import requests

from router.api.openai_api import ChatCompletionRequest

MODEL = "tiny-agent"
EFFORT = {"low": 3, "medium": 6, "high": 9}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CONSTRAINED = pytest.mark.skipif("structured_outputs" not in ChatCompletionRequest.model_fields,
                                 reason="needs structured outputs (branch i14-so) to steer or constrain the output")


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_agent_dir):
    from ray import serve

    from cluster.app import build_app, shutdown_cluster
    from cluster.config import ClusterConfig
    from ray.serve.api import RunTarget

    common = dict(model=tiny_agent_dir, served_model_name=MODEL, namespace="tandem-tests",
                  engine={"num_kv_blocks": 64, "max_num_batched_tokens": 256},
                  reasoning={"start": "<think>", "end": "</think>", "effort_tokens": EFFORT})
    configs = {
        "colocated": ClusterConfig(name="agent-colo", mode="colocated", decode={"num_cpus": 0.5}, **common),
        # Every prefill goes to the prefill worker: the first token, and the budget's, come from there.
        "disaggregated": ClusterConfig(name="agent-disagg", prefill={"num_cpus": 0.5}, decode={"num_cpus": 0.5},
                                       router={"max_local_prefill_length": 0,
                                               "max_remote_prefill_cache_hit_ratio": 1.0}, **common)}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        # The apps first: their cluster controllers start the workers, which load while Serve starts.
        targets = [RunTarget(build_app(c.model_dump()), name=name, route_prefix=f"/{name}")
                   for name, c in configs.items()]
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run_many(targets)
        yield {name: f"http://127.0.0.1:{port}/{name}" for name in configs}
    finally:
        serve.shutdown()
        for config in configs.values():
            shutdown_cluster(config.name, config.namespace)


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def thinking_length(response) -> int:
    """Tokens before the first </think>: the thinking, since the prompt opened it."""
    tokens = [t.token for t in response.choices[0].logprobs.content]
    return tokens.index("</think>")


@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
@pytest.mark.parametrize("budget", [0, 5])
def test_the_thinking_stops_at_exactly_max_reasoning_tokens_and_comes_back_apart(apps, path, budget):
    response = client(apps[path]).chat.completions.create(
        model=MODEL, messages=ask(f"budget {budget} on {path}?"), temperature=0, max_tokens=budget + 10,
        logprobs=True, extra_body={"max_reasoning_tokens": budget, "ignore_eos": True})
    assert thinking_length(response) == budget
    message = response.choices[0].message
    assert "</think>" not in (message.reasoning_content or "") and "</think>" not in message.content
    assert (message.reasoning_content is None) == (budget == 0)
    assert message.content and response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
def test_streamed_reasoning_and_content_are_those_of_the_whole_response(apps, path):
    body = dict(model=MODEL, messages=ask(f"stream on {path}"), temperature=0, max_tokens=16,
                extra_body={"max_reasoning_tokens": 4, "ignore_eos": True})
    whole = client(apps[path]).chat.completions.create(**body).choices[0].message
    reasoning = content = ""
    for chunk in client(apps[path]).chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == (whole.reasoning_content, whole.content)
    assert reasoning and content


@pytest.mark.parametrize("effort", ["low", "high"])
def test_reasoning_effort_maps_to_the_configured_budget(apps, effort):
    response = client(apps["disaggregated"]).chat.completions.create(
        model=MODEL, messages=ask(f"effort {effort}"), temperature=0, max_tokens=20, logprobs=True,
        reasoning_effort=effort, extra_body={"ignore_eos": True})
    assert thinking_length(response) == EFFORT[effort]


def test_the_disaggregated_app_prefilled_remotely(apps):
    metrics = requests.get(apps["disaggregated"] + "/metrics", timeout=30).text
    remote = [float(v) for v in re.findall(r'tandem:prefills_total\{[^}]*where="remote"[^}]*\} (\S+)', metrics)]
    assert sum(remote) > 0


def test_tools_and_tool_messages_are_rendered_by_the_chat_template(apps, tiny_agent_dir):
    from engine.model_loader import load_tokenizer
    messages = [*ask("weather in Paris?"),
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    response = client(apps["colocated"]).chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                                                 max_tokens=2, temperature=0)
    template = {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    expected = load_tokenizer(tiny_agent_dir).apply_chat_template(
        [messages[0], template, messages[2]], tools=[WEATHER], add_generation_prompt=True, tokenize=True,
        return_dict=False)
    assert response.usage.prompt_tokens == len(expected)
    rendered = load_tokenizer(tiny_agent_dir).decode(expected)
    assert '"get_weather"' in rendered and '<tool_response id="call_1">sunny' in rendered


def test_a_tool_choice_naming_an_unknown_function_is_a_400_naming_it(apps):
    with pytest.raises(openai.BadRequestError) as raised:
        client(apps["colocated"]).chat.completions.create(
            model=MODEL, messages=ask("x"), tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "launch"}})
    assert raised.value.body["param"] == "tool_choice" and "launch" in raised.value.body["message"]


def test_without_a_call_in_the_output_auto_answers_with_content(apps):
    response = client(apps["colocated"]).chat.completions.create(
        model=MODEL, messages=ask("hello"), tools=[WEATHER], max_tokens=6, temperature=0,
        extra_body={"ignore_eos": True})
    choice = response.choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "length"


def steered_call(base_url: str, opener: int, stream: bool, max_tokens: int = 8) -> tuple[list, str, str | None]:
    """(calls as (id, name, arguments), content, finish_reason) of a request whose output is the rigged call."""
    body = dict(model=MODEL, messages=ask("weather?"), tools=[WEATHER, TIME], tool_choice="auto", temperature=0,
                max_tokens=max_tokens, logit_bias={str(opener): 100}, extra_body={"max_reasoning_tokens": 0})
    if not stream:
        choice = client(base_url).chat.completions.create(**body).choices[0]
        calls = [(c.id, c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return calls, choice.message.content or "", choice.finish_reason
    parts, content, finish = {}, "", None
    for chunk in client(base_url).chat.completions.create(stream=True, **body):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                parts[call.index] = (call.id, call.function.name, call.function.arguments)
            finish = choice.finish_reason or finish
    return [parts[i] for i in sorted(parts)], content, finish


@pytest.fixture(scope="module")
def opener(tiny_agent_dir) -> int:
    """The token id of <tool_call>."""
    from engine.model_loader import load_tokenizer
    return load_tokenizer(tiny_agent_dir).convert_tokens_to_ids("<tool_call>")


@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_models_hermes_call_into_tool_calls(apps, opener, path, stream):
    calls, content, finish = steered_call(apps[path], opener, stream)
    assert [(name, json.loads(args)) for _, name, args in calls] == [("get_weather", {"city": "Paris"})]
    jsonschema.validate(json.loads(calls[0][2]), WEATHER["function"]["parameters"])
    assert calls[0][0].startswith("call_") and finish == "tool_calls" and content == ""


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_by_max_tokens_ends_with_length_and_comes_back_as_content(apps, opener, stream):
    from tests.conftest import AGENT_CALL
    calls, content, finish = steered_call(apps["colocated"], opener, stream, max_tokens=3)  # </think> <tool_call> {...}
    assert (calls, finish) == ([], "length")
    assert content == "<tool_call>" + AGENT_CALL  # what the model wrote, as text: never a call


@CONSTRAINED
@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_constrained_tool_choice_gives_calls_whose_arguments_validate(apps, path, tool_choice):
    response = client(apps[path]).chat.completions.create(
        model=MODEL, messages=ask("weather?"), tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0,
        max_tokens=120)
    choice = response.choices[0]
    assert choice.message.tool_calls, choice.message.content
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")


@CONSTRAINED
def test_a_constrained_call_cut_by_max_tokens_is_length_and_no_tool_call(apps):
    choice = client(apps["colocated"]).chat.completions.create(
        model=MODEL, messages=ask("weather?"), tools=[WEATHER], temperature=0, max_tokens=3,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content  # the partial JSON, as text: what the model wrote, never a call
