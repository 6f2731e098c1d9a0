"""/openapi.json, /docs and /redoc follow the API-key rule of every other route: with keys configured a
missing or wrong key gets the OpenAI-shaped 401, without keys they stay open. Tested on the FastAPI app
the ingress serves (`build_api`), with a service that only authenticates."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from router.api.auth import Authenticator
from router.api.ingress import build_api
from router.api.request_limits import RequestLimits

KEY = "key-a"
DOCS = ["/openapi.json", "/docs", "/redoc"]


def client(api_keys: dict[str, str], root_path: str = "") -> TestClient:
    async def scrape() -> bytes:
        return b""

    service = SimpleNamespace(auth=Authenticator(api_keys), model=SimpleNamespace(name="m"))
    return TestClient(build_api(service, SimpleNamespace(), scrape, RequestLimits()), root_path=root_path)


@pytest.mark.parametrize("path", DOCS)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_docs_refuse_a_missing_or_wrong_key(path, headers):
    response = client({KEY: "tenant-a"}).get(path, headers=headers)
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("api_keys, headers", [({KEY: "tenant-a"}, {"Authorization": f"Bearer {KEY}"}),
                                               ({}, {})])
def test_docs_serve_with_a_valid_key_or_when_no_keys_are_configured(api_keys, headers):
    api = client(api_keys)
    schema = api.get("/openapi.json", headers=headers)
    assert schema.status_code == 200
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(schema.json()["paths"])
    assert not set(DOCS) & set(schema.json()["paths"])
    for page in ("/docs", "/redoc"):
        response = api.get(page, headers=headers)
        assert response.status_code == 200 and "/openapi.json" in response.text


def test_docs_point_at_the_schema_under_the_apps_route_prefix():
    """Serve mounts each application under its route prefix (root_path); the pages and the schema's
    servers must name it, or the viewers fetch and try requests outside the app."""
    api = client({}, root_path="/main")
    assert api.get("/main/openapi.json").json()["servers"] == [{"url": "/main"}]
    assert "/main/openapi.json" in api.get("/main/docs").text
    assert "/main/openapi.json" in api.get("/main/redoc").text
