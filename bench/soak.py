"""A soak that loses nothing: thousands of requests through the real app while clients abort, disconnect
and time out, workers are SIGKILLed and KV pulls fail on purpose; then every request must have ended in
a final event, and every worker must be back where it started: no KV block held, no lease left, nothing in
flight, memory flat.

    .venv/bin/python bench/soak.py [--requests 2000] [--seed 0] [--concurrency 12] [--kill-every-s 6]
                                   [--fault-rate 0.1] [--quick]

It starts its own local Ray and tandem app (1 prefill + 2 decode workers on a tiny random-weight Llama,
64 KV blocks each, prompts over 16 uncached tokens prefilled remotely) on 127.0.0.1, and writes a JSON
report under bench/results/. tests/test_soak.py runs a short version of `run_soak` in CI.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # before bench/: bench/router.py would shadow the `router` package
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TANDEM_NUM_THREADS", "1")

import aiohttp  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from bench.soak_report import report, summary  # noqa: E402
from bench.soak_traffic import Outcome, plan, run_traffic  # noqa: E402
from bench.soak_workers import WorkerWatch, fault_rates, ingress_pids, rss_mib  # noqa: E402
from cluster.config import ClusterConfig  # noqa: E402

MODEL = "tiny-llama"
# Ingress counters the report reads, and the label each is broken down by (None: the total).
INGRESS_COUNTERS = {"tandem:request_migrations_total": None, "tandem:request_reroutes_total": "pool",
                    "tandem:decode_worker_waits_total": "outcome", "tandem:requests_rejected_total": "reason",
                    "vllm:request_success_total": "finished_reason",
                    "tandem:flow_admitted_requests_total": "tenant", "tandem:flow_refused_requests_total": "reason",
                    "tandem:flow_cancelled_requests_total": "tenant",
                    # gauges: what flow control still counts as queued or running (0 once idle, or a grant leaked)
                    "tandem:flow_queued_requests": None, "tandem:flow_running_requests": None}


@dataclass(slots=True)
class SoakOptions:
    requests: int = 2000
    seed: int = 0
    concurrency: int = 12
    kill_every_s: float = 6.0  # mean gap between kills (each gap uniform in [0.5, 1.5] times it)
    max_kills: int = 1000
    fault_rate: float = 0.1  # the share of pulls that fail, split evenly over corrupt, stall, drop, expire
    request_timeout_s: float = 240.0  # a request without a final event by then is lost (hung)
    idle_timeout_s: float = 120.0  # for the workers to return to baseline after the traffic
    warm_up_requests: int = 12
    # A second tenant beside the soak's: `flood_requests` more (the same mix, another seed) at
    # `flood_concurrency` in flight, with its own API key, weight 1 and `max_queued` 4; both tenants share an
    # ingress queue capped at `flood_max_in_flight` placed requests, so the queue and its refusals are exercised.
    flood_requests: int = 0
    flood_concurrency: int = 48
    flood_max_in_flight: int = 16


KEYS = {"soak": "soak-key-0123456789", "flood": "flood-key-0123456789"}


def cluster_config(model_dir: str, name: str = "soak", namespace: str = "tandem",
                   backend: str = "grpc", flood_max_in_flight: int | None = None) -> ClusterConfig:
    """1 prefill + 2 decode workers with few KV blocks (64: a handful of requests fill them, so preemption
    and no_free_blocks happen), chunked prefill, short lease TTL and pull deadline (so an injected stall
    or an orphaned lease costs seconds, not half a minute). With `flood_max_in_flight`, two tenants by API
    key (KEYS), the flood tenant with `max_queued` 4, behind an ingress queue of that many placed requests."""
    tenancy = {}
    if flood_max_in_flight is not None:
        tenancy = {"api_keys": {key: tenant for tenant, key in KEYS.items()},
                   "tenants": {"soak": {"weight": 1}, "flood": {"weight": 1, "max_queued": 4}},
                   "flow": {"max_in_flight": flood_max_in_flight}}
    return ClusterConfig(model=model_dir, served_model_name=MODEL, name=name, namespace=namespace, **tenancy,
                         engine={"num_kv_blocks": 64, "max_num_batched_tokens": 64},
                         transfer={"backend": backend, "lease_ttl_s": 10, "timeout_s": 5},
                         router={"placement": "thresholds", "max_local_prefill_length": 16, "decode_wait_s": 60},
                         prefill={"replicas": 1, "num_cpus": 0.5, "num_threads": 1},
                         decode={"replicas": 2, "num_cpus": 0.5, "num_threads": 1})


async def run_soak(url: str, controller, options: SoakOptions, expected_workers: int = 3, log=print) -> dict:
    """Warm up, take the baseline, run the traffic with kills and faults, wait for idle, and report."""
    watch = WorkerWatch(controller, seed=options.seed)
    await _wait(lambda: len(watch.refresh()) == expected_workers, options.idle_timeout_s)
    soak_key = KEYS["soak"] if options.flood_requests else None
    await run_traffic(url, MODEL, [r for r in plan(options.warm_up_requests, options.seed + 1000)
                                   if r.kind in ("stream", "complete")], options.concurrency, options.request_timeout_s,
                      api_key=soak_key)
    await _wait(lambda: _idle(watch, expected_workers, {}), options.idle_timeout_s)
    start = await _snapshot(url, watch)
    baselines = {(a.worker_id, a.pid): a.used_blocks for a in start["accounting"]}

    watch.fault_rates = fault_rates(options.fault_rate)
    await asyncio.to_thread(watch.refresh)  # arms the prefill workers
    stop_kills, stop_monitor = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_monitor, args=(watch, stop_monitor), daemon=True),
               threading.Thread(target=_killer, args=(watch, options, expected_workers, stop_kills), daemon=True)]
    for t in threads:
        t.start()
    began = time.monotonic()
    progress = _Progress(options.requests + options.flood_requests, began, log, watch, ingress_pids())
    try:
        runs = [run_traffic(url, MODEL, plan(options.requests, options.seed), options.concurrency,
                            options.request_timeout_s, on_done=progress, api_key=soak_key)]
        if options.flood_requests:
            runs.append(run_traffic(url, MODEL, plan(options.flood_requests, options.seed + 7),
                                    options.flood_concurrency, options.request_timeout_s, on_done=progress,
                                    api_key=KEYS["flood"], tenant="flood", refused_pause_s=0.5))
        outcomes = [o for run in await asyncio.gather(*runs) for o in run]
    finally:
        stop_kills.set()
        threads[1].join()
    traffic_s = time.monotonic() - began
    await asyncio.to_thread(watch.disarm)
    idle_began = time.monotonic()
    idle = await _wait(lambda: _idle(watch, expected_workers, baselines), options.idle_timeout_s)
    idle_s = time.monotonic() - idle_began
    stop_monitor.set()
    threads[0].join()
    await asyncio.to_thread(watch.refresh)
    end = await _snapshot(url, watch)
    result = report(options, outcomes, watch, start, end, baselines, idle, traffic_s, idle_s)
    result["flow_at_end"] = {"queued": end["counters"].get("tandem:flow_queued_requests", 0.0),
                             "running": end["counters"].get("tandem:flow_running_requests", 0.0)}
    result["rss_timeline_mib"] = progress.rss
    return result


class _Progress:
    """Logs the finals every 100 requests; samples RSS of every process at each tenth of the run."""

    def __init__(self, total: int, began: float, log, watch: WorkerWatch, ingress: dict[str, int]):
        self.total, self.began, self.log, self.watch, self.ingress = total, began, log, watch, ingress
        self.finals: Counter[str] = Counter()
        self.rss: list[dict] = []

    def __call__(self, outcome: Outcome) -> None:
        self.finals[outcome.final or "LOST"] += 1
        done = sum(self.finals.values())
        if done % 100 == 0 or done == self.total:
            self.log(f"{done}/{self.total} in {time.monotonic() - self.began:.0f} s: {dict(self.finals)}")
        if done % max(1, self.total // 10) == 0:
            pids = {**{f"ingress {k}": pid for k, pid in self.ingress.items()}, **self.watch.pids}
            self.rss.append({"requests": done, **{f"{name} (pid {pid})": rss_mib(pid) for name, pid in pids.items()}})


def _monitor(watch: WorkerWatch, stop: threading.Event) -> None:
    while not stop.wait(1.0):
        try:
            watch.refresh()
        except Exception as exc:  # the controller busy or restarting: try again next round
            print(f"soak monitor: {type(exc).__name__}: {exc}", file=sys.stderr)


def _killer(watch: WorkerWatch, options: SoakOptions, expected: int, stop: threading.Event) -> None:
    rng = random.Random(options.seed + 1)
    while len(watch.kills) < options.max_kills and not stop.wait(options.kill_every_s * rng.uniform(0.5, 1.5)):
        try:
            watch.kill_one(rng, expected)
        except Exception as exc:
            print(f"soak killer: {type(exc).__name__}: {exc}", file=sys.stderr)


def _idle(watch: WorkerWatch, expected: int, baselines: dict) -> bool:
    accounting = watch.accounting()
    return len(accounting) == expected and all(a.settled(baselines.get((a.worker_id, a.pid), 0)) for a in accounting)


async def _wait(predicate, timeout_s: float, interval_s: float = 1.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        if await asyncio.to_thread(predicate):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(interval_s)


async def _snapshot(url: str, watch: WorkerWatch) -> dict:
    accounting = await asyncio.to_thread(watch.accounting)
    ingress = await asyncio.to_thread(ingress_pids)
    rss = {f"{a.worker_id} (pid {a.pid})": rss_mib(a.pid) for a in accounting}
    rss.update({f"ingress {name} (pid {pid})": rss_mib(pid) for name, pid in ingress.items()})
    return {"accounting": accounting, "rss_mib": rss, "counters": await scrape(url)}


async def scrape(url: str) -> dict[str, float]:
    """INGRESS_COUNTERS from /metrics, summed over replicas and workers, by their breakdown label."""
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=30)) as response:
            text = await response.text()
    out: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in INGRESS_COUNTERS:
                label = INGRESS_COUNTERS[s.name]
                out[f"{s.name}{{{label}={s.labels.get(label)}}}" if label else s.name] += s.value
    return dict(out)


def quick(options: SoakOptions) -> SoakOptions:
    """The short version (tests/test_soak.py's): 200 requests, up to two kills, more faults."""
    options.requests, options.kill_every_s, options.max_kills = 200, 4.0, 2
    options.fault_rate, options.concurrency = max(options.fault_rate, 0.15), min(options.concurrency, 6)
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = SoakOptions()
    parser.add_argument("--requests", type=int, default=defaults.requests)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency)
    parser.add_argument("--kill-every-s", type=float, default=defaults.kill_every_s)
    parser.add_argument("--max-kills", type=int, default=defaults.max_kills)
    parser.add_argument("--fault-rate", type=float, default=defaults.fault_rate)
    parser.add_argument("--flood", type=int, default=defaults.flood_requests,
                        help="requests of a second, flooding tenant beside the soak's (0: none)")
    parser.add_argument("--flood-concurrency", type=int, default=defaults.flood_concurrency)
    parser.add_argument("--backend", choices=("grpc", "torch_dist"), default="grpc")
    parser.add_argument("--quick", action="store_true", help="the CI version: 200 requests, up to 2 kills")
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: bench/results/soak-*.json)")
    args = parser.parse_args()
    options = SoakOptions(args.requests, args.seed, args.concurrency, args.kill_every_s, args.max_kills,
                          args.fault_rate, flood_requests=args.flood, flood_concurrency=args.flood_concurrency)
    if args.quick:
        options = quick(options)

    from bench.local_serve import serve_app
    from cluster.controller import get_controller
    from engine.model_loader import build_random_model

    model_dir = str(build_random_model(Path(tempfile.gettempdir()) / "tandem-soak-tiny-llama", "llama", seed=0))
    config = cluster_config(model_dir, backend=args.backend,
                            flood_max_in_flight=options.flood_max_in_flight if options.flood_requests else None)
    print(f"soak: {options}")
    with serve_app(config) as url:
        result = asyncio.run(run_soak(url, get_controller(config.name, config.namespace), options))
    result["command"] = " ".join([".venv/bin/python", "bench/soak.py", *sys.argv[1:]])
    result["date"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    print(summary(result))
    out = args.out or REPO / "bench" / "results" / f"soak-{time.strftime('%Y%m%d-%H%M%S')}-seed{options.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    print(f"report: {out}")
    sys.exit(0 if result["lost"] == 0 and result["leaked_blocks"] == 0 and result["leaked_leases"] == 0 else 1)


if __name__ == "__main__":
    main()
