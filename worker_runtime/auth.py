"""Bearer tokens: the one parser of `Authorization: Bearer <token>` and the one way to compare a token.

The OpenAI API's keys, the admin API's key and the KV transfer servers' shared token all arrive in
this header (gRPC metadata for the KV servers). Plain string code, so every room may use it.
"""
from __future__ import annotations

import hmac
import re


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization` header value, or None: no header, another scheme than
    Bearer (matched case-insensitively, as RFC 9110 says), or no token. White space around the
    scheme and the token is ignored: HTTP's white space, spaces and tabs (RFC 9110), not Unicode's, so
    a key followed by a no-break space is another key."""
    parts = _HTTP_SPACE.split((authorization or "").strip(" \t"), maxsplit=1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    return parts[1] or None


_HTTP_SPACE = re.compile(r"[ \t]+")


def token_matches(given: str | None, expected: str) -> bool:
    """Whether `given` is `expected`, compared in constant time (for a given length). An empty
    `expected` matches nothing: a secret that was never set must not let the empty token in."""
    if given is None or not expected:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())

