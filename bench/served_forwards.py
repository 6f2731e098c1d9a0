"""Where a served run's first tokens went, from bench/serve.py's JSON (run with --tandem-trace): TTFT,
the prefill forwards (on the prefill worker's own core, or partly on lent cores), the prefill queue, ITL
and throughput. `.venv/bin/python bench/served_forwards.py RESULT.json [...]` (bench/served_cpu.sh runs it)."""
import json
import statistics
import sys

from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve_metrics import percentile  # noqa: E402


def summary(path: str) -> str:
    run = json.load(open(path))["runs"][0]
    done = [r for r in run["requests"] if r["success"] and r.get("timeline")]
    ttft = [r["ttft"] * 1e3 for r in done]
    forwards = [(r["timeline"].get("prefill_forward_s") or 0) * 1e3 for r in done]
    own = [f for f, r in zip(forwards, done) if f and not r["timeline"].get("prefill_borrowed_steps")]
    lent = sum(1 for r in done if r["timeline"].get("prefill_borrowed_steps"))
    queue = [r["timeline"]["phases"].get("queue", 0) * 1e3 for r in done]
    itl = [gap * 1e3 for r in done for gap in r["itl"]]
    return (f"{len(done)} requests: TTFT p50 {statistics.median(ttft):.0f} / p99 {percentile(ttft, 99):.0f} ms | "
            f"prefill forward p50 {statistics.median(forwards):.0f} ms ({lent} partly on lent cores; own core "
            f"only p50 {statistics.median(own) if own else 0:.0f} ms, n={len(own)}) | queue p50 "
            f"{statistics.median(queue):.0f} ms | ITL p50 {statistics.median(itl):.0f} / p99 {percentile(itl, 99):.0f} ms"
            f" | {run['summary'].get('request_throughput', 0):.2f} req/s")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(arg, summary(arg))
