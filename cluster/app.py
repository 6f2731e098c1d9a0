"""The one place the tandem Serve application is assembled, whoever starts it:

    tandem serve --config tandem.yaml                     (cluster/launcher.py calls build_app)
    serve run cluster.app:build_app model=/models/x       (Ray Serve's CLI)
    import_path: cluster.app:build_app                    (a KubeRay RayService's serveConfigV2)

`build_app` starts the cluster controller (which starts the pools) or adopts the one already running
under the config's name, starts the autoscaler when `autoscaler.enabled`, and binds the ingress with
what it needs. The controller, its pools, the autoscaler and the metrics hub are detached: they outlive a
redeploy of the ingress, and `shutdown_cluster` stops them.
"""
from __future__ import annotations

import functools
import logging

import ray
from ray.serve import Application

from cluster.admin_api import build_admin_router
from cluster.autoscaler import start_autoscaler
from cluster.config import ClusterConfig, ConfigError
from cluster.controller import CONTROLLER_NAME, ON_HEAD, get_controller, start_controller
from cluster.pools import stop_named_workers
from router.api.ingress import Ingress, IngressConfig
from router.api.quota_ledger import QuotaLedger
from router.metrics import MetricsHub
from router.api.audit import AuditConfig
from router.placement.cost_model import DisaggConfig

logger = logging.getLogger(__name__)

# Health checks and /metrics scrapes must get through while admission is refusing generation requests.
CONTROL_HEADROOM = 32

# What the workers run and how their KV is laid out: the ingress tokenizes, hashes blocks and checks
# limits for exactly this, so a running cluster cannot be adopted by a config that differs here.
WORKER_FIELDS = ("model", "dtype", "device", "mode", "seed", "engine", "transfer", "reasoning")


def build_app(args: ClusterConfig) -> Application:
    """The tandem application: OpenAI ingress replicas over the pools of one cluster controller (one per model
    when the config lists several `models`).

    `args` is a ClusterConfig or a dict of its fields (Serve validates `serve run` and serveConfigV2 args
    against the annotation). API keys missing from it are read from TANDEM_API_KEYS / TANDEM_ADMIN_KEY
    here, where the application is built. Raises ConfigError when a controller of this name runs other
    workers (another model or KV layout)."""
    config = args if isinstance(args, ClusterConfig) else ClusterConfig.model_validate(args)
    config = config.with_env()
    models = config.model_configs()  # one cluster per model, each with its controller, pools and autoscaler
    controllers = [start_or_adopt_controller(sub) for sub in models]
    for sub in models:
        _apply_autoscaler(sub)
    hub = ray.remote(MetricsHub).options(name=f"{config.name}-metrics", namespace=config.namespace,
                                         get_if_exists=True, lifetime="detached", num_cpus=0, **ON_HEAD).remote(
        recent_requests=config.tracing.recent_requests)
    admin = functools.partial(build_admin_router, {
        sub.model_name: functools.partial(get_controller, sub.name, sub.namespace) for sub in models},
        config.admin_key)
    # Serve's own limits sit above the ingress's admission bound, so overload is answered with the
    # ingress's 429 and Retry-After; Serve's queue (which a burst passes through on its way to the
    # replica) stays bounded too.
    limit = sum(sub.router.max_queued_requests for sub in models) + CONTROL_HEADROOM
    # Several replicas count tenants' quotas in one ledger; one replica counts them itself (exact, no calls).
    ledger = None
    if config.ingress_replicas > 1 and any(sub.has_quotas() for sub in models):
        ledger = ray.remote(QuotaLedger).options(name=f"{config.name}-quotas", namespace=config.namespace,
                                                 get_if_exists=True, lifetime="detached", num_cpus=0,
                                                 max_restarts=-1, **ON_HEAD).remote()
    return Ingress.options(num_replicas=config.ingress_replicas, max_ongoing_requests=limit,
                           max_queued_requests=limit).bind([ingress_config(sub) for sub in models], controllers,
                                                            hub, admin, ledger, config.ingress_replicas)


