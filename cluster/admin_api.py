"""The admin API behind `tandem status / scale / drain`: routes under /admin with their own key.

    GET  /admin/status                          pools, workers, health, load, KV usage, prefix hit rates
    POST /admin/scale  {"pool": "decode", "replicas": 2}   or   {"prefill": 1, "decode": 2}
    POST /admin/drain  {"worker_id": "decode-1"}
    (serving several models, scale and drain name one: {"model": "name", ...}; status and events cover all)
    GET  /admin/events?since=<unix time>        scaling decisions and worker changes
    GET  /admin/requests/{request_id}/trace     a recent request's stage timelines (`tandem trace`)
    POST /v1/load_lora_adapter   {"lora_name": "x", "lora_path": "/dir"}   vLLM's, serves a LoRA adapter
    POST /v1/unload_lora_adapter {"lora_name": "x"}

Calls are synchronous: scale returns once new workers are ready and registered with the router and
drained workers have finished their requests and left; drain returns once the worker is gone.
Clients should allow minutes (a model load, a long generation finishing). Errors are OpenAI-style
JSON bodies: 400 bad body (naming the field), 401 wrong or missing key, 403 admin API disabled,
404 unknown worker, 503 controller unreachable.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict
from typing import Literal

import ray
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, model_validator

from worker_runtime.auth import bearer_token, token_matches
from engine.errors import first_field_error
from router.api.request_trace import MAX_REQUEST_ID_LENGTH


class AdminError(Exception):
    """An admin request that cannot be served; becomes an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def response(self) -> JSONResponse:
        kind = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error"}.get(self.status, "server_error")
        return JSONResponse({"error": {"message": self.message, "type": kind, "param": self.param,
                                       "code": self.status}}, status_code=self.status)


class ScaleRequest(BaseModel):
    """Either one pool (`pool` + `replicas`) or both at once (`prefill` and/or `decode`)."""
    model_config = ConfigDict(extra="forbid")
    pool: Literal["prefill", "decode"] | None = None
    replicas: int | None = Field(None, ge=0, le=256)
    prefill: int | None = Field(None, ge=0, le=256)
    decode: int | None = Field(None, ge=0, le=256)
    model: str | None = Field(None, min_length=1, max_length=256)  # whose pools, when several models are served

    @model_validator(mode="after")
    def _one_form(self) -> ScaleRequest:
        if (self.pool is None) != (self.replicas is None):
            raise ValueError("give `pool` and `replicas` together")
        if self.pool is not None and (self.prefill is not None or self.decode is not None):
            raise ValueError("give either `pool` + `replicas` or `prefill` / `decode`, not both")
        if self.pool is None and self.prefill is None and self.decode is None:
            raise ValueError("nothing to scale: give `prefill` and/or `decode` replicas")
        return self

    def targets(self) -> dict[str, int]:
        if self.pool is not None:
            return {self.pool: self.replicas}
        return {pool: n for pool, n in (("prefill", self.prefill), ("decode", self.decode)) if n is not None}


class LoadLoRARequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_path: str = Field(min_length=1, max_length=4096)
    base_model: str | None = Field(None, min_length=1, max_length=256)  # tandem's: which model, with several


class UnloadLoRARequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (`lora_int_id` is accepted and ignored, as vLLM does)."""
    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1, max_length=128)
    lora_int_id: int | None = None


class DrainRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    worker_id: str = Field(min_length=1, max_length=128)
    model: str | None = Field(None, min_length=1, max_length=256)  # whose worker, when several models are served


def _authorize(request: Request, admin_key: str | None) -> None:
    if not admin_key:
        raise AdminError(403, "admin API disabled: set TANDEM_ADMIN_KEY (or `tandem serve --admin-key`)")
    if not token_matches(bearer_token(request.headers.get("authorization")), admin_key):
        raise AdminError(401, "missing or wrong admin key: send `Authorization: Bearer <admin key>`")


def _admin_route_class(admin_key: str | None) -> type[APIRoute]:
    """A route class that checks the admin key before anything reads the body (so a caller without the
    key learns nothing from validation errors), and turns AdminError and body validation errors into
    error bodies here, so the admin API answers the same way whatever exception handlers the app around
    it installs."""

    class AdminRoute(APIRoute):
        def get_route_handler(self):
            handler = super().get_route_handler()

            async def guarded(request: Request):
                try:
                    _authorize(request, admin_key)
                    return await handler(request)
                except AdminError as exc:
                    return exc.response()
                except RequestValidationError as exc:
                    first = first_field_error(exc, root="body")
                    return AdminError(400, f"invalid admin request: {first.message}",
                                      first.path or None).response()

            return guarded

    return AdminRoute


def build_admin_router(get_controller: Callable[[], object] | Mapping[str, Callable[[], object]],
                       admin_key: str | None, find_trace: Callable[[str], Awaitable[dict | None]] | None = None,
                       flow_status: Callable[[], dict] | None = None,
                       other_flows: Callable[[], Awaitable[list[dict]]] | None = None) -> APIRouter:
    """The /admin routes. `get_controller` returns the controller actor handle (looked up per call, so a
    restarted controller is found again), or with several models maps each model's name to its own (requests
    that act on pools or adapters then name the model); without an `admin_key` every route answers 403.
    `find_trace` looks up a recent request's stage timelines (the ingress's TraceStore); `flow_status` gives the
    answering ingress replica's queue by tenant (router/api/flow_control.py), `other_flows` the other replicas'
    as they last published them."""

    router = APIRouter(prefix="/admin", route_class=_admin_route_class(admin_key), tags=["admin"])
    lora = APIRouter(route_class=_admin_route_class(admin_key), tags=["admin"])
    controllers = get_controller if isinstance(get_controller, Mapping) else None

    def pick(model: str | None, param: str = "model") -> Callable[[], object]:
        if controllers is None:
            return get_controller
        if len(controllers) == 1 and model is None:
            return next(iter(controllers.values()))
        if model not in controllers:
            served = ", ".join(controllers)
            raise AdminError(400 if model is None else 404, f"name the model ({served}) with `{param}`"
                             if model is None else f"no model {model!r}; this server serves {served}", param)
        return controllers[model]

    async def call(method: str, *args, model: str | None = None, param: str = "model"):
        try:
            controller = pick(model, param)()
            return await getattr(controller, method).remote(*args)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, KeyError):
                raise AdminError(404, str(cause.args[0]) if cause.args else "not found") from None
            if isinstance(cause, ValueError):
                raise AdminError(400, str(cause)) from None
            raise AdminError(500, f"{method} failed: {cause}") from None
        except (ray.exceptions.RayError, ValueError) as exc:  # ValueError: no such named actor
            raise AdminError(503, f"cluster controller unavailable: {exc}") from None

    several = controllers is not None and len(controllers) > 1

    @router.get("/status")
    async def status() -> dict:
        if several:
            status = {"models": {name: await call("status", model=name) for name in controllers}}
        else:
            status = await call("status")
        if flow_status is not None:
            status["flow"] = flow_status()
        if other_flows is not None:
            status["flow_replicas"] = await other_flows()
        return status

    @router.post("/scale")
    async def scale(body: ScaleRequest) -> dict:
        results = await call("scale_pools", body.targets(), "operator", model=body.model)
        return {"pools": {r.pool: asdict(r) for r in results}, **({"model": body.model} if body.model else {})}

    @router.post("/drain")
    async def drain(body: DrainRequest) -> dict:
        pool = await call("drain", body.worker_id, "operator", model=body.model)
        return {"worker_id": body.worker_id, "pool": pool, "removed": True,
                **({"model": body.model} if body.model else {})}

    @router.get("/events")
    async def events(since: float = 0.0) -> dict:
        if several:
            merged = [{**asdict(e), "model": name} for name in controllers
                      for e in await call("scaling_events", since, model=name)]
            return {"events": sorted(merged, key=lambda e: e["time"])}
        return {"events": [asdict(e) for e in await call("scaling_events", since)]}

    @router.get("/requests/{request_id:path}/trace")
    async def request_trace(request_id: str) -> dict:
        if not 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH or not request_id.isascii() or not request_id.isprintable():
            raise AdminError(400, f"a request id is 1 to {MAX_REQUEST_ID_LENGTH} printable ASCII characters",
                             "request_id")
        found = await find_trace(request_id) if find_trace is not None else None
        if found is None:
            raise AdminError(404, f"no recent request {request_id!r} on this server: it keeps the last "
                                  f"tracing.recent_requests finished requests")
        return found

    @lora.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        """Serve a PEFT adapter as model `lora_name` (vLLM's endpoint and answers; the admin key guards it)."""
        await call("load_lora_adapter", body.lora_name, body.lora_path, model=body.base_model, param="base_model")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @lora.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        if several:  # the model serving the adapter
            for name in controllers:
                try:
                    await call("unload_lora_adapter", body.lora_name, model=name)
                except AdminError as exc:
                    if exc.status != 404:
                        raise
                    continue
                break
            else:
                raise AdminError(404, f"The lora adapter '{body.lora_name}' cannot be found.")
        else:
            await call("unload_lora_adapter", body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    both = APIRouter()
    both.include_router(router)
    both.include_router(lora)
    return both
