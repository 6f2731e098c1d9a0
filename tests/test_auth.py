"""Bearer tokens: worker_runtime.auth parses `Authorization` once, and the OpenAI API's keys, the admin API's
key and the KV transfer servers' token all go through it, so they accept and refuse the same headers."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from cluster.admin_api import build_admin_router
from worker_runtime.auth import bearer_token, token_matches
from kv_transfer.server import _BearerTokenAuth
from router.api.auth import Authenticator
from router.api.openai_api import APIError

KEY = "s3cret-Key"

# header value -> the token it carries (None: refused)
HEADERS = [
    (None, None),                          # no header
    ("", None),
    ("   ", None),
    ("Bearer", None),                      # scheme, no token
    ("Bearer ", None),                     # empty token
    ("Bearer    ", None),
    ("Basic czNjcmV0LUtleQ==", None),      # another scheme
    ("Token s3cret-Key", None),
    ("s3cret-Key", None),                  # a bare key is no bearer header
    ("Bearers3cret-Key", None),
    (f"Bearer {KEY}", KEY),
    (f"bearer {KEY}", KEY),                # the scheme is case-insensitive
    (f"BEARER {KEY}", KEY),
    (f"BeArEr {KEY}", KEY),
    (f"Bearer   {KEY}  ", KEY),            # extra spaces around the token
    (f"  Bearer {KEY}", KEY),
    (f"Bearer\t{KEY}", KEY),
    (f"Bearer {KEY.lower()}", KEY.lower()),  # the token is case-sensitive (and then does not match)
    (f"Bearer {KEY} x", f"{KEY} x"),       # the token is everything after the scheme
]
# HTTP's white space is spaces and tabs, not Unicode's: a key and a no-break space is another key.
# (Headers only: an HTTP client will not send these.)
UNICODE_SPACES = [
    (f"Bearer {KEY}\u00a0", f"{KEY}\u00a0"),
    (f"Bearer\u00a0{KEY}", None),
    (f"Bearer {KEY}\u3000", f"{KEY}\u3000"),
]


@pytest.mark.parametrize("header,token", HEADERS + UNICODE_SPACES)
def test_bearer_token(header, token):
    assert bearer_token(header) == token


def test_token_matches():
    assert token_matches(KEY, KEY)
    assert not token_matches(KEY.lower(), KEY)
    assert not token_matches(KEY + "x", KEY) and not token_matches(KEY[:-1], KEY)
    assert not token_matches(None, KEY)
    assert not token_matches("", "")  # an unset secret lets nobody in
    assert token_matches("ключ", "ключ") and not token_matches("ключ", "ключи")  # non-ASCII compares as UTF-8


@pytest.mark.parametrize("header,token", HEADERS)
def test_the_ingress_the_admin_api_and_the_kv_server_agree(header, token):
    accepted = token == KEY

    auth = Authenticator({KEY: "tenant"})
    if accepted:
        assert auth.tenant(header) == "tenant"
    else:
        with pytest.raises(APIError) as info:
            auth.tenant(header)
        assert info.value.status == 401

    def no_controller():
        raise ValueError("no controller in this test")

    app = FastAPI()
    app.include_router(build_admin_router(no_controller, KEY))
    headers = {} if header is None else {"Authorization": header}
    status = TestClient(app).get("/admin/status", headers=headers).status_code
    assert status == (503 if accepted else 401)  # 503: past the key check, then no controller

    handler = SimpleNamespace(response_streaming=False, request_deserializer=None)
    metadata = () if header is None else (("authorization", header),)
    details = SimpleNamespace(invocation_metadata=metadata)
    got = _BearerTokenAuth(KEY).intercept_service(lambda _: handler, details)
    assert (got is handler) == accepted


def test_the_admin_key_is_checked_before_the_body():
    """A caller without the admin key learns nothing from validation errors: a bad body gets 401 too."""
    def no_controller():
        raise ValueError("no controller in this test")

    app = FastAPI()
    app.include_router(build_admin_router(no_controller, KEY))
    client = TestClient(app)
    def post(path: str, body: str, token: str | None):
        headers = {"Content-Type": "application/json"} | ({} if token is None else {"Authorization": f"Bearer {token}"})
        return client.post(path, content=body, headers=headers)

    for path, body in (("/admin/scale", '{"pool": "decode"}'), ("/admin/drain", '{"worker": 1}'),
                       ("/admin/scale", "not json")):
        assert post(path, body, "tenant-key").status_code == 401 and post(path, body, None).status_code == 401
        got = post(path, body, KEY)
        assert got.status_code == 400 and got.json()["error"]["type"] == "invalid_request_error"
    disabled = FastAPI()
    disabled.include_router(build_admin_router(no_controller, None))
    assert TestClient(disabled).post("/admin/scale", json={"pool": "decode"}).status_code == 403


def test_a_bare_key_is_never_its_own_tenant():
    """A key given without a tenant gets one named after its digest: the key itself would show wherever a
    tenant does (logs, the cache salt in KV events and worker state)."""
    from cluster.cli import _api_key
    from cluster.config import key_tenant, parse_api_keys

    keys = parse_api_keys("s3cret-Key, other-key:team-b")
    assert keys == {"s3cret-Key": key_tenant("s3cret-Key"), "other-key": "team-b"}
    assert "s3cret" not in key_tenant("s3cret-Key") and key_tenant("s3cret-Key") != key_tenant("s3cret-Kez")
    assert _api_key("s3cret-Key") == ("s3cret-Key", key_tenant("s3cret-Key"))
    assert Authenticator(keys).tenant("Bearer s3cret-Key") == key_tenant("s3cret-Key")
