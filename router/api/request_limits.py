"""What one request may ask of the ingress: bounds on the body and on the sampling fields that cost work
per token, each refused with an OpenAI-style 4xx naming what to change; and the bounded thread pool that
tokenizes and renders chat templates off the event loop.

The body is bounded before it is parsed: by its Content-Length, and while it streams in (a chunked body
has none), so a huge body is refused without being held in memory.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import ClientDisconnect, Request

from engine.sampling_params import MAX_STOP_STRINGS
from router.api.openai_api import APIError

T = TypeVar("T")


class RequestLimits(BaseModel):
    """The ingress's limits (`limits:` in the cluster config). The defaults leave room for any prompt
    that fits a 128k-token context and for what OpenAI's API accepts."""
    model_config = ConfigDict(extra="forbid")

    max_body_bytes: int = Field(8 * 2**20, ge=1024)
    max_stop_strings: int = Field(MAX_STOP_STRINGS, ge=0, le=MAX_STOP_STRINGS)
    max_stop_string_chars: int = Field(1024, ge=1)
    max_stop_token_ids: int = Field(256, ge=0)
    max_logit_bias: int = Field(1024, ge=0)
    # Tokenizations and chat templates running at once; more wait for a thread, never on the event loop.
    tokenizer_threads: int = Field(2, ge=1, le=64)

    def check_sampling(self, req) -> None:
        """Refuse a generation request whose stop strings, stop_token_ids or logit_bias exceed the limits."""
        stop = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stop) > self.max_stop_strings:
            raise _too_many("stop", len(stop), self.max_stop_strings, "strings")
        if any(len(s) > self.max_stop_string_chars for s in stop):
            longest = max(len(s) for s in stop)
            raise APIError.bad_request(f"stop strings may be at most {self.max_stop_string_chars} characters "
                                       f"long; one has {longest}", "stop")
        if len(req.stop_token_ids or ()) > self.max_stop_token_ids:
            raise _too_many("stop_token_ids", len(req.stop_token_ids), self.max_stop_token_ids, "token ids")
        if len(req.logit_bias or ()) > self.max_logit_bias:
            raise _too_many("logit_bias", len(req.logit_bias), self.max_logit_bias, "entries")


def _too_many(field: str, got: int, limit: int, what: str) -> APIError:
    return APIError.bad_request(f"{field} may hold at most {limit} {what}; got {got}", field)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server accepts ({limit} bytes)",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) as soon as it is known to exceed `limit` bytes; a body whose
    Content-Type is not JSON is refused (415) unread."""
    content_type = request.headers.get("content-type")
    if content_type is not None and not _is_json(content_type):
        raise APIError(415, f"Content-Type must be application/json, got {content_type!r}",
                       code="unsupported_media_type")
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isascii() or not length.isdigit():
            raise APIError.bad_request(f"Content-Length must be a number of bytes, got {length!r}", None)
        if len(length) > 18 or int(length) > limit:  # int() of thousands of digits raises
            raise too_large(limit)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        raise APIError.bad_request("the client closed the connection before the body was complete", None) from None
    return b"".join(chunks)


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class TokenizerPool:
    """Runs tokenization and chat templating on a few threads, so a huge prompt never holds up the
    event loop that streams other requests' tokens. The tokenizer's own work releases the GIL."""

    def __init__(self, num_threads: int):
        self.executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tokenize")

    async def run(self, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` on a pool thread; cancelling the caller drops it if it has not started yet."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
