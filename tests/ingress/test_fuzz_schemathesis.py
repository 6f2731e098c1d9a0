"""Schemathesis fuzzes every operation of the live app's own /openapi.json, with bodies that fit the
schema and bodies that break it: no response is a 5xx, every error (a status of 400 or more, or an error
event in a stream) has OpenAI's error shape, and the server still answers a normal request afterwards.

Derandomized and bounded (a fixed number of examples per operation and mode, no shrinking), so a run is
repeatable and takes under a minute after the apps are up. It runs on `main` before test_routing_e2e kills main's decode workers
(modules run in file-name order), and with a tenant's key only: the admin API answers 401 here, so the
fuzzer cannot scale or drain the workers the other tests use."""
from __future__ import annotations

import json
from collections import Counter

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from tests.ingress.conftest import MODEL

AUTH = {"Authorization": "Bearer key-a"}
EXAMPLES = {GenerationMode.POSITIVE: 25, GenerationMode.NEGATIVE: 50}
ERROR_FIELDS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def api_schema(main_app):
    response = requests.get(f"{main_app.base_url}/openapi.json", headers=AUTH, timeout=30)
    assert response.status_code == 200
    return schemathesis.openapi.from_dict(response.json())


def operations(schema) -> list:
    return [result.ok() for result in schema.get_all_operations()]


def error_shape_problem(body) -> str | None:
    """Why `body` is not `{"error": {"message", "type", "param", "code"}}` with a message; None if it is."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_FIELDS:
        return f"not OpenAI's error shape: {body!r:.300}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"an error without a message: {body!r:.300}"
    return None


def problems(response) -> list[str]:
    """What is wrong with one of schemathesis' responses (its headers map names to lists of values)."""
    found = []
    if response.status_code >= 500:
        found.append(f"HTTP {response.status_code}: {response.text[:300]}")
    if response.status_code >= 400:
        try:
            problem = error_shape_problem(response.json())
        except ValueError:
            problem = f"a {response.status_code} whose body is not JSON: {response.text[:300]!r}"
        found += [problem] if problem else []
    elif any(k.lower() == "content-type" and v[0].startswith("text/event-stream") for k, v in response.headers.items()):
        for line in response.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]" and '"error"' in line:
                problem = error_shape_problem(json.loads(line[len("data: "):]))
                found += [f"stream error event: {problem}"] if problem else []
    return found


def test_the_openapi_schema_describes_the_generation_endpoints_with_their_bodies(api_schema):
    posts = {op.path: op for op in operations(api_schema) if op.method.upper() == "POST"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert path in posts
        assert posts[path].body, f"{path} has no request body in the schema"


@pytest.mark.parametrize("mode", list(EXAMPLES), ids=str)
def test_fuzzed_requests_to_every_operation_get_no_5xx_and_only_openai_shaped_errors(main_app, api_schema, mode):
    found: list[str] = []
    statuses: Counter = Counter()
    for operation in operations(api_schema):
        if mode is GenerationMode.NEGATIVE and not (operation.body or operation.query or operation.headers):
            continue  # nothing in it to break

        @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(operation.as_strategy(generation_mode=mode))
        def fuzz(case):
            if mode is GenerationMode.POSITIVE and isinstance(case.body, dict) and "model" in case.body:
                case.body["model"] = MODEL  # past the model check, into tokenization and generation
            response = case.call(base_url=main_app.base_url, headers=AUTH, timeout=60)
            statuses[(case.method, case.path, response.status_code)] += 1
            found.extend(f"{case.method} {case.path} {case.body!r:.200}: {p}" for p in problems(response))

        fuzz()
    print(sorted(statuses.items()))
    assert found == [], "\n".join(found[:20])
    if mode is GenerationMode.POSITIVE:  # the fuzzing reached generation, not only the validation in front
        assert statuses[("POST", "/v1/completions", 200)] and statuses[("POST", "/v1/chat/completions", 200)]


def test_the_server_still_answers_a_normal_request_after_the_fuzzing(main_app):
    completion = main_app.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=4,
                                                      temperature=0)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4
