"""The Serve deployment: each replica follows the workers through the cluster controller and serves the
OpenAI API, /health and /metrics from a FastAPI app built in the replica.

The ingress is bound by `cluster.app.build_app` with everything it needs passed in (the controller's
handle, the metrics hub, the admin routes): it starts nothing and knows no cluster internals.
"""
from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

import ray
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.exceptions import HTTPException
from transformers import AutoConfig

from engine.model_loader import load_tokenizer, model_revision, resolve_model_dir
from worker_runtime.request_log import install_request_log_records, set_request_id
from worker_runtime.tracing import configure_tracing
from router.api.admission import Admission
from router.api.audit import Audit, AuditConfig
from router.api.audit_sink import AuditWriter
from router.api.auth import Authenticator
from router.api.chat_output import ChatParsing
from router.api.flow_control import FlowConfig, FlowControl
from router.api.quota_ledger import SharedQuotas
from worker_runtime.heap import trim_heap
from router.placement.index import PrefixIndex
from router.placement.latency_report import LatencyReporter
from router.metrics import Metrics, labelled_series
from router.api.openai_api import APIError, ChatCompletionRequest, CompletionRequest, request_body_schema
from router.placement.cost_model import DisaggConfig
from router.placement.routing import Router
from router.api.reasoning_parser import ReasoningOptions
from router.api.request_limits import RequestLimits, read_body
from router.api import tokenize_api
from router.placement.request_router import RequestRouter
from router.api.request_trace import REQUEST_ID_HEADER, Trace
from router.trace_store import TraceStore, timeline_body
from router.api.service import ModelInfo, OpenAIService, to_api_error
from router.api.served_models import ServedModels
from router.placement.worker_view import WorkerView

logger = logging.getLogger(__name__)

# How often a replica publishes its own series to the metrics hub between scrapes.
METRICS_PUBLISH_S = 5.0
# How often a replica hands its newly finished requests' timelines to the hub (for `tandem trace`).
TRACE_SHARE_S = 1.0
# How often the replica gives the heap's free pages back to the OS (worker_runtime/heap.py); 0: never.
TRIM_HEAP_S = float(os.environ.get("TANDEM_TRIM_HEAP_S", "30"))
OPENAPI_PATH = "/openapi.json"


@dataclass(slots=True)
class IngressConfig:
    """What an ingress replica needs to know; `cluster.app.build_app` derives it from the cluster config."""
    model: str | None  # the model directory (or the default model), resolved where the replica runs
    model_name: str
    max_model_len: int | None
    block_size: int
    disagg: DisaggConfig
    max_queued_requests: int
    migration_limit: int
    api_keys: dict[str, str]
    colocated: bool
    routing: str = "prefix_aware"  # or round_robin: the baseline for benchmarks
    decode_wait_s: float = 60.0  # how long a request waits for a decode worker while the pool heals
    layerwise: bool = False  # transfer.layerwise: prefill workers answer before the first token
    limits: RequestLimits = field(default_factory=RequestLimits)
    model_aliases: tuple[str, ...] = ()  # more names requests may use for the model
    chat_template: str | None = None  # instead of the tokenizer's own
    reasoning: ReasoningOptions | None = None  # the model's thinking markers (router/api/reasoning_parser.py)
    tool_call_parser: str | None = "hermes"  # the format tool_choice auto reads (router/api/tool_parsers.py)
    otlp_endpoint: str | None = None  # OpenTelemetry spans go there (worker_runtime/tracing.py); None: no spans
    service_name: str = "tandem"
    recent_requests: int = 1000  # finished requests' timelines kept for `tandem trace`
    audit: AuditConfig = field(default_factory=AuditConfig)  # per-request audit records (router/api/audit.py)
    flow: FlowConfig = field(default_factory=FlowConfig)  # the ingress queue (router/api/flow_control.py)


