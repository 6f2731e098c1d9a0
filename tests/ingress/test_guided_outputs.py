"""Structured outputs through the OpenAI API with the official client: response_format, vLLM's
structured_outputs and guided_* fields, on the disaggregated (main) and colocated (aux) apps; and the 400s
for constraints that cannot run. (Named to run before test_routing_e2e, which kills the apps' workers.)"""
import json
import re

import jsonschema
import pytest
import ray

from router.api.openai_api import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from tests.ingress.conftest import MODEL

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
LONG = "Describe the person in our records as JSON, with their name, their age and their role. " * 3


def chat(content: str) -> list[dict]:
    return [{"role": "user", "content": content}]


def prompt_tokens(app) -> int:
    prefill = next(a for w, a in app.actors().items() if w.startswith("prefill"))
    return ray.get(prefill.stats.remote()).prompt_tokens


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4}])
def test_a_remotely_prefilled_chat_with_a_json_schema_validates(main_app, sampling):
    before = prompt_tokens(main_app)
    # A prompt of its own, or the decode worker holds it from the previous case and prefills locally.
    messages = chat(f"{sampling}: {LONG}")
    out = main_app.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=120,
                                                    response_format=PERSON_FORMAT, **sampling)
    assert prompt_tokens(main_app) > before  # prefilled (and its first token sampled) on the prefill worker
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 9}])
def test_a_colocated_completion_with_guided_json_validates(aux_app, sampling):
    out = aux_app.client().completions.create(model=MODEL, prompt="Person:", max_tokens=120,
                                              extra_body={"guided_json": PERSON}, **sampling)
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)


def test_n_candidates_under_a_schema_each_validate_and_match_single_seeded_requests(aux_app):
    """Forked candidates carry no grammar yet, so the ingress runs them as n requests seeded like candidates."""
    from engine.sampling_params import candidate_seed

    client = aux_app.client()
    both = client.completions.create(model=MODEL, prompt="People:", max_tokens=120, n=2, temperature=1.0, seed=21,
                                     extra_body={"guided_json": PERSON})
    assert [c.index for c in both.choices] == [0, 1]
    for i, choice in enumerate(both.choices):
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
        alone = client.completions.create(model=MODEL, prompt="People:", max_tokens=120, temperature=1.0,
                                          seed=candidate_seed(21, i), extra_body={"guided_json": PERSON})
        assert alone.choices[0].text == choice.text


def test_json_object_mode_gives_an_object(main_app):
    # Keys are unbounded strings, where a random-weight model can loop: a greedy prompt it ends on.
    out = main_app.client().completions.create(model=MODEL, prompt="An object:", max_tokens=120, temperature=0,
                                               extra_body={"response_format": {"type": "json_object"}})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].text), dict)


def test_structured_outputs_regex_choice_and_grammar_match(main_app, aux_app):
    constraints = [{"regex": r"[a-z]{3}-\d{2,4}"}, {"choice": ["yes", "no"]},
                   {"grammar": 'root ::= "a" ("b" | "c"){1,8} "."'}]
    for app in (main_app, aux_app):
        outs = [app.client().completions.create(model=MODEL, prompt=LONG, max_tokens=30, temperature=1.0, seed=i,
                                                extra_body={"structured_outputs": c}).choices[0]
                for i, c in enumerate(constraints)]
        assert [o.finish_reason for o in outs] == ["stop"] * 3
        assert re.fullmatch(r"[a-z]{3}-\d{2,4}", outs[0].text)
        assert outs[1].text in ("yes", "no")
        assert re.fullmatch(r"a[bc]{1,8}\.", outs[2].text)


def test_guided_choice_streams_one_of_the_choices(aux_app):
    stream = aux_app.client().chat.completions.create(model=MODEL, messages=chat("Pick"), max_tokens=10,
                                                      stream=True, extra_body={"guided_choice": ["left", "right"]})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) in ("left", "right")
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_a_json_output_cut_by_max_tokens_is_reported_as_length(main_app):
    out = main_app.client().chat.completions.create(model=MODEL, messages=chat(LONG), max_tokens=4, temperature=0,
                                                    response_format=PERSON_FORMAT)
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.choices[0].message.content)


@pytest.mark.parametrize("extra, param", [
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_a_constraint_that_cannot_run_is_400_naming_its_field(main_app, extra, param):
    response = main_app.post("/v1/chat/completions", {"model": MODEL, "messages": chat("x"), **extra})
    body = response.json()["error"]
    assert (response.status_code, body["param"]) == (400, param), body


def test_response_format_text_and_strict_are_accepted():
    body = {"model": "m", "prompt": "x", "response_format": {"type": "text"}}
    assert parse_body(CompletionRequest, json.dumps(body).encode()).structured() == (None, None)
    chat_body = {"model": "m", "messages": chat("x"), "response_format": PERSON_FORMAT}
    structured, field = parse_body(ChatCompletionRequest, json.dumps(chat_body).encode()).structured()
    assert field == "response_format" and json.loads(structured.json) == PERSON


def test_an_unknown_field_inside_response_format_is_400():
    body = {"model": "m", "prompt": "x", "response_format": {"type": "json_object", "schema": {}}}
    with pytest.raises(APIError) as raised:
        parse_body(CompletionRequest, json.dumps(body).encode())
    assert raised.value.param == "response_format"
