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
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.config import ClusterConfig
from cluster.controller import enable_info_logging, get_controller
from cluster.scaling_policy import Decision, ScalingPolicy, Thresholds, pool_signals

logger = logging.getLogger(__name__)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PrefillScaling(_Strict):
    """Per prefill worker: prompt tokens accepted but not yet computed; TTFT quantile over the window."""
    queued_tokens_up: float = Field(4096, gt=0)
    queued_tokens_down: float = Field(512, ge=0)
    ttft_up_s: float = Field(2.0, gt=0)
    ttft_down_s: float = Field(0.5, ge=0)


class DecodeScaling(_Strict):
    """Per decode worker: KV cache usage and running sequences (means over the pool); ITL quantile."""
    kv_usage_up: float = Field(0.85, gt=0, le=1)
    kv_usage_down: float = Field(0.4, ge=0, lt=1)
    running_up: float = Field(48, gt=0)
    running_down: float = Field(8, ge=0)
    itl_up_s: float = Field(0.15, gt=0)
    itl_down_s: float = Field(0.05, ge=0)


class AutoscalerConfig(_Strict):
    """Thresholds come in up/down pairs (up must be above down); cooldowns are in seconds."""
    interval_s: float = Field(5.0, gt=0)
    upscale_cooldown_s: float = Field(30.0, ge=0)
    downscale_cooldown_s: float = Field(120.0, ge=0)
    latency_window_s: float = Field(60.0, gt=0)
    latency_quantile: float = Field(0.9, gt=0, le=1)
    prefill: PrefillScaling = Field(default_factory=PrefillScaling)
    decode: DecodeScaling = Field(default_factory=DecodeScaling)

    @model_validator(mode="after")
    def _up_above_down(self) -> AutoscalerConfig:
        for pool in ("prefill", "decode"):
            try:
                self.thresholds(pool)
            except ValueError as exc:
                raise ValueError(f"{pool}: {exc}") from None
        return self

    def thresholds(self, pool: str) -> dict[str, Thresholds]:
        if pool == "prefill":
            p = self.prefill
            return {"queued_prefill_tokens": Thresholds(p.queued_tokens_up, p.queued_tokens_down),
                    "ttft_s": Thresholds(p.ttft_up_s, p.ttft_down_s, per_worker=False)}
        d = self.decode
        return {"kv_usage": Thresholds(d.kv_usage_up, d.kv_usage_down),
                "num_running": Thresholds(d.running_up, d.running_down),
                "itl_s": Thresholds(d.itl_up_s, d.itl_down_s, per_worker=False)}


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
            except Exception:  # the loop must outlive a failed round (e.g. a worker that did not start)
                logger.exception("autoscaler round failed")


def start_autoscaler(config: AutoscalerConfig, name: str = "tandem", namespace: str = "tandem"):
    """Start the autoscaler actor next to the controller named `name`; it lives as long as its creator."""
    actor = ray.remote(Autoscaler).options(name=f"{name}-autoscaler", namespace=namespace, num_cpus=0,
                                           max_concurrency=4).remote(config, name, namespace)
    ray.get(actor.recent_decisions.remote())
    return actor