def load_model_info(config: IngressConfig):
    """The tokenizer (with its chat template) and the limits the workers will apply, read from the same
    model directory the workers load; with audit records on, the weights' revision too (hashed once per
    model directory and cached on disk: engine.model_loader.model_revision)."""
    model_dir = resolve_model_dir(config.model)
    hf = AutoConfig.from_pretrained(model_dir)
    max_position = getattr(hf, "max_position_embeddings", 2048)
    max_model_len = min(config.max_model_len or max_position, max_position)
    revision = model_revision(model_dir) if config.audit.sink else None
    info = ModelInfo(config.model_name, hf.vocab_size, max_model_len, int(time.time()), config.model_aliases,
                     revision)
    tokenizer = load_tokenizer(model_dir)
    if config.chat_template is not None:
        tokenizer.chat_template = config.chat_template
    return tokenizer, info


# How often a stopping replica checks whether its requests are done. Serve's default (2 s) sleeps before the
# first check, so even an idle replica took 2 s to stop (every Ctrl-C, redeploy and scale-down paid it);
# requests in flight are still waited for, up to Serve's graceful_shutdown_timeout_s.
DRAIN_POLL_S = 0.1


@dataclass(slots=True)
class ModelStack:
    """One model's part of an ingress replica: its controller, metrics, worker view and OpenAI service."""
    name: str
    controller: object
    metrics: Metrics
    view: WorkerView
    service: OpenAIService
    tasks: list


