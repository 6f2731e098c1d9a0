"""Structured outputs in the engine: every constraint kind holds under greedy and seeded sampling, a cut
is reported as `length`, a resumed request continues its grammar, and the mask touches only its rows."""
import json
import re

import jsonschema
import pytest

from engine import SamplingParams
from engine.sampling_params import StructuredOutputs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "role"], "additionalProperties": False}
SCHEMAS = {
    "object": PERSON,
    "array": {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1,
              "maxItems": 4},
    "nested": {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "owner": {"anyOf": [{"type": "null"}, PERSON]}},
        "required": ["ok", "tags", "owner"], "additionalProperties": False},
    "string": {"type": "string", "pattern": "^[a-z]{2,6}$"},
}
SAMPLING = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, seed=3),
            "top-k": dict(temperature=0.8, top_k=50, top_p=0.9, seed=11)}


def json_params(schema: dict, max_tokens: int = 160, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutputs(json=json.dumps(schema)), **kwargs)


@pytest.mark.parametrize("sampling", SAMPLING)
@pytest.mark.parametrize("schema", SCHEMAS)
def test_a_json_schema_output_validates(tiny_engine, schema, sampling):
    out = tiny_engine.generate("Give me JSON:", json_params(SCHEMAS[schema], **SAMPLING[sampling]))[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMAS[schema])


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_json_object_output_is_an_object(tiny_engine, sampling):
    params = SamplingParams(max_tokens=160, structured=StructuredOutputs(json_object=True), **SAMPLING[sampling])
    # Keys are unbounded strings: a random-weight model loops in some, so the prompt is one it ends on.
    out = tiny_engine.generate("An object:", params)[0]
    assert out.finish_reason == "stop"
    assert isinstance(json.loads(out.text), dict)


@pytest.mark.parametrize("sampling", SAMPLING)
def test_regex_choice_and_grammar_outputs_match(tiny_engine, sampling):
    # [0-9], not \d: llguidance's \d is every Unicode decimal digit of Unicode 16, and Python 3.11's `re`
    # knows only those of Unicode 14 (a sampled U+1CCF9 matches one and not the other).
    regex, choices, grammar = r"[a-z]{3}-[0-9]{2,4}", ("yes", "no", "maybe later"), 'root ::= "a" ("b" | "c"){1,8} "."'
    outs = tiny_engine.generate(["r", "c", "g"], [
        SamplingParams(max_tokens=40, structured=structured, **SAMPLING[sampling])
        for structured in (StructuredOutputs(regex=regex), StructuredOutputs(choice=choices),
                           StructuredOutputs(grammar=grammar))])
    assert [o.finish_reason for o in outs] == ["stop"] * 3
    assert re.fullmatch(regex, outs[0].text)
    assert outs[1].text in choices
    assert re.fullmatch(r"a[bc]{1,8}\.", outs[2].text)


def test_eos_comes_only_when_the_grammar_can_end_and_bias_composes_with_the_mask(tiny_engine):
    eos = min(tiny_engine.eos_token_ids)
    brace = tiny_engine.tokenizer.convert_tokens_to_ids("}")
    out = tiny_engine.generate("x", json_params(PERSON, temperature=0.0, logit_bias={eos: 100.0, brace: 100.0}))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), PERSON)


def test_a_json_output_cut_by_max_tokens_finishes_with_length(tiny_engine):
    out = tiny_engine.generate("x", json_params(PERSON, max_tokens=4, temperature=0.0))[0]
    assert out.finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(out.text)


def test_a_request_resumed_from_output_token_ids_continues_its_grammar(tiny_engine):
    params = json_params(SCHEMAS["nested"], temperature=1.0, seed=5)
    whole = tiny_engine.generate("Resume me:", params)[0]
    assert len(whole.token_ids) > 6
    prefix = whole.token_ids[:5]
    req = tiny_engine.make_request("resumed", "Resume me:", params, output_token_ids=prefix)
    tiny_engine.add(req)
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    assert req.finish_reason == "stop"
    text = tiny_engine.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMAS["nested"])
    assert req.output_token_ids == whole.token_ids  # the seeded stream and the grammar state both resumed


def test_output_token_ids_the_grammar_refuses_fail_the_request(tiny_engine):
    not_json = tiny_engine.tokenize("hello")
    req = tiny_engine.make_request("refused", "x", json_params(PERSON), output_token_ids=not_json)
    tiny_engine.add(req)
    outs = []
    while tiny_engine.has_unfinished_requests():
        outs += tiny_engine.step()
    assert [o.finish_reason for o in outs] == ["error"] and "structured output" in outs[0].error


def test_a_grammar_that_does_not_compile_fails_its_request_not_the_engine(tiny_engine):
    tiny_engine.add(tiny_engine.make_request("bad", "x", SamplingParams(structured=StructuredOutputs(regex="a(b"))))
    tiny_engine.add_request("good", "x", SamplingParams(max_tokens=3, ignore_eos=True))
    outs = {}
    while tiny_engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in tiny_engine.step())
    assert outs["bad"].finish_reason == "error" and "regex" in outs["bad"].error
    assert outs["good"].finish_reason == "length"


def test_the_mask_constrains_only_its_own_rows(tiny_engine):
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = tiny_engine.generate("Same prompt", free)[0]
    mixed = tiny_engine.generate(["Same prompt", "Same prompt"], [free, json_params(PERSON, temperature=0.0)])
    assert mixed[0].token_ids == alone.token_ids
    jsonschema.validate(json.loads(mixed[1].text), PERSON)


def test_a_constraint_compiles_once_and_requests_share_it(tiny_engine):
    schema = {"type": "object", "properties": {"once": {"type": "boolean"}}, "required": ["once"],
              "additionalProperties": False}
    before = len(tiny_engine.structured._cache)
    outs = tiny_engine.generate(["a", "b", "c"], json_params(schema, temperature=1.0, seed=1))
    assert len(tiny_engine.structured._cache) == before + 1
    assert all(json.loads(o.text)["once"] in (True, False) for o in outs)


def test_a_prefill_workers_first_token_obeys_the_grammar(tiny_engine):
    params = SamplingParams(temperature=1.0, seed=3, structured=StructuredOutputs(choice=("yes", "no")))
    for i in range(8):
        req = tiny_engine.make_request(f"remote-{i}", f"prompt {i}", params)
        req.do_remote_decode = True  # as the prefill worker queues it: one token, then the KV is leased
        tiny_engine.add(req)
        outs = []
        while tiny_engine.has_unfinished_requests():
            outs += tiny_engine.step()
        first = tiny_engine.tokenizer.decode(outs[-1].new_token_ids)
        assert first and ("yes".startswith(first) or "no".startswith(first)), first
        tiny_engine.release_import(req)




def test_the_engine_refuses_forked_candidates_under_a_constraint_naming_n(tiny_engine):
    """Forked candidates carry no grammar of their own yet: the engine refuses them rather than sample
    them unconstrained (the ingress sends such candidates as separate requests)."""
    from engine.errors import InvalidRequestError
    from engine.sampling_params import SamplingParams, StructuredOutputs

    with pytest.raises(InvalidRequestError) as raised:
        tiny_engine.make_request("r", [5, 6, 7], SamplingParams(n=2, structured=StructuredOutputs(regex="[ab]+")))
    assert raised.value.field == "n"
    with pytest.raises(InvalidRequestError) as beams:
        SamplingParams(n=2, use_beam_search=True, max_reasoning_tokens=4)
    assert beams.value.field == "max_reasoning_tokens"
