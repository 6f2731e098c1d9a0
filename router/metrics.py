"""Prometheus metrics, with vLLM's names where the meaning is the same and `tandem:` names otherwise.

Request-level histograms are observed by the ingress as token deltas arrive. Per-worker gauges and
counters come from the workers' own stats, which the ingress polls anyway for routing; a collector
turns the latest snapshot into series labelled with pool and worker. Scaling series mirror the
controller's report.

Several ingress replicas: Serve's proxy sends a scrape to any one replica, so each replica's request
series would show only its own share, and a counter would jump backwards from one scrape to the next.
Each replica therefore publishes its own series to a `MetricsHub` actor, and a scrape answers with every
live replica's series, each labelled `replica` (sum them away: `sum without (replica) (...)`). The
per-worker and scaling series have one source each (the worker, the controller) and carry no replica label.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from worker_runtime.membership import ScalingReport
from worker_runtime.protocol import WorkerStats
from engine.timeline import RequestTimeline
from router.trace_store import TraceStore

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5)

# Where each phase of engine/timeline.py runs: the ingress, the worker that computes the prompt, or decode.
STAGE_POOLS = {"validation": "ingress", "tokenization": "ingress", "routing": "ingress", "queue": "prompt",
               "prefill": "prompt", "transfer": "decode", "decode_admission": "decode", "decode": "decode"}


class Metrics:
    """One ingress replica's series: `registry` holds what this replica observes (published to the hub
    and labelled with the replica there), `shared` what it mirrors from the workers and the controller."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["pool", "worker"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between consecutive tokens.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled on the worker "
                               "that computes the prompt.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First scheduled to first token on "
                                      "a prefill worker.", labels, buckets=LATENCY_BUCKETS, registry=r)
        self.stages = Histogram("tandem:request_stage_seconds", "Time requests spend in each stage (validation, "
                                "tokenization, routing at the ingress; queue and prefill on the worker that "
                                "computes the prompt; transfer, decode_admission and decode on the decode "
                                "worker).", ["stage", "pool", "worker"], buckets=LATENCY_BUCKETS, registry=r)
        self.transfer_time = Histogram("tandem:kv_transfer_seconds", "Time to pull one request's KV.", labels,
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_queue_wait = Histogram("tandem:prefill_queue_wait_seconds",
                                            "Time a request waited at the ingress for a slot in a full prefill "
                                            "queue, by where it was prefilled then.", ["where"],
                                            buckets=LATENCY_BUCKETS, registry=r)
        self.requests = Counter("vllm:request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=r)
        self.routing = Counter("tandem:routing_decisions", "Placement decisions.", ["pool", "worker", "reason"],
                               registry=r)
        self.routing_hits = Counter("tandem:routing_prefix_hit_blocks", "Prompt blocks cached on the chosen worker.",
                                    ["pool", "worker"], registry=r)
        self.peer_prefix = Counter("tandem:routing_peer_prefix", "Prompts whose worker (prefill, or decode computing "
                                   "it) was told to pull the prefix from a peer holding it (issue 41), by holder and "
                                   "puller.",
                                   ["holder", "worker"], registry=r)
        self.routing_lora = Counter("tandem:routing_lora", "Placements of requests that run a LoRA adapter, by pool, "
                                    "worker and whether a slot there held it already (hit) or it loads (load).",
                                    ["pool", "worker", "outcome"], registry=r)
        self.local_factor = Gauge("tandem:routing_local_prediction_factor", "What placement scales its predicted "
                                  "first token of a chunked local prefill beside running streams by, per power-of-"
                                  "two bucket of its uncached prompt tokens: the median of the recent such prefills' "
                                  "measured over predicted seconds (1 until a few were measured; "
                                  "Router.local_factor).", ["tokens"], registry=r)
        self.migrations = Counter("tandem:request_migrations", "Requests moved on after their decode worker "
                                  "failed mid-stream, by the worker that failed.", ["worker"], registry=r)
        self.rejected = Counter("tandem:requests_rejected", "Requests refused at admission.", ["reason"],
                                registry=r)
        self.reroutes = Counter("tandem:request_reroutes", "Requests placed again before their first token because "
                                "a worker failed (e.g. a prefill worker killed mid-prefill) or was draining, by "
                                "that worker.", ["pool", "worker", "cause"], registry=r)
        self.decode_waits = Counter("tandem:decode_worker_waits", "Requests that found no schedulable decode "
                                    "worker while the pool could heal (a worker restarting or being replaced) "
                                    "and waited for one, on arrival or to migrate, by how the wait ended.",
                                    ["stage", "outcome"], registry=r)
        self.audit_records = Counter("tandem:audit_records", "Audit records written.", registry=r)
        self.audit_dropped = Counter("tandem:audit_records_dropped", "Audit records not written, by reason "
                                     "(queue_full, write_failed, build_failed).", ["reason"], registry=r)
        self.flow = FlowMetrics(r)
        self.workers = WorkerStatsCollector()
        self.scaling = ScalingCollector()
        self.shared = CollectorRegistry()
        self.shared.register(self.workers)
        self.shared.register(self.scaling)

    def observe_finished(self, pool: str, worker: str, timeline: RequestTimeline, token_times: list[float],
                         finish_reason: str | None) -> None:
        """Request-level latencies from the request's timeline and the arrival time of each token; `worker`
        is the decode worker that streamed them."""
        times = timeline.times
        arrival = times.get("arrival")
        if arrival is None or not token_times:
            return
        self.ttft.labels(pool, worker).observe(token_times[0] - arrival)
        self.e2e.labels(pool, worker).observe(token_times[-1] - arrival)
        for a, b in zip(token_times, token_times[1:]):
            self.itl.labels(pool, worker).observe(b - a)
        # The prompt's queue is on the worker that computes it: the prefill worker, or decode when local.
        remote = timeline.prefill_path == "remote" and timeline.prefill_worker is not None
        prompt_pool, prompt_worker = ("prefill", timeline.prefill_worker) if remote else (pool, worker)
        if "prefill_started" in times:
            self.queue.labels(prompt_pool, prompt_worker).observe(max(times["prefill_started"] - arrival, 0.0))
        phases = timeline.phase_seconds()
        if "prefill" in phases:
            self.prefill_time.labels(prompt_pool, prompt_worker).observe(phases["prefill"])
        if "transfer" in phases:
            self.transfer_time.labels(pool, worker).observe(phases["transfer"])
        for stage, seconds in phases.items():
            where = STAGE_POOLS[stage]
            stage_pool, stage_worker = ("ingress", "ingress") if where == "ingress" else \
                (prompt_pool, prompt_worker) if where == "prompt" else (pool, worker)
            self.stages.labels(stage, stage_pool, stage_worker).observe(seconds)
        self.requests.labels(pool, worker, finish_reason or "unknown").inc()

    def observe_scaling(self, report: ScalingReport) -> None:
        """Mirror the controller's `scaling_report()`."""
        self.scaling.report = report

    def own_series(self) -> bytes:
        """This replica's own series in the text format, as published to the hub."""
        return generate_latest(self.registry)

    def exposition(self, replicas: dict[str, bytes]) -> bytes:
        """The scrape: every replica's own series (`replicas`: replica id -> `own_series()`) labelled
        with its replica, then the shared series."""
        return labelled_series(replicas, "replica") + generate_latest(self.shared)


def labelled_series(texts: dict[str, bytes], label: str) -> bytes:
    """Series in the text format from several sources (replicas, models), merged by family, each sample
    labelled `label` = its source."""
    merged = CollectorRegistry()
    merged.register(_LabelledSeries(texts, label))
    return generate_latest(merged)


class _LabelledSeries:
    """A collector of several sources' series, each sample labelled with its source."""

    def __init__(self, texts: dict[str, bytes], label: str):
        self.texts, self.label = texts, label

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for source, text in sorted(self.texts.items()):
            for family in text_string_to_metric_families(text.decode()):
                if family.name.endswith("_created"):
                    continue  # creation times are per replica and mean nothing summed
                merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                merged.samples += [s._replace(labels={**s.labels, self.label: source}) for s in family.samples
                                   if not s.name.endswith("_created")]
        return families.values()


class MetricsHub:
    """Holds each ingress replica's latest published series (a Ray actor, one per cluster). A replica not
    heard from within `ttl_s` is gone, and so are its series, as a pod's are when the pod goes."""

    def __init__(self, ttl_s: float = 30.0, recent_requests: int = 1000):
        self.ttl_s = ttl_s
        self.series: dict[str, tuple[float, bytes]] = {}
        self.flows: dict[str, tuple[float, dict]] = {}  # replica -> its ingress queue (`tandem status`)
        self.lock = threading.Lock()
        # Recent requests' timelines from every replica, so `tandem trace` finds one whichever replica
        # served it and whichever the admin call lands on.
        self.traces = TraceStore(recent_requests)

    def add_traces(self, traces: list[dict]) -> None:
        """Replicas' finished requests (request_trace.timeline_body), oldest first."""
        with self.lock:
            for trace in traces:
                self.traces.add(trace["request_id"], trace)

    def find_trace(self, request_id: str) -> dict | None:
        with self.lock:
            return self.traces.get(request_id)

    def publish(self, replica: str, text: bytes, flow: dict | None = None) -> dict[str, bytes]:
        """Store `replica`'s series (and its ingress queue, `flow`); returns every live replica's series."""
        now = time.monotonic()
        with self.lock:
            self.series[replica] = (now, text)
            self.series = {r: (t, s) for r, (t, s) in self.series.items() if now - t <= self.ttl_s}
            if flow is not None:
                self.flows[replica] = (now, flow)
            self.flows = {r: (t, f) for r, (t, f) in self.flows.items() if now - t <= self.ttl_s}
            return {r: s for r, (_, s) in self.series.items()}

    def replica_flows(self) -> list[dict]:
        """Every live replica's ingress queue as it last published it, with its age in seconds."""
        now = time.monotonic()
        with self.lock:
            return [{**flow, "age_s": round(now - at, 1)} for _, (at, flow) in sorted(self.flows.items())
                    if now - at <= self.ttl_s]

    def forget(self, replica: str) -> None:
        with self.lock:
            self.series.pop(replica, None)
            self.flows.pop(replica, None)


class FlowMetrics:
    """The ingress queue's series (router/api/flow_control.py), per tenant and priority."""

    def __init__(self, r: CollectorRegistry):
        self.queued = Gauge("tandem:flow_queued_requests", "Requests waiting in the ingress queue for room.",
                            ["tenant"], registry=r)
        self.running = Gauge("tandem:flow_running_requests", "Requests let through flow control and not ended.",
                             ["tenant"], registry=r)
        self.admitted = Counter("tandem:flow_admitted_requests", "Requests let through flow control (at once or "
                                "after queueing).", ["tenant", "priority"], registry=r)
        self.refused = Counter("tandem:flow_refused_requests", "Requests refused by flow control, by reason "
                               "(tokens_per_minute, max_queued: 429; shed, ledger: 503).",
                               ["tenant", "priority", "reason"],
                               registry=r)
        self.cancelled = Counter("tandem:flow_cancelled_requests", "Queued requests whose client left before "
                                 "their turn.", ["tenant"], registry=r)
        self.queue_time = Histogram("tandem:flow_queue_seconds", "Time in the ingress queue before placement.",
                                    ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.shed_factor = Gauge("tandem:flow_shed_prediction_factor", "What shedding scales a first-token "
                                 "prediction by: the flow.shed_quantile of the admitted requests' measured first "
                                 "token over its prediction (1 until enough were measured).", registry=r)
        self.ahead = Counter("tandem:flow_ahead_requests", "Requests let on ahead of the prompts queued on workers, "
                             "their tenant being below its share (FlowControl._may_go_ahead).", ["tenant"],
                             registry=r)
        self.quick = Counter("tandem:flow_quick_requests", "Requests let on past the held-back head of the ingress "
                             "queue: their first token, placed now, comes within a quarter of the head's time "
                             "(FlowControl._quick_past).", ["tenant"], registry=r)
        self.pump_errors = Counter("tandem:flow_pump_errors", "Times the ingress queue's watcher failed to let "
                                   "requests on, or could not predict its requests' first tokens to let a quick one "
                                   "past the head (a bug; logged, and the queue kept its order). Zero normally.",
                                   registry=r)
        self.ledger_errors = Counter("tandem:flow_ledger_errors", "Calls to the quota ledger (tenants' quotas shared "
                                     "by several ingress replicas) that got no answer; the requests they were for "
                                     "got 503. Zero normally.", registry=r)


class ScalingCollector:
    """The controller's scaling report as series: event totals since the controller started, and each
    pool's current and desired size."""

    def __init__(self):
        self.report: ScalingReport | None = None

    def collect(self) -> Iterable[Metric]:
        events = CounterMetricFamily("tandem:scaling_events", "Scaling decisions (scale_up, scale_down) and worker "
                                     "changes (add, drain, remove, unhealthy, recovered, stalled: restarted because its "
                                     "engine loop was stuck).", labels=["pool", "action"])
        replicas = GaugeMetricFamily("tandem:pool_replicas", "Workers per pool.", labels=["pool"])
        desired = GaugeMetricFamily("tandem:autoscaler_desired_replicas",
                                    "Workers the last scaling decision (autoscaler or operator) asked for.",
                                    labels=["pool"])
        if self.report is not None:
            for (pool, action), count in sorted(self.report.events.items()):
                events.add_metric([pool, action], float(count))
            for pool, n in self.report.replicas.items():
                replicas.add_metric([pool], float(n))
            for pool, n in self.report.desired.items():
                desired.add_metric([pool], float(n))
        return [events, replicas, desired]


class WorkerStatsCollector:
    """Exports each worker's last reported stats (worker_runtime.protocol.WorkerStats) and transfer counters."""

    def __init__(self):
        self.stats: dict[str, WorkerStats] = {}
        self.transfer: dict[str, dict] = {}

    def update(self, stats: WorkerStats, transfer: dict | None = None) -> None:
        self.stats[stats.worker_id] = stats
        if transfer is not None:
            self.transfer[stats.worker_id] = transfer

    def forget(self, worker_id: str) -> None:
        self.stats.pop(worker_id, None)
        self.transfer.pop(worker_id, None)

    def collect(self):
        stats = list(self.stats.values())
        for name, (doc, get) in _STATS_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            for s in stats:
                family.add_metric([s.pool, s.worker_id], float(get(s)))
            yield family
        for name, (doc, get) in _STATS_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            for s in stats:
                family.add_metric([s.pool, s.worker_id], float(get(s)))
            yield family
        yield from _measured_costs(stats)
        yield from _kv_tiers(stats)
        yield from _lora(stats)
        yield from _spec_decode(stats)
        yield from _transfer(self.transfer)


_LABELS = ["pool", "worker"]
# The series each worker's stats give directly: name -> (help, value).
_STATS_GAUGES = {
    "vllm:num_requests_running": ("Sequences in the running batch.", lambda s: s.num_running),
    "vllm:num_requests_waiting": ("Requests waiting to be scheduled.", lambda s: s.num_waiting),
    "vllm:kv_cache_usage_perc": ("Fraction of KV blocks in use.", lambda s: s.kv_usage),
    "tandem:queued_prefill_tokens": ("Prompt tokens accepted but not computed.", lambda s: s.queued_prefill_tokens),
    "tandem:cpu_kernel_fallbacks": ("C kernels of the CPU path that could not be built or loaded, so torch runs "
                                    "their work, slower (should stay 0).", lambda s: s.cpu_kernel_fallbacks),
    "tandem:worker_tp_ranks": ("Ranks of the worker (its tensor_parallel_size).", lambda s: s.tensor_parallel_size),
    "tandem:worker_tp_ranks_alive": ("Of them, running; fewer fails the worker's health check.",
                                     lambda s: s.tp_ranks_alive),
}
_STATS_COUNTERS = {
    "vllm:prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries),
    "vllm:prefix_cache_hits": ("Prompt tokens found in the prefix cache.", lambda s: s.prefix_cache_hits),
    "vllm:prompt_tokens": ("Prompt tokens processed.", lambda s: s.prompt_tokens),
    "vllm:generation_tokens": ("Tokens generated.", lambda s: s.generation_tokens),
    "vllm:num_preemptions": ("Requests preempted for lack of KV blocks.", lambda s: s.num_preemptions),
    "tandem:prefill_yield_chunks": ("Prompt chunks cut to flow.yield_slice_ms so that a more urgent prompt "
                                    "queued there goes next.", lambda s: s.prefill_yield_chunks),
    "tandem:tp_collectives_over_gloo": ("A CPU tensor-parallel worker's collectives too large for its ranks' "
                                        "shared memory, sent over Gloo instead, slower (should stay 0).",
                                        lambda s: s.tp_shm_too_large),
    "tandem:cpu_busy_lends": ("A busy decode worker's pauses between steps that lent its cores to a prefill "
                              "(cpu.lend_busy_ms).", lambda s: s.cpu_busy_lends),
    "tandem:cpu_busy_lent_seconds": ("Seconds of those pauses.", lambda s: s.cpu_busy_lent_s),
    "tandem:cpu_reclaim_timeouts": ("Steps a lender began before the borrowing forward let go of its cores "
                                    "(should stay 0).", lambda s: s.cpu_reclaim_timeouts),
}


def _transfer(transfer: dict[str, dict]) -> Iterable[Metric]:
    """The decode workers' transfer counters: bytes pulled, prefills by where they ran, pulls by path,
    and pulls that failed."""
    labels = _LABELS
    transfer_bytes = CounterMetricFamily("tandem:kv_transfer_bytes", "KV bytes pulled by decode workers.",
                                         labels=labels)
    for worker_id, t in transfer.items():
        if "bytes_pulled" in t:
            transfer_bytes.add_metric(["decode", worker_id], float(t["bytes_pulled"]))
    yield transfer_bytes
    remote = CounterMetricFamily("tandem:prefills", "Prefills by where they ran (remote or local).",
                                 labels=labels + ["where"])
    for worker_id, t in transfer.items():
        if "remote_prefills" in t:
            remote.add_metric(["decode", worker_id, "remote"], float(t["remote_prefills"]))
            remote.add_metric(["decode", worker_id, "local"], float(t["local_prefills"]))
    yield remote
    paths = CounterMetricFamily("tandem:kv_pulls", "KV pulls by path: shm (copied from a prefill worker's "
                                "shared cache on the same host) or network.", labels=labels + ["path"])
    unavailable = CounterMetricFamily("tandem:kv_shm_unavailable", "Same-host KV pulls that could not map "
                                      "the prefill worker's shared cache and went over the network.",
                                      labels=labels)
    for worker_id, t in transfer.items():
        if "shm_pulls" in t:
            paths.add_metric(["decode", worker_id, "shm"], float(t["shm_pulls"]))
            paths.add_metric(["decode", worker_id, "network"], float(t["remote_prefills"] - t["shm_pulls"]))
            unavailable.add_metric(["decode", worker_id], float(t["shm_unavailable"]))
    yield paths
    yield unavailable
    failures = CounterMetricFamily("tandem:kv_transfer_failures",
                                   "KV pulls that failed and fell back to local recompute, by reason.",
                                   labels=labels + ["reason"])
    for worker_id, t in transfer.items():
        for reason, n in t.get("transfer_failures_by_reason", {}).items():
            failures.add_metric(["decode", worker_id, reason], float(n))
    yield failures
    yield from _peer_pulls(transfer)


PEER_PULL_COUNTERS = {  # name -> (help, transfer_stats key)
    "tandem:kv_peer_pulls": ("Prompt prefixes a decode worker pulled from a peer holding them instead of computing "
                             "them.", "peer_pulls"),
    "tandem:kv_peer_pull_blocks": ("KV blocks pulled from peers.", "peer_blocks_pulled"),
    "tandem:kv_peer_pull_bytes": ("KV bytes pulled from peers.", "peer_bytes_pulled"),
    "tandem:kv_peer_pull_seconds": ("Seconds spent pulling from peers.", "peer_pull_seconds"),
}


def _peer_pulls(transfer: dict[str, dict]) -> Iterable[Metric]:
    """Decode workers' prefix pulls from peers, and those that failed and were computed instead, by reason."""
    labels = _LABELS
    pulling = {w: t for w, t in transfer.items() if "peer_pulls" in t}
    for name, (doc, key) in PEER_PULL_COUNTERS.items():
        family = CounterMetricFamily(name, doc, labels=labels)
        for worker_id, t in pulling.items():
            family.add_metric(["decode", worker_id], float(t[key]))
        yield family
    failures = CounterMetricFamily("tandem:kv_peer_pull_failures", "Prefix pulls from peers that failed: the "
                                   "prompt was computed instead, by reason.", labels=labels + ["reason"])
    for worker_id, t in pulling.items():
        for reason, n in t["peer_pull_failures_by_reason"].items():
            failures.add_metric(["decode", worker_id, reason], float(n))
    yield failures


def _measured_costs(stats: list) -> Iterable[Metric]:
    """What placement decides with: each worker's measured prefill speed and decode step time per bucket,
    and (decode workers) KV pull speed."""
    labels = ["pool", "worker"]
    speed = GaugeMetricFamily("tandem:prefill_tokens_per_second", "Measured prompt tokens per second, by the "
                              "context length a chunk ends at (power-of-two bucket).", labels=labels + ["context"])
    step = GaugeMetricFamily("tandem:decode_step_seconds", "Measured time of a step, by decode batch size "
                             "(power-of-two bucket).", labels=labels + ["batch"])
    pull = GaugeMetricFamily("tandem:kv_pull_gbps", "Measured KV pull bandwidth of a decode worker (GB/s), "
                             "from pulls of at least 4 MiB.", labels=labels)
    latency = GaugeMetricFamily("tandem:kv_pull_latency_seconds", "Measured fixed cost of a decode worker's "
                                "KV pull, from smaller pulls.", labels=labels)
    for s in stats:
        for context, value in sorted(s.step_costs.prefill_tokens_per_s.items()):
            speed.add_metric([s.pool, s.worker_id, str(context)], value)
        for batch, value in sorted(s.step_costs.decode_step_s.items()):
            step.add_metric([s.pool, s.worker_id, str(batch)], value)
        if s.pool == "decode":
            pull.add_metric([s.pool, s.worker_id], s.kv_pull_gbps)
            latency.add_metric([s.pool, s.worker_id], s.kv_pull_latency_s)
    return [speed, step, pull, latency]


LORA_SERIES = {  # name -> (help, LoRAManager.summary key)
    "tandem:lora_loads": ("LoRA adapters copied into a device slot.", "loads"),
    "tandem:lora_evictions": ("LoRA adapter loads that replaced another adapter in its slot (LRU).", "evictions"),
    "tandem:lora_reads": ("LoRA adapters read from disk into host memory.", "reads"),
    "tandem:lora_slot_waits": ("Admissions deferred because every LoRA slot served running requests of other "
                               "adapters.", "waits"),
    "tandem:lora_load_seconds": ("Seconds spent copying LoRA adapters into slots.", "load_seconds"),
}


def _lora(stats: list) -> Iterable[Metric]:
    """Per worker with LoRA enabled: slot counters, and vLLM's lora_requests_info (the adapters its running and
    waiting requests use, as labels of a gauge whose value is the time of the report)."""
    with_lora = [s for s in stats if s.lora]
    for name, (doc, key) in LORA_SERIES.items():
        family = CounterMetricFamily(name, doc, labels=_LABELS)
        for s in with_lora:
            family.add_metric([s.pool, s.worker_id], float(s.lora[key]))
        yield family
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                             labels=_LABELS + ["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    now = time.time()
    for s in with_lora:
        info.add_metric([s.pool, s.worker_id, str(s.lora["max_loras"]), ",".join(sorted(s.lora["running"])),
                         ",".join(sorted(s.lora["waiting"]))], now)
    yield info


KV_TIER_SERIES = {  # name -> (help, KVTiers.stats key, counter?)
    "tandem:kv_tier_capacity_blocks": ("Blocks a tier below the KV cache holds at most.", "num_slots", False),
    "tandem:kv_tier_blocks": ("Blocks a tier below the KV cache holds now.", "num_used", False),
    "tandem:kv_tier_stored_blocks": ("Blocks demoted into a tier (from the cache, or from the tier above).",
                                     "stored", True),
    "tandem:kv_tier_hits": ("Blocks promoted from a tier back into the cache for a prompt (prefix hits "
                            "that would have been recomputed without the tier).", "hits", True),
    "tandem:kv_tier_evictions": ("Blocks a tier's LRU dropped (down to the next tier, if any).", "evicted", True),
    "tandem:kv_tier_promote_seconds": ("Seconds spent copying hits back into the cache.", "promote_seconds", True),
}


def _kv_tiers(stats: list) -> Iterable[Metric]:
    """Per worker and tier below its KV cache: capacity, use, and what moved; and failed copies (stay 0)."""
    labels = ["pool", "worker", "tier"]
    tiered = [s for s in stats if s.kv_tiers]
    for name, (doc, key, counter) in KV_TIER_SERIES.items():
        family = (CounterMetricFamily if counter else GaugeMetricFamily)(name, doc, labels=labels)
        for s in tiered:
            for tier, values in s.kv_tiers["tiers"].items():
                family.add_metric([s.pool, s.worker_id, tier], float(values[key]))
        yield family
    failures = CounterMetricFamily("tandem:kv_tier_copy_failures", "Copies into a KV tier that failed: their "
                                   "blocks were dropped from the tier (should stay 0).", labels=["pool", "worker"])
    for s in tiered:
        failures.add_metric([s.pool, s.worker_id], float(s.kv_tiers["copy_failures"]))
    yield failures
    remote = CounterMetricFamily("tandem:kv_tier_remote_failures", "Calls to the shared remote KV store that failed: "
                                 "reads became misses (the prefix was computed), writes were skipped (should stay 0).",
                                 labels=["pool", "worker"])
    for s in tiered:
        remote.add_metric([s.pool, s.worker_id], float(s.kv_tiers.get("remote_failures", 0)))
    yield remote


SPEC_DECODE_COUNTERS = {
    "vllm:spec_decode_num_drafts": ("Drafts verified (one per speculating request and step).", "num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Draft tokens proposed.", "num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Draft tokens accepted.", "num_accepted_tokens"),
}


def _spec_decode(stats: list) -> Iterable[Metric]:
    """Speculative decoding counters of the workers that speculated, with vLLM's names."""
    labels = ["pool", "worker"]
    speculated = [s for s in stats if s.spec_decode is not None]
    for name, (doc, attr) in SPEC_DECODE_COUNTERS.items():
        family = CounterMetricFamily(name, doc, labels=labels)
        for s in speculated:
            family.add_metric([s.pool, s.worker_id], float(getattr(s.spec_decode, attr)))
        yield family
    per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                  "Draft tokens accepted, by position in the draft.", labels=labels + ["position"])
    for s in speculated:
        for position, n in enumerate(s.spec_decode.num_accepted_tokens_per_pos):
            per_pos.add_metric([s.pool, s.worker_id, str(position)], float(n))
    yield per_pos