@serve.deployment(name="ingress", graceful_shutdown_wait_loop_s=DRAIN_POLL_S)
@serve.ingress()
class Ingress:
    """One ingress replica: an exact prefix index of its own, fed by every worker's KV events.

    `controllers`: the cluster controller's actor handle (membership, latency reports, scaling report), or with
    several models (`configs`, one each) a list of their controllers;
    `metrics_hub`: a `router.metrics.MetricsHub` actor shared by the replicas; `extra_routes`: makes the
    routes mounted beside the API (the admin API), given `find_trace` (recent requests' timelines);
    `quota_ledger`: with several replicas (`replicas`), the `QuotaLedger` actor that counts tenants' quotas
    for all of them (None: each replica counts its own)."""

    async def __init__(self, configs: IngressConfig | list[IngressConfig], controllers, metrics_hub,
                       extra_routes: Callable[..., APIRouter] | None = None, quota_ledger=None, replicas: int = 1):
        configs = configs if isinstance(configs, list) else [configs]
        controllers = controllers if isinstance(controllers, list) else [controllers]
        self.config = config = configs[0]
        self.metrics_hub = metrics_hub
        self.extra_routes = extra_routes
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        install_request_log_records()
        configure_tracing(config.otlp_endpoint, config.service_name, "ingress")
        self.stacks = [await self._stack(c, controller, quota_ledger, self.replica_id, replicas)
                       for c, controller in zip(configs, controllers)]
        first = self.stacks[0]
        # The first model's, for what serves one model (and this replica's operator views below).
        self.controller, self.metrics, self.view = first.controller, first.metrics, first.view
        self.service = first.service if len(self.stacks) == 1 else ServedModels([m.service for m in self.stacks])
        self._tasks = [task for m in self.stacks for task in m.tasks] + [
            asyncio.create_task(self._publish_metrics()), asyncio.create_task(self._share_traces())]
        if TRIM_HEAP_S > 0:
            self._tasks.append(asyncio.create_task(self._trim_heap()))

    @staticmethod
    async def _stack(config: IngressConfig, controller, quota_ledger=None, replica_id: str = "",
                     replicas: int = 1) -> ModelStack:
        """One model's ingress: its tokenizer, metrics, worker view and index, router and OpenAI service."""
        tokenizer, model = await asyncio.to_thread(load_model_info, config)
        metrics = Metrics()
        router = Router(PrefixIndex(), config.block_size, config.disagg, routing=config.routing)
        view = WorkerView(controller, router, metrics, colocated=config.colocated)
        await view.start()
        latencies = LatencyReporter(controller)
        writer = None if config.audit.sink is None else AuditWriter(
            config.audit.sink, config.audit.max_queue, metrics.audit_records, metrics.audit_dropped)
        requests = RequestRouter(view, metrics, latencies, migration_limit=config.migration_limit,
                                 decode_wait_s=config.decode_wait_s, layerwise=config.layerwise)
        shared = None if quota_ledger is None else SharedQuotas(quota_ledger, config.model_name, replica_id, replicas,
                                                                 metrics.flow.ledger_errors)
        flow = FlowControl(config.flow, saturated=requests.saturated, metrics=metrics.flow,
                           wait_for_loads=view.wait_for_loads, shared=shared)
        service = OpenAIService(model, tokenizer, Authenticator(config.api_keys),
                                Admission(config.max_queued_requests, metrics.rejected.labels("admission_full")),
                                requests, config.block_size, config.limits,
                                ChatParsing(tokenizer, config.reasoning, config.tool_call_parser),
                                TraceStore(config.recent_requests),
                                Audit(config.audit, model.name, model.revision, writer), flow,
                                adapters=lambda: view.adapters)
        tasks = [asyncio.create_task(latencies.run())]
        if shared is not None:
            tasks.append(asyncio.create_task(shared.renew_forever()))
        return ModelStack(model.name, controller, metrics, view, service, tasks)

    def __serve_build_asgi_app__(self) -> FastAPI:
        # Serve's proxy makes the request id when the client sends none (so the replica always sees one in
        # X-Request-Id) and echoes it in the response itself.
        views = {m.name: m.view for m in self.stacks}
        app = build_api(self.service, self.view if len(views) == 1 else views, self.scrape, self.config.limits,
                        echo_request_id=False)
        if self.extra_routes is not None:
            app.include_router(self.extra_routes(find_trace=self.request_trace, flow_status=self.flow_status,
                                                 other_flows=self.other_flows))
        return app

    def own_series(self) -> bytes:
        """This replica's own series, every sample labelled with its model (vLLM's model_name)."""
        return labelled_series({m.name: m.metrics.own_series() for m in self.stacks}, "model_name")

    async def scrape(self) -> bytes:
        """/metrics: every live replica's own series (through the hub) and the shared series, each labelled with
        its model."""
        own = self.own_series()
        try:
            replicas = await asyncio.wait_for(self.metrics_hub.publish.remote(self.replica_id, own, self.flow_status()),
                                              timeout=5.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            logger.warning("the metrics hub did not answer (%s): this scrape holds only this replica's series", exc)
            replicas = {self.replica_id: own}
        for m in self.stacks:
            try:  # scaling series come from the controller, which owns the pools
                m.metrics.observe_scaling(await asyncio.wait_for(m.controller.scaling_report.remote(), 2.0))
            except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
                logger.warning("scaling metrics of %s are stale: the controller did not answer (%s)", m.name, exc)
        return labelled_series(replicas, "replica") + labelled_series(
            {m.name: generate_latest(m.metrics.shared) for m in self.stacks}, "model_name")

    async def _publish_metrics(self) -> None:
        while True:
            try:
                await self.metrics_hub.publish.remote(self.replica_id, self.own_series(), self.flow_status())
            except ray.exceptions.RayError as exc:
                logger.warning("cannot publish metrics to the hub: %s", exc)
            await asyncio.sleep(METRICS_PUBLISH_S)

    async def _trim_heap(self) -> None:
        while True:
            await asyncio.sleep(TRIM_HEAP_S)
            await asyncio.to_thread(trim_heap)

    # ---- through a DeploymentHandle, for operators and tests: this replica's view -------------
    # (async, so they run on the replica's event loop, between the view's updates)

    async def workers(self) -> dict[str, dict]:
        """Each known worker: its pool, whether it is schedulable, how many blocks the index holds for it."""
        return {w.worker_id: {"pool": w.pool, "schedulable": w.schedulable,
                              "indexed_blocks": self.view.index.num_blocks(w.worker_id)}
                for w in self.view.workers.values()}

    async def overlap(self, block_hashes: list[int]) -> dict[str, int]:
        """How many leading blocks of a hash chain each known worker caches, per this replica's index."""
        return self.view.index.overlap(block_hashes, list(self.view.workers))

    async def index_report(self, block_hashes: list[int]) -> dict:
        """This replica's id and, per known worker, how many blocks its index holds and which of
        `block_hashes` they include: what shows that several replicas agree."""
        index = self.view.index
        return {"replica": self.replica_id,
                "workers": {w: {"num_blocks": index.num_blocks(w),
                                "held": [h for h in block_hashes if index.overlap([h], [w])[w] == 1]}
                            for w in self.view.workers}}

    def flow_status(self) -> dict:
        """This replica's ingress queue, by tenant (and by model, with several)."""
        if len(self.stacks) == 1:
            return {"replica": self.replica_id, **self.stacks[0].service.flow.snapshot()}
        return {"replica": self.replica_id, "models": {m.name: m.service.flow.snapshot() for m in self.stacks}}

    async def other_flows(self) -> list[dict]:
        """The other live replicas' ingress queues as they last published them (every METRICS_PUBLISH_S)."""
        try:
            flows = await asyncio.wait_for(self.metrics_hub.replica_flows.remote(), timeout=5.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            logger.warning("the metrics hub did not answer (%s): status shows only this replica's queue", exc)
            return []
        return [flow for flow in flows if flow.get("replica") != self.replica_id]

    async def request_trace(self, request_id: str) -> dict | None:
        """The stage timelines of a recent request, served by this replica or (shared through the hub
        within TRACE_SHARE_S) another; None when none has it."""
        for m in self.stacks:
            timelines = m.service.traces.get(request_id)
            if timelines is not None:
                return timeline_body(request_id, timelines)
        try:
            return await asyncio.wait_for(self.metrics_hub.find_trace.remote(request_id), timeout=5.0)
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            logger.warning("the metrics hub did not answer (%s): only this replica's requests are found", exc)
            return None

    async def _share_traces(self) -> None:
        while True:
            await asyncio.sleep(TRACE_SHARE_S)
            if finished := [t for m in self.stacks for t in m.service.traces.take_unshared()]:
                try:
                    await self.metrics_hub.add_traces.remote([timeline_body(rid, t) for rid, t in finished])
                except ray.exceptions.RayError as exc:
                    logger.warning("cannot share recent requests' timelines with the hub: %s", exc)

    async def __del__(self):
        for task in getattr(self, "_tasks", []):  # absent when __init__ failed
            task.cancel()
        for m in getattr(self, "stacks", []):
            m.service.tokenizers.close()
            await asyncio.to_thread(m.service.audit.close)  # what is queued is written first
        try:
            await self.metrics_hub.forget.remote(self.replica_id)
        except ray.exceptions.RayError:
            pass  # the hub drops a silent replica's series after its ttl anyway
        for m in getattr(self, "stacks", []):
            await m.view.close()


def build_api(service: OpenAIService | ServedModels, view: WorkerView | Mapping[str, WorkerView], scrape: Callable[[], Awaitable[bytes]],
              limits: RequestLimits, echo_request_id: bool = True) -> FastAPI:
    """The HTTP surface: the OpenAI API, /health and /metrics (`scrape` makes its body), and the API's own
    description. Every error, including unknown routes, has OpenAI's error shape; bodies beyond `limits` are
    refused unparsed."""
    app = FastAPI(title="tandem", description="OpenAI-compatible disaggregated inference",
                  openapi_url=None, docs_url=None, redoc_url=None)  # FastAPI's own are open to anyone
    add_api_docs(app, service.auth)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), type="invalid_request_error"))

    @app.post("/v1/completions", openapi_extra=request_body_schema(
        CompletionRequest, {"model": service.model.name, "prompt": "Say hello", "max_tokens": 8}))
    async def completions(request: Request) -> Response:
        return await _generation(request, service.completions, limits, echo_request_id)

    @app.post("/v1/chat/completions", openapi_extra=request_body_schema(
        ChatCompletionRequest, {"model": service.model.name, "messages": [{"role": "user", "content": "Say hello"}],
                                "max_tokens": 8}))
    async def chat_completions(request: Request) -> Response:
        return await _generation(request, service.chat, limits, echo_request_id)

    _add_model_routes(app, service)
    for path, run, body_model in (("/tokenize", tokenize_api.tokenize, tokenize_api.TokenizeRequest),
                                  ("/detokenize", tokenize_api.detokenize, tokenize_api.DetokenizeRequest)):
        app.add_api_route(path, _utility_route(service, run, limits), methods=["POST"],
                          openapi_extra=request_body_schema(body_model), name=path.strip("/"))

    _add_operator_routes(app, view, scrape)
    return app


