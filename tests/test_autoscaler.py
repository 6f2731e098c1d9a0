"""The autoscaler: its policy on synthetic snapshots, and the actor, started by `cluster.app.build_app` from
the config's `autoscaler` section, resizing a real pool under real load sent through the ingress."""
import asyncio

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import AutoscalerConfig, ClusterConfig
from cluster.controller import get_controller
from cluster.scaling_policy import LatencyWindow, ScalingPolicy, Thresholds, pool_signals
from worker_runtime.protocol import WorkerStats
from router.metrics import Metrics
from tests.cluster_load import LoadClient, failures, serve_tandem
from tests.helpers import wait_for, wait_for_async

DECODE = {"kv_usage": Thresholds(0.8, 0.3), "num_running": Thresholds(32, 8),
          "itl_s": Thresholds(0.1, 0.03, per_worker=False)}
PREFILL = {"queued_prefill_tokens": Thresholds(4096, 512), "ttft_s": Thresholds(2.0, 0.5, per_worker=False)}


def decode_policy(min_replicas=1, max_replicas=8, up_cooldown=30.0, down_cooldown=120.0):
    return ScalingPolicy("decode", min_replicas, max_replicas, DECODE, up_cooldown, down_cooldown)


def signals(kv_usage=0.5, num_running=16, itl_s=0.05):
    return {"kv_usage": kv_usage, "num_running": num_running, "itl_s": itl_s}


# ---- policy -------------------------------------------------------------------------------------

def test_decode_scales_up_when_kv_usage_passes_its_up_threshold():
    d = decode_policy().decide(2, signals(kv_usage=0.9), now=0.0)
    assert (d.action, d.desired) == ("scale_up", 3)
    assert d.reason.startswith("kv_usage=0.9 > 0.8")


def test_scale_up_is_proportional_to_the_worst_overload_but_at_most_doubles():
    assert decode_policy().decide(4, signals(num_running=48), now=0.0).desired == 6  # 1.5x over
    assert decode_policy().decide(4, signals(itl_s=1.0), now=0.0).desired == 8  # 10x over, capped at 2x
    assert decode_policy(max_replicas=5).decide(4, signals(itl_s=1.0), now=0.0).desired == 5


def test_signals_between_the_down_and_up_thresholds_hold_the_pool():
    d = decode_policy().decide(3, signals(kv_usage=0.5, num_running=16, itl_s=0.05), now=1000.0)
    assert (d.action, d.desired) == ("hold", 3)
    assert "within band" in d.reason


def test_scale_down_needs_every_signal_below_down_even_with_one_worker_fewer():
    # 2 workers at 6 running each would be 12 each on one worker: above the down threshold of 8.
    assert decode_policy().decide(2, signals(kv_usage=0.1, num_running=6, itl_s=0.01), now=1000.0).action == "hold"
    d = decode_policy().decide(2, signals(kv_usage=0.1, num_running=3, itl_s=0.01), now=1000.0)
    assert (d.action, d.desired) == ("scale_down", 1)
    # A slow ITL alone keeps the pool, whatever the load per worker.
    assert decode_policy().decide(2, signals(kv_usage=0.0, num_running=0, itl_s=0.05), now=1000.0).action == "hold"


def test_upscale_cooldown_holds_a_second_scale_up_until_it_expires():
    policy = decode_policy(up_cooldown=30.0)
    assert policy.decide(2, signals(kv_usage=0.9), now=100.0).desired == 3
    held = policy.decide(3, signals(kv_usage=0.9), now=110.0)
    assert (held.action, held.reason) == ("hold", "kv_usage=0.9 > 0.8, upscale cooldown")
    assert policy.decide(3, signals(kv_usage=0.9), now=131.0).desired == 4


def test_downscale_waits_its_cooldown_after_any_change():
    policy = decode_policy(down_cooldown=120.0)
    idle = signals(kv_usage=0.0, num_running=0, itl_s=0.0)
    policy.decide(1, signals(kv_usage=0.95), now=0.0)
    assert policy.decide(2, idle, now=60.0).reason == "idle, downscale cooldown"
    assert policy.decide(2, idle, now=121.0).desired == 1
    assert policy.decide(2, idle, now=122.0).action == "hold"  # the scale-down restarted the cooldown


def test_min_and_max_replicas_bound_every_decision():
    policy = decode_policy(min_replicas=2, max_replicas=4)
    assert policy.decide(1, signals(), now=0.0).desired == 2
    assert policy.decide(6, signals(), now=0.0).desired == 4
    at_max = decode_policy(max_replicas=4).decide(4, signals(kv_usage=0.99), now=0.0)
    assert (at_max.action, at_max.reason) == ("hold", "kv_usage=0.99 > 0.8, at max_replicas=4")
    at_min = decode_policy(min_replicas=2).decide(2, signals(kv_usage=0, num_running=0, itl_s=0), now=1e6)
    assert (at_min.action, at_min.reason) == ("hold", "at min_replicas")


def test_prefill_scales_on_queued_prompt_tokens_and_on_ttft():
    policy = ScalingPolicy("prefill", 0, 4, PREFILL, 0.0, 0.0)
    assert policy.decide(1, {"queued_prefill_tokens": 9000.0, "ttft_s": 0.2}, now=0.0).desired == 2
    assert policy.decide(1, {"queued_prefill_tokens": 0.0, "ttft_s": 3.0}, now=1.0).desired == 2
    # An empty prefill pool (decode prefills locally) comes back when TTFT suffers.
    assert policy.decide(0, {"queued_prefill_tokens": None, "ttft_s": 3.0}, now=2.0).desired == 1
    assert policy.decide(1, {"queued_prefill_tokens": 10.0, "ttft_s": 0.1}, now=3.0).desired == 0


