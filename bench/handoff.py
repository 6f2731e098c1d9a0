"""Where a disaggregated request's first inter-token gap goes: from the prefill worker's first token to the
decode worker's first, under Poisson load through the real client path, with each request's stage timeline
(X-Tandem-Trace: 1). That gap is the handoff (the KV pull and joining the batch); in bench/compare.py runs
it is most of the ITL tail (bench/HISTORY.md, eighteenth and nineteenth sessions).

    .venv/bin/python bench/handoff.py --rate 1.0 --requests 40 --seed 7       # tandem defaults
    .venv/bin/python bench/handoff.py --rate 1.5 --flags "--config my.yaml"    # any `tandem serve` flags

Prints the client TTFT median and p99 and the ITL median and p99 over all requests, the ITL p99 without each
request's first gap, and for the remotely prefilled requests the medians and p90s of the first gap, of its
parts (handover, pull, admission, step_out) and of the prefill before it (prefill_wait, prefill); every
request's client times and timeline go to requests.json beside the summary:

    prefill_wait prefill_queued -> prefill_started (the prefill worker's queue)
    prefill     prefill_started -> prefill_done (its forward, as served)
    handover    prefill_done -> transfer_started  (the result reaching decode)
    pull        transfer_started -> transfer_done
    admission   decode_admitted -> decode_started (the wait for a step boundary)
    step_out    decode_started -> the client's second token (that step, and the way to the client)
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare import ROOT, running, tandem  # noqa: E402
from bench.serve import load_token_space  # noqa: E402
from bench.ttft_breakdown import traced_stream  # noqa: E402

PARTS = (("prefill_wait", "prefill_queued", "prefill_started"), ("prefill", "prefill_started", "prefill_done"),
         ("handover", "prefill_done", "transfer_started"), ("pull", "transfer_started", "transfer_done"),
         ("admission", "decode_admitted", "decode_started"))


def one(base_url: str, model: str, prompt: list[int], output_len: int, out: list) -> None:
    """Stream one completion; append (client token arrival times, the request's timeline) to `out`."""
    start, arrivals, timeline = traced_stream(base_url, model, prompt, output_len)
    out.append(([start] + arrivals, timeline))


def quantile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def breakdown(results: list[tuple[list[float], dict | None]]) -> dict:
    """Milliseconds: ITL median / p99 (all gaps, and without each request's first), and the first gap's
    parts (median, p90) over the requests prefilled remotely."""
    ttfts = [arrivals[1] - arrivals[0] for arrivals, _ in results if len(arrivals) > 1]
    results = [(arrivals[1:], timeline) for arrivals, timeline in results]
    gaps = [[b - a for a, b in zip(arrivals, arrivals[1:])] for arrivals, _ in results]
    every = [g for request in gaps for g in request]
    later = [g for request in gaps for g in request[1:]]
    parts: dict[str, list[float]] = {"first_gap": []}
    for (arrivals, timeline), request in zip(results, gaps):
        if not request or not timeline or timeline.get("prefill_path") != "remote":
            continue
        times = timeline["times"]
        parts["first_gap"].append(request[0])
        for name, start, end in PARTS:
            if start in times and end in times:
                parts.setdefault(name, []).append(times[end] - times[start])
        if "decode_started" in times:
            parts.setdefault("step_out", []).append(arrivals[1] - times["decode_started"])
    ms = 1000.0
    return {"requests": len(results), "remote": len(parts["first_gap"]),
            "ttft_median_ms": round(statistics.median(ttfts) * ms, 1),
            "ttft_p99_ms": round(quantile(ttfts, 0.99) * ms, 1),
            "itl_median_ms": round(statistics.median(every) * ms, 1), "itl_p99_ms": round(quantile(every, 0.99) * ms, 1),
            "itl_p99_without_first_ms": round(quantile(later, 0.99) * ms, 1),
            "parts_ms": {name: {"median": round(statistics.median(v) * ms, 1), "p90": round(quantile(v, 0.9) * ms, 1)}
                         for name, v in parts.items() if v}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests per second")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--flags", default="", help="extra `tandem serve` flags, space-separated")
    args = p.parse_args(argv)
    if args.rate <= 0 or args.requests < 1 or args.input_len < 1 or args.output_len < 2:
        p.error("--rate must be positive, --requests and --input-len at least 1, --output-len at least 2")
    rng = random.Random(args.seed)
    space = load_token_space(None)
    prompts = [space.sample(rng, args.input_len) for _ in range(args.requests)]
    waits = [rng.expovariate(args.rate) for _ in prompts]
    out = ROOT / "bench/results" / time.strftime("handoff-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    results: list = []
    with running(tandem("tandem", *args.flags.split()), out) as base_url:
        model = json.load(urllib.request.urlopen(base_url + "/v1/models", timeout=30))["data"][0]["id"]
        one(base_url, model, prompts[0][:16], 4, [])  # warm-up
        threads = []
        for prompt, wait in zip(prompts, waits):
            time.sleep(wait)
            threads.append(threading.Thread(target=one, args=(base_url, model, prompt, args.output_len, results)))
            threads[-1].start()
        for thread in threads:
            thread.join()
    summary = {"rate": args.rate, "seed": args.seed, "flags": args.flags, **breakdown(results)}
    (out / "handoff.json").write_text(json.dumps(summary, indent=1))
    (out / "requests.json").write_text(json.dumps(results))
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}")
    return 0 if len(results) == args.requests else 1


if __name__ == "__main__":
    sys.exit(main())
