"""Hostile input over HTTP gets an OpenAI-style 4xx naming what to change, never a 5xx, and the server
goes on serving: oversized and chunked bodies, deep nesting, invalid UTF-8, enormous numbers, thousands
of stop strings, a vocabulary-sized logit_bias, out-of-range seeds, a tiny temperature, bad headers."""
import json
import socket
from urllib.parse import urlsplit

import pytest
import requests

from router.api.request_limits import RequestLimits
from tests.ingress.conftest import MODEL

LIMITS = RequestLimits()
COMPLETION = {"model": MODEL, "prompt": "Hello there", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def error(response) -> tuple[int, str | None]:
    body = response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    return response.status_code, body["param"]


def raw_post(app, path: str, body: bytes, headers: dict[str, str], key: str = "key-a") -> requests.Response:
    return requests.post(f"{app.base_url}{path}", data=body, timeout=60,
                         headers={"Authorization": f"Bearer {key}", **headers})


def test_a_body_over_the_limit_is_413_by_its_content_length(main_app):
    body = json.dumps({**COMPLETION, "prompt": "x" * (LIMITS.max_body_bytes + 1)}).encode()
    response = raw_post(main_app, "/v1/completions", body, {"Content-Type": "application/json"})
    assert error(response) == (413, None)
    assert response.json()["error"]["code"] == "request_too_large"


def test_a_chunked_body_over_the_limit_is_413_while_it_streams_in(main_app):
    chunk = b" " * 2**20

    def body():  # no Content-Length: the server only learns the size by reading
        yield b'{"model": "tiny-llama", "prompt": "a", "user": "'
        for _ in range(LIMITS.max_body_bytes // len(chunk) + 2):
            yield chunk
        yield b'"}'

    response = raw_post(main_app, "/v1/completions", body(), {"Content-Type": "application/json"})
    assert "content-length" not in response.request.headers
    assert error(response) == (413, None)


@pytest.mark.parametrize("body", [
    b'{"model": "tiny-llama", "prompt": "a", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "tiny-llama", "prompt": ' + b"[" * 5_000 + b"]" * 5_000 + b"}",
    b'{"model": "tiny-llama", "prompt": "\xff\xfe\xc3\x28"}',
    b'\xef\xbb\xbf\xff{"model": "tiny-llama"}',
    b'{"model": "tiny-llama", "prompt": "\\ud800"}',
    b'{"model": "tiny-llama", "prompt": "a", "max_tokens": 1' + b"0" * 5_000 + b"}",
    b"",
    b"null",
    b"[]",
    b'"a string"',
], ids=["deep-nesting", "deep-prompt", "invalid-utf8", "bad-bom", "lone-surrogate", "huge-number", "empty",
        "null", "array", "string"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json_is_400(main_app, path, body):
    response = raw_post(main_app, path, body, {"Content-Type": "application/json"})
    assert error(response)[0] == 400


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 10**30), ("max_tokens", 2**63), ("max_tokens", 2**31),
    ("stop", ["s%d" % i for i in range(5000)]), ("stop", "y" * (LIMITS.max_stop_string_chars + 1)),
    ("stop", ["ok", "z" * 100_000]), ("stop_token_ids", list(range(LIMITS.max_stop_token_ids + 1))),
    ("logit_bias", {str(t): 1.0 for t in range(49152)}), ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 10**30),
    ("top_k", 2**63), ("n", 10**20), ("temperature", 1e308), ("logprobs", 10**12), ("min_tokens", 10**30),
])
def test_out_of_range_fields_are_400_naming_them(main_app, field, value):
    assert error(main_app.post("/v1/completions", {**COMPLETION, field: value})) == (400, field)


def test_limits_hold_for_chat_too(main_app):
    body = {**CHAT, "stop": ["s"] * (LIMITS.max_stop_strings + 1)}
    assert error(main_app.post("/v1/chat/completions", body)) == (400, "stop")
    body = {**CHAT, "logit_bias": {str(t): -1.0 for t in range(LIMITS.max_logit_bias + 1)}}
    assert error(main_app.post("/v1/chat/completions", body)) == (400, "logit_bias")