def _add_model_routes(app: FastAPI, service: OpenAIService) -> None:
    """/v1/models, one model's card, and /version: what a client may ask before it generates."""
    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return JSONResponse(service.models(request.headers.get("authorization")).model_dump())
        except APIError as exc:
            return error_response(exc)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        try:
            return JSONResponse(service.model_card(model_id, request.headers.get("authorization")).model_dump())
        except APIError as exc:
            return error_response(exc)

    @app.get("/version")
    async def version(request: Request) -> Response:
        try:
            service.auth.tenant(request.headers.get("authorization"))
        except APIError as exc:
            return error_response(exc)
        return JSONResponse({"version": tandem_version()})


def _add_operator_routes(app: FastAPI, view: WorkerView | Mapping[str, WorkerView],
                         scrape: Callable[[], Awaitable[bytes]]) -> None:
    """/health for load balancers and /metrics for Prometheus (`scrape` makes its body). `view`: the model's
    worker view, or each model's by name."""
    @app.get("/health")
    async def health() -> Response:
        """200 while at least one decode worker takes requests, of every model (what a load balancer needs to
        know); with several models, each one's counts too."""
        if not isinstance(view, Mapping):
            ready = view.num_schedulable("decode")
            body = {"status": "ok" if ready else "unavailable", "decode_workers": ready,
                    "prefill_workers": view.num_schedulable("prefill")}
            return JSONResponse(body, status_code=200 if ready else 503)
        models = {name: {"decode_workers": v.num_schedulable("decode"), "prefill_workers": v.num_schedulable("prefill")}
                  for name, v in view.items()}
        ready = all(m["decode_workers"] for m in models.values())
        body = {"status": "ok" if ready else "unavailable", "models": models,
                "decode_workers": sum(m["decode_workers"] for m in models.values()),
                "prefill_workers": sum(m["prefill_workers"] for m in models.values())}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(await scrape(), media_type=CONTENT_TYPE_LATEST)