def test_no_signal_holds_the_pool():
    assert decode_policy().decide(3, {"kv_usage": None, "num_running": None, "itl_s": None}, now=1e6).reason \
        == "no signal"


def test_pool_signals_average_worker_stats_and_pass_latency_quantiles():
    stats = [WorkerStats("decode-0", "decode", num_running=4, num_active_blocks=30, num_total_blocks=100),
             WorkerStats("decode-1", "decode", num_running=2, num_active_blocks=10, num_total_blocks=100)]
    assert pool_signals("decode", stats, {"itl_s": 0.02, "ttft_s": 1.0}) == \
        {"kv_usage": pytest.approx(0.2), "num_running": 3.0, "itl_s": 0.02}
    prefill = [WorkerStats("prefill-0", "prefill", queued_prefill_tokens=300)]
    assert pool_signals("prefill", prefill, {}) == {"queued_prefill_tokens": 300.0, "ttft_s": None}


def test_latency_window_gives_nearest_rank_quantiles_of_recent_samples():
    window = LatencyWindow()
    window.add("itl_s", [5.0] * 10, now=0.0)  # old samples, outside the window below
    window.add("itl_s", [i / 100 for i in range(1, 101)], now=100.0)
    assert window.quantile("itl_s", 0.9, since=50.0) == pytest.approx(0.90)
    assert window.quantile("itl_s", 1.0, since=0.0) == 5.0
    assert window.quantile("ttft_s", 0.9, since=0.0) is None


def test_autoscaler_config_rejects_a_down_threshold_not_below_up():
    with pytest.raises(ValueError, match="decode: down threshold 0.9 must be below up threshold 0.5"):
        AutoscalerConfig(decode={"kv_usage_up": 0.5, "kv_usage_down": 0.9})


# ---- the actor on a real pool -------------------------------------------------------------------

AGGRESSIVE = {"enabled": True, "interval_s": 0.5, "upscale_cooldown_s": 1.0, "downscale_cooldown_s": 3.0,
              "decode": {"running_up": 1.5, "running_down": 0.5, "kv_usage_up": 0.9, "kv_usage_down": 0.05,
                         "itl_up_s": 60.0, "itl_down_s": 30.0}}


@pytest.fixture(scope="module")
def cluster(ray_cluster, tiny_llama_dir):
    """A colocated app whose config turns the autoscaler on: `build_app` starts it, nothing else does."""
    config = ClusterConfig(model=tiny_llama_dir, served_model_name="tiny", mode="colocated", name="autoscale",
                           namespace="tandem-tests", engine={"num_kv_blocks": 256},
                           decode={"min_replicas": 1, "max_replicas": 2, "num_cpus": 0.5}, autoscaler=AGGRESSIVE)
    with serve_tandem(config) as url:
        autoscaler = ray.get_actor("autoscale-autoscaler", namespace="tandem-tests")
        yield get_controller("autoscale", "tandem-tests"), autoscaler, url


def decode_workers(controller):
    return [w.worker_id for w in ray.get(controller.membership.remote()).workers if w.pool == "decode"]


def test_load_scales_the_decode_pool_up_and_idleness_scales_it_back_down(cluster):
    controller, autoscaler, url = cluster
    client = LoadClient(url, "tiny", seed=5, max_tokens=(64, 128))

    async def load_until_scaled_up():
        stop = asyncio.Event()
        load = asyncio.create_task(client.run(stop, max_requests=300, interval_s=0.05))
        assert await wait_for_async(lambda: len(decode_workers(controller)) >= 2, 120, interval_s=0.2), \
            "load did not scale the decode pool up"
        stop.set()
        await load

    asyncio.run(load_until_scaled_up())
    assert failures(client.outcomes) == []
    assert wait_for(lambda: len(decode_workers(controller)) <= 1, 60, interval_s=0.2), \
        "idleness did not scale the decode pool down"

    decisions = ray.get(autoscaler.recent_decisions.remote())
    assert [(d.action, d.current, d.desired) for d in decisions] == [("scale_up", 1, 2), ("scale_down", 2, 1)]
    assert decisions[0].reason.startswith("num_running=")
    assert decisions[1].reason.startswith("idle: ")
    assert decisions[1].signals["itl_s"] is not None  # the ITLs the ingress observed reached the policy
    events = [(e.action, e.reason.split(":")[0]) for e in ray.get(controller.scaling_events.remote())
              if e.action in ("scale_up", "scale_down")]
    assert events == [("scale_up", "autoscaler"), ("scale_down", "autoscaler")]


def test_scaling_decisions_are_exported_as_metrics(cluster):
    controller = cluster[0]
    metrics = Metrics()
    metrics.observe_scaling(ray.get(controller.scaling_report.remote()))
    metrics.observe_scaling(ray.get(controller.scaling_report.remote()))  # a repeat changes nothing
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for f in text_string_to_metric_families(metrics.exposition({}).decode())
               for s in f.samples}
    for action in ("scale_up", "scale_down", "add", "drain", "remove"):
        assert samples[("tandem:scaling_events_total", (("action", action), ("pool", "decode")))] == 1.0
    assert samples[("tandem:autoscaler_desired_replicas", (("pool", "decode"),))] == 1.0
    assert samples[("tandem:pool_replicas", (("pool", "decode"),))] == 1.0