def ingress_config(config: ClusterConfig) -> IngressConfig:
    r = config.router
    return IngressConfig(model=config.model, model_name=config.model_name, model_aliases=tuple(config.model_names[1:]),
                         chat_template=config.chat_template, max_model_len=config.engine.max_model_len,
                         block_size=config.engine.block_size,
                         disagg=DisaggConfig(r.max_local_prefill_length, r.max_remote_prefill_cache_hit_ratio,
                                             r.max_prefill_queue_size, r.placement, config.slo.ttft_ms / 1000,
                                             config.slo.itl_ms / 1000, config.slo.stall_ratio),
                         max_queued_requests=r.max_queued_requests, migration_limit=r.migration_limit,
                         api_keys=dict(config.api_keys), colocated=config.mode == "colocated", limits=config.limits,
                         routing=r.routing, decode_wait_s=r.decode_wait_s, layerwise=config.transfer.layerwise,
                         reasoning=config.reasoning,
                         tool_call_parser=config.tool_call_parser, otlp_endpoint=config.tracing.otlp_endpoint,
                         service_name=config.tracing.service_name, recent_requests=config.tracing.recent_requests,
                         audit=audit_config(config), flow=config.flow_config())


def audit_config(config: ClusterConfig) -> AuditConfig:
    """The audit section, with the engine settings that shape outputs (what a replay must match)."""
    a, e = config.audit, config.engine
    engine = {"model": config.model, "dtype": config.dtype, "device": config.device, "mode": config.mode,
              "block_size": e.block_size, "max_model_len": e.max_model_len,
              "enable_prefix_caching": e.enable_prefix_caching}
    return AuditConfig(a.sink, a.log_inputs, a.max_queue, engine)


def start_or_adopt_controller(config: ClusterConfig):
    """The controller named after `config.name`: started (detached, without waiting for its pools) if none
    runs, else adopted when it runs the same workers."""
    try:
        controller = get_controller(config.name, config.namespace)
    except ValueError:
        return start_controller(config, detached=True, wait=False)
    running = ClusterConfig.model_validate(ray.get(controller.config_dict.remote()))
    check_same_workers(running, config)
    return controller


def check_same_workers(running: ClusterConfig, wanted: ClusterConfig) -> None:
    """Refuse a config whose workers would differ from the running ones: the ingress would tokenize and
    hash for one model while the workers run another."""
    old, new = running.model_dump(include=set(WORKER_FIELDS)), wanted.model_dump(include=set(WORKER_FIELDS))
    changed = sorted(_diff(old, new))
    if changed:
        raise ConfigError(
            f"cluster {wanted.name!r} already runs workers with another config ({', '.join(changed)} differ); "
            f"refusing: the ingress would serve one model while the workers run another. Stop the cluster first "
            f"(`tandem serve` stops it on exit; from Python, cluster.app.shutdown_cluster({wanted.name!r}, "
            f"{wanted.namespace!r})), or deploy under another `name`")
    if running.model_dump(exclude=set(WORKER_FIELDS)) != wanted.model_dump(exclude=set(WORKER_FIELDS)):
        logger.info("adopting the running controller %s-%s; its pools keep their current sizes", wanted.name,
                    CONTROLLER_NAME)


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out


def _apply_autoscaler(config: ClusterConfig) -> None:
    """Start the autoscaler the config asks for; a running one (from an earlier deploy) is replaced, so
    its thresholds are the config's, or stopped when the config turns it off."""
    _kill(f"{config.name}-autoscaler", config.namespace)
    if config.autoscaler.enabled:
        start_autoscaler(config.autoscaler, config.name, config.namespace, detached=True, wait=False)


def shutdown_cluster(name: str = "tandem", namespace: str = "tandem") -> None:
    """Stop what `build_app` started beside the ingress: the autoscaler, the pools and the controller, and
    the metrics hub (with several models, every model's: the clusters named `<name>--<key>`). They outlive the
    Serve app on purpose."""
    prefix = f"{name}--"
    for actor in ray.util.list_named_actors(all_namespaces=True):
        sub = actor["name"].removesuffix(f"-{CONTROLLER_NAME}")
        if actor["namespace"] == namespace and sub != actor["name"] and sub.startswith(prefix):
            _shutdown_one(sub, namespace)
    _shutdown_one(name, namespace)
    _kill(f"{name}-metrics", namespace)
    _kill(f"{name}-quotas", namespace)


def _shutdown_one(name: str, namespace: str) -> None:
    _kill(f"{name}-autoscaler", namespace)
    try:
        controller = ray.get_actor(f"{name}-{CONTROLLER_NAME}", namespace=namespace)
    except ValueError:
        controller = None
    if controller is not None:
        try:
            ray.get(controller.shutdown.remote(), timeout=60)
        except ray.exceptions.RayError as exc:
            logger.warning("the controller did not stop its pools (%s); stopping the workers by name", exc)
        ray.kill(controller, no_restart=True)
    stop_named_workers(name, namespace)  # detached: any the controller did not stop (it was dead, say)


def _kill(actor_name: str, namespace: str) -> None:
    try:
        ray.kill(ray.get_actor(actor_name, namespace=namespace), no_restart=True)
    except ValueError:
        pass  # not running
