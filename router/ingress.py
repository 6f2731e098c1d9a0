"""The Serve deployment: each replica connects to the cluster controller, follows the workers, and
serves the OpenAI API, /health and /metrics from a FastAPI app built in the replica."""
from __future__ import annotations

import asyncio
import logging
import time

import ray
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from ray import serve
from starlette.exceptions import HTTPException
from transformers import AutoConfig

from cluster.admin_api import build_admin_router
from cluster.config import ClusterConfig
from cluster.controller import CONTROLLER_NAME, ClusterController, get_controller
from cluster.metrics import Metrics
from engine.model_loader import load_tokenizer, resolve_model_dir
from router.admission import Admission
from router.auth import Authenticator
from router.index import PrefixIndex
from router.latency_report import LatencyReporter
from router.openai_api import APIError
from router.policy import DisaggConfig, Router
from router.request_router import RequestRouter
from router.service import ModelInfo, OpenAIService, to_api_error
from router.worker_view import WorkerView

logger = logging.getLogger(__name__)


def connect_controller(config: ClusterConfig):
    """The cluster's controller, created (with its pools) by whichever replica comes first.

    It is detached: it and the pools outlive any one replica, so a replica restart or a redeploy does
    not restart the workers. `router.app.shutdown_cluster` stops them."""
    return ray.remote(ClusterController).options(
        name=f"{config.name}-{CONTROLLER_NAME}", namespace=config.namespace, get_if_exists=True,
        lifetime="detached", num_cpus=0, max_concurrency=32).remote(config)


def load_model_info(config: ClusterConfig):
    """The tokenizer (with its chat template) and the limits the workers will apply, read from the same
    model directory the workers load."""
    model_dir = resolve_model_dir(config.model)
    hf = AutoConfig.from_pretrained(model_dir)
    max_position = getattr(hf, "max_position_embeddings", 2048)
    max_model_len = min(config.engine.max_model_len or max_position, max_position)
    info = ModelInfo(config.model_name, hf.vocab_size, max_model_len, int(time.time()))
    return load_tokenizer(model_dir), info


@serve.deployment(name="ingress")
@serve.ingress()
class Ingress:
    """One ingress replica: an exact prefix index of its own, fed by every worker's KV events."""

    async def __init__(self, config: dict):
        self.config = config = ClusterConfig.model_validate(config)
        self.controller = connect_controller(config)
        # Starting the pools can take minutes with a large model: load the tokenizer meanwhile.
        (tokenizer, model), running = await asyncio.gather(
            asyncio.to_thread(load_model_info, config), self.controller.config_dict.remote())
        if running != config.model_dump():
            logger.warning("controller %s-%s was started with another config; it keeps its own (scale it with "
                           "`tandem scale`, or shut it down to apply the new one)", config.name, CONTROLLER_NAME)
        self.metrics = Metrics()
        router = Router(PrefixIndex(), config.engine.block_size, DisaggConfig(
            config.router.max_local_prefill_length, config.router.max_remote_prefill_cache_hit_ratio,
            config.router.max_prefill_queue_size))
        self.view = WorkerView(self.controller, router, self.metrics, colocated=config.mode == "colocated")
        await self.view.start()
        latencies = LatencyReporter(self.controller)
        self._latency_task = asyncio.create_task(latencies.run())
        self.service = OpenAIService(model, tokenizer, Authenticator(config.api_keys),
                                     Admission(config.router.max_queued_requests,
                                               self.metrics.rejected.labels("admission_full")),
                                     RequestRouter(self.view, self.metrics, latencies,
                                                   migration_limit=config.router.migration_limit),
                                     config.engine.block_size)

    def __serve_build_asgi_app__(self) -> FastAPI:
        admin = build_admin_router(lambda: get_controller(self.config.name, self.config.namespace),
                                   self.config.admin_key)
        return build_api(self.service, self.view, self.metrics, self.controller, admin)

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

    async def __del__(self):
        self._latency_task.cancel()
        await self.view.close()


def build_api(service: OpenAIService, view: WorkerView, metrics: Metrics, controller, admin: APIRouter) -> FastAPI:
    """The HTTP surface: the OpenAI API, /health, /metrics, and the admin API under /admin (its own key).
    Every error, including unknown routes, has OpenAI's error shape."""
    app = FastAPI(title="tandem", description="OpenAI-compatible disaggregated inference")
    app.include_router(admin)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), type="invalid_request_error"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        try:
            return await service.completions(await request.body(), request.headers.get("authorization"))
        except Exception as exc:
            return error_response(to_api_error(exc))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            return await service.chat(await request.body(), request.headers.get("authorization"))
        except Exception as exc:
            return error_response(to_api_error(exc))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            return JSONResponse(service.models(request.headers.get("authorization")).model_dump())
        except APIError as exc:
            return error_response(exc)

    @app.get("/health")
    async def health() -> Response:
        """200 while at least one decode worker takes requests (what a load balancer needs to know)."""
        ready = view.num_schedulable("decode")
        body = {"status": "ok" if ready else "unavailable", "decode_workers": ready,
                "prefill_workers": view.num_schedulable("prefill")}
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:  # scaling series come from the controller, which owns the pools
            metrics.observe_scaling(await asyncio.wait_for(controller.scaling_report.remote(), timeout=2.0))
        except (ray.exceptions.RayError, asyncio.TimeoutError) as exc:
            logger.warning("scaling metrics are stale: the controller did not answer (%s)", exc)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
