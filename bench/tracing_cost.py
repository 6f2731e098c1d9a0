"""What tracing costs per request in CPU time, measured on the code paths themselves (no model).

    .venv/bin/python bench/tracing_cost.py --requests 5000

For each simulated request: the ingress opens its span and stamps its timeline, a prefill worker's
copy makes its queue and prefill spans, a decode worker's copy its transfer, decode-admission and decode
spans, the ingress merges the copies and ends its spans; spans go to an OTLP/HTTP collector in this
process through the SDK's batch processor (all of it in one process here, where serving spreads it
over three). Run with tracing on and off in the same run; prints this process's CPU microseconds per
request (request path and exporter thread) for each and their difference, the cost of turning tracing on.
"""
from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker_runtime import tracing  # noqa: E402
from engine.timeline import RequestTimeline  # noqa: E402
from bench.otlp_collector import OTLPCollector  # noqa: E402

WORKER_STAGES = {"prefill": ("prefill_queued", "prefill_started", "prefill_done"),
                 "decode": ("transfer_started", "transfer_done", "decode_admitted", "decode_started", "finished")}


def one_request(i: int) -> None:
    timeline = RequestTimeline(f"req-{i}")
    span = tracing.start_request_span(timeline)
    for stage in ("validated", "tokenized", "routed"):
        timeline.stamp(stage)
    copies = []
    for pool, phases in (("prefill", ("queue", "prefill")), ("decode", ("transfer", "decode_admission", "decode"))):
        copy = timeline.copy()
        for stage in WORKER_STAGES[pool]:
            copy.stamp(stage)
        tracing.emit_spans(copy, phases, {phases[-1]: {"tandem.worker": f"{pool}-0"}})
        copies.append(copy.copy())
    for copy in copies:
        timeline.merge(copy)
    timeline.stamp("finished")
    tracing.end_request_span(span, [timeline])


def per_request_us(n: int, flush) -> float:
    """CPU seconds of this process (the request path and the exporter's thread) per request, in us."""
    started = time.process_time()
    for i in range(n):
        one_request(i)
    flush()
    return (time.process_time() - started) / n * 1e6


def serve_collector(ready) -> None:
    collector = OTLPCollector().start()
    ready.send(collector.url)
    collector.thread.join()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=5000)
    args = p.parse_args(argv)
    # The collector runs in another process, as it would: its parsing is not this process's cost.
    parent, child = multiprocessing.Pipe()
    collector = multiprocessing.Process(target=serve_collector, args=(child,), daemon=True)
    collector.start()
    url = parent.recv()
    try:
        results = {}
        for side in ("off", "on", "off", "on"):  # twice each, alternating; the second of each is reported
            tracing.configure_tracing(url if side == "on" else None, role="bench")
            results[side] = per_request_us(args.requests, tracing.flush)
        tracing.configure_tracing(None)
    finally:
        collector.terminate()
    print(f"CPU per request: off {results['off']:.1f} us, on {results['on']:.1f} us (on - off "
          f"{results['on'] - results['off']:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
