"""The Serve application builder: `router.app:build_app`, from Python, `serve run` or a KubeRay serveConfigV2.

    serve.run(build_app({"model": "/models/x", "decode": {"replicas": 2}}))
    serve run router.app:build_app model=/models/x

The args are a ClusterConfig; Serve validates them against the annotation before calling the builder.
Ingress replica options that are Serve's own (num_replicas, ray_actor_options) are set per deployment
`ingress` in the Serve config, as for any Serve app.
"""
import ray
from ray.serve import Application

from cluster.config import ClusterConfig
from cluster.controller import CONTROLLER_NAME
from router.ingress import Ingress

# Health checks and /metrics scrapes must get through while admission is refusing generation requests.
CONTROL_HEADROOM = 32


def build_app(args: ClusterConfig) -> Application:
    """The tandem application: OpenAI ingress replicas over the pools of one cluster controller.

    `args` may also be a plain dict of ClusterConfig fields. API keys missing from it are read from
    TANDEM_API_KEYS / TANDEM_ADMIN_KEY here, where the deployment is built."""
    config = args if isinstance(args, ClusterConfig) else ClusterConfig.model_validate(args)
    config = config.with_env()
    # Serve's own limits sit above the ingress's admission bound, so overload is answered with the
    # ingress's 429 and Retry-After; Serve's queue (which a burst passes through on its way to the
    # replica) stays bounded too.
    limit = config.router.max_queued_requests + CONTROL_HEADROOM
    return Ingress.options(max_ongoing_requests=limit, max_queued_requests=limit).bind(config.model_dump())


def shutdown_cluster(name: str = "tandem", namespace: str = "tandem") -> None:
    """Stop the pools and the controller an application started; they outlive the Serve app on purpose."""
    try:
        controller = ray.get_actor(f"{name}-{CONTROLLER_NAME}", namespace=namespace)
    except ValueError:
        return
    try:
        ray.get(controller.shutdown.remote(), timeout=60)
    finally:
        ray.kill(controller, no_restart=True)