def test_extreme_seeds_in_range_are_served(main_app):
    for seed in (2**63 - 1, -2**63, 0):
        response = main_app.post("/v1/completions", {**COMPLETION, "seed": seed, "n": 2, "temperature": 1.0})
        assert response.status_code == 200, response.text
        assert len(response.json()["choices"]) == 2


def test_a_tiny_positive_temperature_answers_like_greedy(main_app):
    body = {**COMPLETION, "prompt": "Once upon a time", "max_tokens": 12, "ignore_eos": True, "seed": 3}
    greedy = main_app.post("/v1/completions", {**body, "temperature": 0.0}).json()["choices"][0]["text"]
    for temperature in (1e-300, 1e-20, 1e-6):
        response = main_app.post("/v1/completions", {**body, "temperature": temperature, "logprobs": 2})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert choice["text"] == greedy
        assert all(isinstance(lp, float) for lp in choice["logprobs"]["token_logprobs"])


@pytest.mark.parametrize("authorization", [
    "Bearer", "Bearer ", "Bearer key-a extra", "Basic a2V5LWE=", "key-a", "Bearer " + "k" * 8000,
    "Bearer \u00ff\u00fe", "Bearer key-a\u00a0",
])
def test_bad_authorization_is_401(main_app, authorization):
    headers = {"Authorization": authorization.encode("latin-1"), "Content-Type": "application/json"}
    response = requests.post(f"{main_app.base_url}/v1/completions", data=json.dumps(COMPLETION), headers=headers,
                             timeout=60)
    assert error(response) == (401, None)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          "application/jsonx", "\u00e9", ""])
def test_a_body_that_is_not_json_by_its_content_type_is_415(main_app, content_type):
    response = raw_post(main_app, "/v1/completions", json.dumps(COMPLETION).encode(),
                        {"Content-Type": content_type.encode("latin-1")})
    assert error(response) == (415, None)


def test_json_content_types_with_parameters_are_served(main_app):
    for content_type in ("application/json; charset=utf-8", "Application/JSON", "application/vnd.api+json"):
        response = raw_post(main_app, "/v1/completions", json.dumps(COMPLETION).encode(),
                            {"Content-Type": content_type})
        assert response.status_code == 200, (content_type, response.text)


def http_exchange(app, request: bytes) -> bytes:
    """Send raw bytes and read what comes back until the server closes or goes quiet."""
    url = urlsplit(app.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
        sock.sendall(request)
        sock.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := sock.recv(65536):
            out += chunk
        return out


@pytest.mark.parametrize("content_length", [b"abc", b"-5", b"1" * 40, b"12, 13", b"0x10"])
def test_a_malformed_content_length_is_4xx(main_app, content_length):
    path = urlsplit(main_app.base_url).path
    body = json.dumps(COMPLETION).encode()
    request = (b"POST " + path.encode() + b"/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer key-a\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + content_length + b"\r\nConnection: close\r\n\r\n" + body)
    status_line = http_exchange(main_app, request).split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 4"), status_line


def test_a_content_length_shorter_than_the_body_is_4xx_and_the_rest_is_not_a_request(main_app):
    path = urlsplit(main_app.base_url).path
    body = json.dumps(COMPLETION).encode()
    request = (b"POST " + path.encode() + b"/v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Authorization: Bearer key-a\r\nContent-Type: application/json\r\n"
               b"Content-Length: 10\r\n\r\n" + body)
    reply = http_exchange(main_app, request)
    statuses = [line for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.1 ")]
    assert statuses and all(s.startswith(b"HTTP/1.1 4") for s in statuses), reply[:300]


def test_the_server_still_serves_after_all_this(main_app):
    assert main_app.get("/health").status_code == 200
    response = main_app.client().completions.create(**COMPLETION)
    assert response.choices[0].finish_reason in ("length", "stop") and response.usage.completion_tokens >= 1
    chat = main_app.client().chat.completions.create(**CHAT)
    assert chat.choices[0].message.content is not None
