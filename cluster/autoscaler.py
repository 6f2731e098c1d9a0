"""The autoscaler: a Ray actor that polls each pool's load through the controller and resizes the pools.

Every `interval_s` it reads the membership, each active worker's stats and the latency quantiles the
ingress reported, asks each pool's ScalingPolicy (cluster/scaling_policy.py), and calls
`controller.scale` when the answer differs from the current size. Bounds come from the pools'
`min_replicas` / `max_replicas`; every decision that changes a pool is logged and shows up in the
controller's scaling events (and so in `tandem:scaling_events` and
`tandem:autoscaler_desired_replicas` on /metrics).
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from cluster.config import AutoscalerConfig, ClusterConfig
from cluster.controller import ON_HEAD, enable_info_logging, get_controller
from cluster.scaling_policy import Decision, ScalingPolicy, pool_signals

logger = logging.getLogger(__name__)


class Autoscaler:
    """Runs the scaling loop in a background thread; `evaluate` runs one round on demand."""

    def __init__(self, config: AutoscalerConfig, name: str = "tandem", namespace: str = "tandem",
                 start: bool = True):
        enable_info_logging()
        self.config = config
        self.controller = get_controller(name, namespace)
        cluster = ClusterConfig.model_validate(ray.get(self.controller.config_dict.remote()))
        pools = {"decode": cluster.decode} if cluster.mode == "colocated" else \
            {"prefill": cluster.prefill, "decode": cluster.decode}
        self.policies = {
            pool: ScalingPolicy(pool, max(pc.min_replicas, 1 if pool == "decode" else 0), pc.max_replicas,
                                config.thresholds(pool), config.upscale_cooldown_s, config.downscale_cooldown_s)
            for pool, pc in pools.items()}
        self.decisions: list[tuple[float, Decision]] = []
        self._stop = threading.Event()
        if start:
            threading.Thread(target=self._loop, name="autoscaler", daemon=True).start()

    def evaluate(self) -> list[Decision]:
        """One round: decide every pool and apply the changes. Returns this round's decisions."""
        membership = ray.get(self.controller.membership.remote())
        latency = ray.get(self.controller.latency_quantiles.remote(self.config.latency_window_s,
                                                                  self.config.latency_quantile))
        decisions = []
        for pool, policy in self.policies.items():
            workers = [w for w in membership.workers if w.pool == pool and not w.draining]
            signals = pool_signals(pool, self._stats(workers), latency)
            decision = policy.decide(len(workers), signals, time.monotonic())
            decisions.append(decision)
            self.decisions.append((time.time(), decision))
            del self.decisions[:-1000]
            if decision.action != "hold":
                logger.info("autoscaler: %s %s %d -> %d (%s)", pool, decision.action, decision.current,
                            decision.desired, decision.reason)
                ray.get(self.controller.scale.remote(pool, decision.desired, f"autoscaler: {decision.reason}"))
        return decisions

    def recent_decisions(self, since: float = 0.0, changes_only: bool = True) -> list[Decision]:
        return [d for t, d in self.decisions if t > since and (d.action != "hold" or not changes_only)]

    def stop(self) -> None:
        self._stop.set()

    def _stats(self, workers) -> list:
        refs = [w.actor.stats.remote() for w in workers]
        stats = []
        for ref in refs:
            try:
                stats.append(ray.get(ref, timeout=5))
            except ray.exceptions.RayError:
                pass  # an unresponsive worker is the health check's business, not a load signal
        return stats

    def _loop(self) -> None:
        while not self._stop.wait(self.config.interval_s):
            try:
                self.evaluate()
            except ray.exceptions.RayActorError as exc:  # the controller restarting: Ray brings it back
                logger.warning("autoscaler round skipped: the controller is unavailable (%s)", type(exc).__name__)
            except Exception:  # the loop must outlive a failed round (e.g. a worker that did not start)
                logger.exception("autoscaler round failed")


def start_autoscaler(config: AutoscalerConfig, name: str = "tandem", namespace: str = "tandem",
                     detached: bool = False, wait: bool = True):
    """Start the autoscaler actor next to the controller named `name`, or adopt the one running; with
    `wait`, until it is up (its pools started). Not detached, it lives as long as its creator; detached,
    until `cluster.app.shutdown_cluster`."""
    options = {"name": f"{name}-autoscaler", "namespace": namespace, "num_cpus": 0, "max_concurrency": 4,
               "get_if_exists": True, **ON_HEAD}
    if detached:
        options["lifetime"] = "detached"
    actor = ray.remote(Autoscaler).options(**options).remote(config, name, namespace)
    if wait:
        ray.get(actor.recent_decisions.remote())
    return actor