async def _generation(request: Request, endpoint, limits: RequestLimits, echo_request_id: bool) -> Response:
    """A generation endpoint: the request's id (the client's X-Request-Id or a new one) names it in the
    log lines made for it and comes back in the response headers, on errors too (`echo_request_id`: here,
    unless a proxy in front does it)."""
    trace = None
    try:
        trace = Trace.from_headers(request.headers)
        set_request_id(trace.request_id)
        body = await read_body(request, limits.max_body_bytes)
        response = await endpoint(body, request.headers.get("authorization"), trace)
    except Exception as exc:
        error = to_api_error(exc)
        if trace is not None:
            trace.failed(error.message)
        response = error_response(error)
    if trace is not None and echo_request_id:
        response.headers[REQUEST_ID_HEADER] = trace.request_id
    return response


def _utility_route(service: OpenAIService | ServedModels, run, limits: RequestLimits):
    async def endpoint(request: Request) -> Response:
        try:
            body = await read_body(request, limits.max_body_bytes)
            authorization = request.headers.get("authorization")
            service.auth.tenant(authorization)
            return JSONResponse((await run(service.pick_body(body), body, authorization)).model_dump())
        except Exception as exc:
            return error_response(to_api_error(exc))
    return endpoint


def tandem_version() -> str:
    try:
        return importlib.metadata.version("tandem-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def add_api_docs(app: FastAPI, auth: Authenticator) -> None:
    """/openapi.json, /docs (Swagger UI) and /redoc under the API-key rule of every other route: with keys
    configured they need a valid one, so the schema says nothing to strangers. (A browser sends no key:
    with keys, fetch the schema with one and read it with any OpenAPI viewer.)"""
    def page(make: Callable[[str], Response]):
        async def endpoint(request: Request) -> Response:
            try:
                auth.tenant(request.headers.get("authorization"))
            except APIError as exc:
                return error_response(exc)
            return make(request.scope.get("root_path", "").rstrip("/"))
        return endpoint

    def schema(root: str) -> Response:
        body = app.openapi()
        return JSONResponse({**body, "servers": [{"url": root}]} if root else body)

    for path, make in {
        OPENAPI_PATH: schema,
        "/docs": lambda root: get_swagger_ui_html(openapi_url=root + OPENAPI_PATH, title="tandem - Swagger UI"),
        "/redoc": lambda root: get_redoc_html(openapi_url=root + OPENAPI_PATH, title="tandem - ReDoc"),
    }.items():
        app.add_api_route(path, page(make), methods=["GET"], include_in_schema=False)


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
