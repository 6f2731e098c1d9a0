"""The CLI's side of the admin API (cluster/admin_api.py): plain HTTP, errors turned into next steps."""
from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request


class CLIError(Exception):
    """A failure an operator can act on; the message says what to run next. The CLI prints it, no traceback."""


class AdminClient:
    """Calls a running tandem server's /admin routes with its admin key. Scale and drain wait for the
    server to finish (a worker start or a drain can take minutes), hence the long default timeout."""

    def __init__(self, url: str, admin_key: str | None, timeout_s: float = 900.0):
        self.url = url.rstrip("/")
        self.admin_key = admin_key
        self.timeout_s = timeout_s

    def status(self) -> dict:
        return self.call("GET", "/admin/status")

    def scale(self, targets: dict[str, int], model: str | None = None) -> dict:
        return self.call("POST", "/admin/scale", {**targets, **({"model": model} if model else {})})

    def drain(self, worker_id: str, model: str | None = None) -> dict:
        return self.call("POST", "/admin/drain", {"worker_id": worker_id, **({"model": model} if model else {})})

    def trace(self, request_id: str) -> dict:
        return self.call("GET", f"/admin/requests/{urllib.parse.quote(request_id, safe='')}/trace")

    def call(self, method: str, path: str, body: dict | None = None) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.admin_key:
            headers["Authorization"] = f"Bearer {self.admin_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as exc:
            raise CLIError(self._explain(exc.code, _error_message(exc.read()))) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):  # socket.timeout is TimeoutError
                raise CLIError(f"{self.url} did not answer within {self.timeout_s:.0f} s; check the server's "
                               f"log, then `tandem status --url {self.url}`") from None
            raise CLIError(f"no tandem server at {self.url} ({reason}); start one with `make run` "
                           f"(or `tandem serve`), or point --url at a running one") from None
        except json.JSONDecodeError:
            raise CLIError(f"{self.url}{path} did not answer with JSON; is it a tandem server?") from None

    def _explain(self, status: int, message: str | None) -> str:
        if status == 401:
            return (f"{self.url} rejected the admin key; pass the server's key with --admin-key KEY "
                    f"or set TANDEM_ADMIN_KEY")
        if status == 403:
            return (f"{message or 'the admin API is disabled'}; restart the server with --admin-key KEY "
                    f"(or TANDEM_ADMIN_KEY set), then pass the same key here")
        if status == 404 and message in (None, "Not Found"):
            return f"{self.url} has no tandem admin API; is --url pointing at a tandem server?"
        if status == 404:
            return message
        if status == 400:
            return f"the server refused the request: {message}"
        return f"the server failed ({status}): {message or 'no details'}; see the server's log"


def _error_message(body: bytes) -> str | None:
    """The message of an OpenAI-style error body; None when the body is not one (e.g. a bare 404)."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("message") if isinstance(error, dict) else None
