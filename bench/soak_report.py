"""bench/soak.py's report: the figures of one soak as a dict (written as JSON) and as a printed table."""
from __future__ import annotations

from collections import Counter
from dataclasses import asdict

from bench.soak_traffic import CLIENT_ENDED, KINDS, Outcome


def report(options, outcomes: list[Outcome], watch, start: dict, end: dict, baselines: dict, idle: bool,
           traffic_s: float, idle_s: float) -> dict:
    """Everything the soak found. `start`/`end`: snapshots (accounting, rss_mib, counters); `baselines`:
    (worker, pid) -> used blocks at the start."""
    lost = [o for o in outcomes if o.final is None]
    totals = watch.totals()
    counters = {k: v - start["counters"].get(k, 0.0) for k, v in end["counters"].items()
                if v != start["counters"].get(k, 0.0)}
    leaked_blocks = sum(max(0, a.used_blocks - baselines.get((a.worker_id, a.pid), 0)) for a in end["accounting"])
    rss = {name: {"start": start["rss_mib"].get(name), "end": mib} for name, mib in end["rss_mib"].items()}
    rss.update({name: {"start": mib, "end": None} for name, mib in start["rss_mib"].items() if name not in rss})
    return {
        "options": asdict(options),
        "requests": len(outcomes),
        "finals": dict(Counter(o.final or "LOST" for o in outcomes)),
        "by_kind": {kind: dict(Counter(o.final or "LOST" for o in outcomes if o.kind == kind)) for kind in KINDS},
        "by_tenant": {t: dict(Counter(o.final or "LOST" for o in outcomes if o.tenant == t))
                      for t in sorted({o.tenant for o in outcomes})},
        "lost": len(lost),
        "lost_examples": [asdict(o) for o in lost[:20]],
        "wrong_length": sum(o.wrong_length for o in outcomes),
        "server_errors": sum(_server_error(o) for o in outcomes),
        "server_error_examples": [asdict(o) for o in outcomes if _server_error(o)][:20],
        "client_ended": sum(o.final in CLIENT_ENDED for o in outcomes),
        "faults_injected": {k.removeprefix("fault_"): v for k, v in totals.items()
                            if k.startswith("fault_") and k != "fault_pulls"},
        "pulls_seen_by_injector": totals.get("fault_pulls", 0),
        "recomputes": {k.removeprefix("recompute_"): v for k, v in totals.items() if k.startswith("recompute_") and v},
        "prefills": {"remote": totals.get("remote_prefills", 0), "local": totals.get("local_prefills", 0)},
        "kills": [asdict(k) for k in watch.kills],
        "kills_by_pool": dict(Counter(k.pool for k in watch.kills)),
        "processes_per_worker": dict(Counter(worker for worker, _ in watch.processes)),
        "ingress_counters": counters,
        "idle": idle,
        "leaked_blocks": leaked_blocks,
        "leaked_leases": sum(a.leases for a in end["accounting"]),
        "stuck_in_flight": sum(a.in_flight + a.num_running + a.num_waiting for a in end["accounting"]),
        "workers_at_end": [asdict(a) for a in end["accounting"]],
        "rss_mib": rss,
        "traffic_s": round(traffic_s, 1),
        "idle_wait_s": round(idle_s, 1),
    }


def _server_error(o: Outcome) -> bool:
    return o.final in ("error", "error_event") or (o.final or "").startswith("http_5")


def summary(r: dict) -> str:
    """The report as a plain-text table."""
    c = r["ingress_counters"]

    def counter(prefix: str) -> dict:
        return {k[len(prefix) + 1:-1].split("=", 1)[1]: int(v) for k, v in c.items() if k.startswith(prefix + "{")}

    rows = [
        ("requests", r["requests"]),
        ("final events", _fmt(r["finals"])),
        *[(f"  {kind}", _fmt(finals)) for kind, finals in r["by_kind"].items()],
        *([(f"  tenant {t}", _fmt(finals)) for t, finals in r.get("by_tenant", {}).items()]
          if len(r.get("by_tenant", {})) > 1 else []),
        ("lost (no final event)", r["lost"]),
        ("length finish with wrong token count", r["wrong_length"]),
        ("server errors (finish error, error event, 5xx)", r["server_errors"]),
        ("faults injected", _fmt(r["faults_injected"]) + f" (total {sum(r['faults_injected'].values())} "
                            f"of {r['pulls_seen_by_injector']} pulls)"),
        ("worker kills", f"{len(r['kills'])} ({_fmt(r['kills_by_pool'])})"),
        ("processes per worker", _fmt(r["processes_per_worker"])),
        ("migrations", int(c.get("tandem:request_migrations_total", 0))),
        ("reroutes", _fmt(counter("tandem:request_reroutes_total"))),
        ("decode waits", _fmt(counter("tandem:decode_worker_waits_total"))),
        ("rejected", _fmt(counter("tandem:requests_rejected_total"))),
        *([("flow admitted (by tenant)", _fmt(counter("tandem:flow_admitted_requests_total"))),
           ("flow refused (by reason)", _fmt(counter("tandem:flow_refused_requests_total"))),
           ("flow cancelled while queued", _fmt(counter("tandem:flow_cancelled_requests_total")))]
          if len(r.get("by_tenant", {})) > 1 else []),
        ("ingress request_success", _fmt(counter("vllm:request_success_total"))),
        ("recomputes (failed pulls)", _fmt(r["recomputes"]) + f" (total {sum(r['recomputes'].values())})"),
        ("prefills", _fmt(r["prefills"])),
        ("idle at end", f"{r['idle']} (after {r['idle_wait_s']} s)"),
        ("leaked blocks", r["leaked_blocks"]),
        ("leaked leases", r["leaked_leases"]),
        ("stuck in flight", r["stuck_in_flight"]),
        *([("flow control at end (queued, running)", f"{r['flow_at_end']['queued']:.0f}, "
                                                     f"{r['flow_at_end']['running']:.0f}")]
          if "flow_at_end" in r else []),
        ("traffic", f"{r['traffic_s']} s"),
        *[(f"RSS {name}", _rss(v)) for name, v in sorted(r["rss_mib"].items())],
        *[(f"RSS {name} by requests", _timeline(r.get("rss_timeline_mib", []), name))
          for name in sorted(r["rss_mib"]) if name.startswith("ingress")],
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _fmt(d: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items(), key=lambda kv: -kv[1])) or "-"


def _rss(v: dict) -> str:
    start, end = v["start"], v["end"]
    if start is None or end is None:
        return f"start {start and round(start)} MiB, end {end and round(end)} MiB (process not there throughout)"
    return f"{start:.0f} -> {end:.0f} MiB ({end - start:+.0f})"


def _timeline(samples: list[dict], name: str) -> str:
    """`name`'s RSS at each tenth of the run (the ingress's: is it flat after warm-up?)."""
    points = [(s["requests"], s[name]) for s in samples if s.get(name) is not None]
    return ", ".join(f"{n}: {mib:.0f}" for n, mib in points) or "-"
