"""Every way a request can be refused, with OpenAI's error shape naming the field; and a client that goes
away mid-stream, which must abort the request on every worker."""
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import wait_for
from tests.ingress.conftest import MODEL

COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def error(response) -> tuple[int, str | None, str]:
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return response.status_code, body["param"], body["type"]


def test_missing_api_key_is_401(main_app):
    response = main_app.post("/v1/completions", COMPLETION, key=None)
    assert error(response) == (401, None, "invalid_request_error")
    assert response.headers["WWW-Authenticate"] == "Bearer"


def test_wrong_api_key_is_401_for_the_openai_client(main_app):
    with pytest.raises(openai.AuthenticationError):
        main_app.client(key="not-a-key").completions.create(**COMPLETION)
    with pytest.raises(openai.AuthenticationError):
        main_app.client(key="not-a-key").models.list()


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.5), ("temperature", "hot"), ("top_p", 0), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3), ("repetition_penalty", 0), ("n", 0), ("n", 1.5),
    ("max_tokens", 0), ("min_tokens", 20), ("logprobs", 21), ("stop", [""]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [10**7]), ("logit_bias", {"x": 1}), ("logit_bias", {"5": 500}), ("seed", 1.5),
    ("stream", "yes"), ("speculative", "yes"), ("prompt", []), ("prompt", [10**7]), ("prompt", ""), ("cache_salt", ""), ("echo", True),
    ("stream_options", {"include_usage": "yes"}), ("no_such_field", 1),
])
def test_bad_completion_field_is_400_naming_it(main_app, field, value):
    assert error(main_app.post("/v1/completions", {**COMPLETION, field: value})) == (
        400, field, "invalid_request_error")


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_chat_field_is_400_naming_it(main_app, body, param):
    assert error(main_app.post("/v1/chat/completions", {**CHAT, **body})) == (400, param, "invalid_request_error")


def test_prompt_longer_than_the_context_is_400_on_the_prompt(main_app):
    response = main_app.post("/v1/completions", {**COMPLETION, "prompt": [5] * 512})
    assert error(response) == (400, "prompt", "invalid_request_error")


def test_prompt_plus_max_tokens_over_the_context_is_400_on_max_tokens(main_app):
    response = main_app.post("/v1/completions", {**COMPLETION, "prompt": [5] * 500, "max_tokens": 13})
    assert error(response) == (400, "max_tokens", "invalid_request_error")
    chat = main_app.post("/v1/chat/completions", {**CHAT, "max_completion_tokens": 600})
    assert error(chat) == (400, "max_completion_tokens", "invalid_request_error")


def test_body_that_is_not_json_is_400(main_app):
    response = main_app.post("/v1/completions", None, data=b"{not json")
    assert error(response) == (400, None, "invalid_request_error")


def test_unknown_model_is_404(main_app):
    with pytest.raises(openai.NotFoundError) as raised:
        main_app.client().completions.create(**{**COMPLETION, "model": "gpt-9"})
    assert raised.value.body["param"] == "model" and raised.value.body["code"] == "model_not_found"


def test_unknown_route_is_404_with_an_openai_error(main_app):
    assert error(main_app.post("/v1/embeddings", {"model": MODEL, "input": "x"}))[0] == 404


def test_admission_bound_answers_429_with_retry_after(aux_app):
    # aux admits at most two sequences: two held-open streams fill it.
    long = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    held = [aux_app.post("/v1/completions", long, key=None, stream=True) for _ in range(2)]
    # Keep the line iterators: a dropped one closes its connection, which ends the stream.
    streams = [r.iter_lines() for r in held]
    try:
        assert [r.status_code for r in held] == [200, 200]
        for lines in streams:
            next(lines)
        refused = aux_app.post("/v1/completions", {**COMPLETION, "max_tokens": 2}, key=None)
        assert error(refused) == (429, None, "rate_limit_exceeded")
        assert int(refused.headers["Retry-After"]) >= 1
    finally:
        for r in held:
            r.close()
    assert wait_for(lambda: aux_app.post("/v1/completions", COMPLETION, key=None).status_code == 200)


def test_more_candidates_than_the_bound_could_ever_admit_is_400_on_n(aux_app):
    response = aux_app.post("/v1/completions", {**COMPLETION, "n": 3}, key=None)
    assert error(response) == (400, "n", "invalid_request_error")


def test_client_disconnect_mid_stream_aborts_on_every_worker(main_app):
    # A prompt past max_local_prefill_length: prefill and decode workers both hold the request.
    body = {"model": MODEL, "prompt": list(range(100, 200)), "max_tokens": 400, "stream": True,
            "ignore_eos": True}
    actors = main_app.actors()
    decode_before = {w: s.generation_tokens for w, s in main_app.stats().items() if w.startswith("decode")}
    aborted_before = aborted_requests(main_app.get("/metrics").text)
    response = main_app.post("/v1/completions", body, stream=True)
    lines = response.iter_lines()
    for _ in range(3):
        next(lines)
    response.close()

    def idle() -> bool:
        stats = main_app.stats()
        in_flight = ray.get([a.num_in_flight.remote() for a in actors.values()])
        return all(s.num_active_blocks == 0 for s in stats.values()) and not any(in_flight)

    assert wait_for(idle)
    generated = sum(s.generation_tokens for w, s in main_app.stats().items() if w.startswith("decode"))
    assert generated - sum(decode_before.values()) < 400  # stopped early: it did not run to the end
    assert wait_for(lambda: aborted_requests(main_app.get("/metrics").text) == aborted_before + 1)


def aborted_requests(metrics_text: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(metrics_text)
               for sample in family.samples
               if sample.name == "vllm:request_success_total" and sample.labels["finished_reason"] == "abort")


def test_concurrent_requests_beyond_serve_limits_never_hang(aux_app):
    # Overload: every request is either served or refused with 429, none is left waiting.
    def call() -> int:
        return aux_app.post("/v1/completions", {**COMPLETION, "max_tokens": 8}, key=None).status_code

    with ThreadPoolExecutor(8) as pool:
        statuses = [f.result(timeout=120) for f in [pool.submit(call) for _ in range(8)]]
    assert set(statuses) <= {200, 429} and 200 in statuses
