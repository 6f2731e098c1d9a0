"""The ingress's pure pieces, without a cluster: tenant salts, keys, admission, body validation."""
import asyncio
import json

import pytest

from router.api.admission import Admission
from router.api.auth import Authenticator, cache_salt
from router.api.openai_api import APIError, ChatCompletionRequest, CompletionRequest, parse_body
from router.api.request_trace import Trace


def test_tenants_get_distinct_salts_that_no_request_salt_can_forge():
    assert cache_salt(None, None) is None and cache_salt(None, "s") == "s"
    assert cache_salt("a", None) != cache_salt("b", None)
    assert cache_salt("a", "x") != cache_salt("a", None) != cache_salt("a", "y")
    # Tenant "a" choosing cache_salt "x" must not land on tenant "a/x"'s blocks.
    assert cache_salt("a", "x") != cache_salt("a/x", None)


def test_keys_map_to_tenants_and_anything_else_is_401():
    auth = Authenticator({"k1": "team-1", "k2": "team-2"})
    assert auth.tenant("Bearer k2") == "team-2" and auth.tenant("bearer  k1 ") == "team-1"
    for header in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1"):
        with pytest.raises(APIError) as raised:
            auth.tenant(header)
        assert raised.value.status == 401
    assert Authenticator({}).tenant(None) is None


def test_admission_refuses_beyond_the_bound_until_slots_are_released():
    admission = Admission(3)
    first = admission.acquire(2)
    with pytest.raises(APIError) as raised:
        admission.acquire(2)
    assert raised.value.status == 429 and raised.value.headers["Retry-After"] == "1"
    first.release()
    first.release()  # idempotent
    assert admission.in_flight == 0
    admission.acquire(3)
    with pytest.raises(APIError) as too_big:
        Admission(3).acquire(4)
    assert (too_big.value.status, too_big.value.param) == (400, "n")


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, b'{"model": "m", "prompt": "x", "top_k": "5"}', "top_k"),
    (CompletionRequest, b'{"model": "m"}', "prompt"),
    (CompletionRequest, b'[1, 2]', None),
    (ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "messages"),
])
def test_body_errors_name_the_top_level_field(model, body, param):
    with pytest.raises(APIError) as raised:
        parse_body(model, body)
    assert (raised.value.status, raised.value.param) == (400, param)


def test_chat_parameters_map_to_sampling_params():
    req = parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "developer", "content": '
                                            b'[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], '
                                            b'"logprobs": true, "top_logprobs": 3, "max_completion_tokens": 7, '
                                            b'"logit_bias": {"11": -100}, "stop": "END", "seed": 4}')
    assert req.messages[0].template_dict() == {"role": "system", "content": "ab"}
    params = req.sampling_params(req.requested_max_tokens, vocab_size=100)
    assert (params.logprobs, params.max_tokens, params.logit_bias, params.stop, params.seed) == (
        3, 7, {11: -100.0}, ["END"], 4)


def test_unknown_and_unsupported_fields_are_told_apart():
    with pytest.raises(APIError) as unknown:
        parse_body(CompletionRequest, b'{"model": "m", "prompt": "x", "temprature": 0}')
    assert unknown.value.param == "temprature" and "not a field" in unknown.value.message
    with pytest.raises(APIError) as unsupported:
        parse_body(ChatCompletionRequest,
                   b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "prediction": {}}')
    assert unsupported.value.param == "prediction" and "not supported" in unsupported.value.message


def test_fields_without_effect_are_accepted_and_named_for_the_log():
    req = parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                            b'"metadata": {"a": "b"}, "store": true, "user": "u", '
                                            b'"parallel_tool_calls": false, "service_tier": "auto"}')
    assert req.ignored_fields() == ["metadata", "parallel_tool_calls", "service_tier", "store", "user"]
    with pytest.raises(APIError) as typed:  # accepted means typed, not anything goes
        parse_body(ChatCompletionRequest, b'{"model": "m", "messages": [{"role": "user", "content": "x"}], '
                                          b'"metadata": [1]}')
    assert typed.value.param == "metadata"


@pytest.mark.parametrize("kwargs", [{"return_tensors": "pt"}, {"tokenize": False}, {"messages": "x"},
                                    {"truncation": True}])
def test_chat_template_kwargs_cannot_reach_apply_chat_templates_own_parameters(kwargs):
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": kwargs}
    req = parse_body(ChatCompletionRequest, json.dumps(body).encode())
    with pytest.raises(APIError) as raised:
        req.template_options()
    assert raised.value.param == "chat_template_kwargs"


def test_a_candidate_that_ends_in_error_gives_a_500_with_its_message_not_an_empty_200(tokenizer):
    from engine.outputs import RequestOutput
    from router.api.service import ModelInfo, OpenAIService

    class FailingRequests:  # what the RequestRouter yields when a worker died and nowhere could take over
        def would_wait(self, *placement):  # placed now, it would not wait for a prefill slot
            return False

        async def stream(self, request, block_hashes, on_placed=None):
            on_placed()
            yield RequestOutput(request.request_id, [5], "a", num_prompt_tokens=3)
            yield RequestOutput(
                request.request_id, [], "", finished=True, finish_reason="error",
                error="worker decode-0 failed mid-stream (ActorDiedError) and the request cannot move on")

    service = OpenAIService(ModelInfo("m", tokenizer.vocab_size, 512, 0), tokenizer, Authenticator({}), Admission(4),
                            FailingRequests(), block_size=16)
    trace = Trace.from_headers({"X-Request-Id": "failed-1"})
    with pytest.raises(APIError) as raised:
        asyncio.run(service.completions(b'{"model": "m", "prompt": "Hi"}', None, trace))
    assert raised.value.status == 500 and "decode-0 failed mid-stream" in raised.value.message
    assert service.admission.in_flight == 0
    # The failed request's timeline is kept for `tandem trace`: it shows how far the request got.
    [timeline] = service.traces.get("failed-1")
    assert {"arrival", "validated", "tokenized"} <= set(timeline.times)
