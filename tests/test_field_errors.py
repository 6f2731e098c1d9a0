"""engine.errors.first_field_error: the one reading of a pydantic error into the field it names, shared
by the OpenAI API's 400s, the admin API's 400s and the config loader's ConfigError."""
from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field, ValidationError, model_validator

from cluster.admin_api import build_admin_router
from cluster.config import ConfigError, load_config
from engine.errors import FieldError, first_field_error
from router.api.openai_api import APIError, CompletionRequest, parse_body


class Inner(BaseModel):
    n: int = Field(ge=0)


class Outer(BaseModel):
    items: list[Inner] = []
    body: int = 0  # a field named like FastAPI's root, to check only the root is dropped
    a: int = 0
    b: int = 0

    @model_validator(mode="after")
    def _a_le_b(self):
        if self.a > self.b:
            raise ValueError("a must not exceed b")
        return self


def error_of(**data) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        Outer.model_validate(data)
    return info.value


def test_nested_location_becomes_a_dotted_path():
    first = first_field_error(error_of(items=[{"n": 1}, {"n": -1}]))
    assert first.loc == ("items", "1", "n") and first.path == "items.1.n"  # list indexes as strings
    assert first.type == "greater_than_equal" and "greater than or equal to 0" in first.message


def test_a_whole_model_problem_has_an_empty_path():
    first = first_field_error(error_of(a=2, b=1))
    assert first == FieldError((), "Value error, a must not exceed b", "value_error") and first.path == ""


def test_only_the_first_error_counts():
    assert first_field_error(error_of(items=[{"n": -1}], a="x")).path == "items.0.n"


def test_root_is_dropped_from_the_front_only():
    exc = error_of(body="x")
    assert first_field_error(exc).path == "body"
    assert first_field_error(exc, root="body").path == ""  # its own root: what FastAPI's "body" is

    class Fake:  # FastAPI's RequestValidationError: ("body", ...) locations, same .errors() shape
        def errors(self):
            return [{"loc": ("body", "items", 0, "body"), "msg": "bad", "type": "t"}]

    assert first_field_error(Fake(), root="body") == FieldError(("items", "0", "body"), "bad", "t")
    assert first_field_error(Fake()).path == "body.items.0.body"


def test_invalid_json_keeps_its_type():
    with pytest.raises(ValidationError) as info:
        Outer.model_validate_json(b"{nope")
    assert first_field_error(info.value).type == "json_invalid"


# ---- the three users --------------------------------------------------------------------------------

def test_openai_api_names_the_top_level_field():
    with pytest.raises(APIError) as info:
        parse_body(CompletionRequest, b'{"model": "m", "prompt": "hi", "temperature": "hot"}')
    assert info.value.status == 400 and info.value.param == "temperature"
    assert info.value.message.startswith("temperature: ")
    with pytest.raises(APIError) as info:
        parse_body(CompletionRequest, b"{nope")
    assert info.value.param is None and info.value.message.startswith("the body is not valid JSON")


def test_config_names_the_dotted_field():
    with pytest.raises(ConfigError, match=r"invalid config field 'prefill.replicas': .*greater than or equal"):
        load_config(**{"prefill.replicas": -1})


def test_admin_api_names_the_field_without_fastapis_body_root():
    app = FastAPI()
    app.include_router(build_admin_router(lambda: None, "k"))
    client = TestClient(app)
    headers = {"Authorization": "Bearer k"}
    error = client.post("/admin/drain", json={"worker_id": ""}, headers=headers).json()["error"]
    assert error["param"] == "worker_id" and error["message"].startswith("invalid admin request: ")
    error = client.post("/admin/scale", json={"pool": "decode"}, headers=headers).json()["error"]
    assert error["param"] is None and "give `pool` and `replicas` together" in error["message"]
