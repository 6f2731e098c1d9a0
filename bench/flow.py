"""Issue 43's overload check: one tenant floods, another keeps its rate; how much does the quiet one suffer?

    .venv/bin/python bench/flow.py                       # both arms, ~8 min on 2 cores
    .venv/bin/python bench/flow.py --arms fair --quiet-prompts 8

Each arm is a fresh `tandem serve` (the README's defaults plus two API keys: tenants `quiet` and `flood`,
under the bench lock) that serves, with this repo's streaming client (bench/serve_client.py, random prompts
of --input-len / --output-len, Poisson arrivals):
  1. the quiet tenant alone at --quiet-rate;
  2. the quiet tenant again (fresh prompts) beside the flood tenant at --flood-factor times its rate, from two
     concurrent clients.
Arms: `fifo` (both keys name one tenant: one queue by arrival, as before flow control) and `fair` (two
tenants of weight 1, the flood tenant with `max_queued` --flood-max-queued, so its excess gets 429).
Per arm: the quiet tenant's TTFT p50 / p99 alone and beside the flood (the ratio is the issue's figure, goal
<= 1.5x), its goodput (TTFT <= 2 s, TPOT <= 250 ms), and the flood's outcomes (served, 429, other errors).
`--client vllm` runs those two arms' clients with vLLM's own `vllm bench serve` instead (bench/vllm_peer.sh
bench, one process per tenant with its key in OPENAI_API_KEY, the same rates and lengths, its random dataset;
needs `bench/vllm_peer.sh install`); the other arms always use this repo's client.

Two more arms, one tenant each:
  `priority`: priority-0 requests at --quiet-rate beside priority-10 requests at --flood-factor times it
     (the issue's goal: priority 0's TTFT p99 <= 0.5x priority 10's);
  `overload`: Poisson arrivals at --knee-rate, then at twice it, with `flow.shed: on` (a request whose predicted
     first token misses slo.ttft_ms gets 503 at once); goodput at 2x over goodput at the knee (goal >= 0.9).
     `overload-noshed` is the same without shedding, the baseline.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare, serve, serve_data  # noqa: E402
from bench.serve_client import Target, fetch_models, run_workload  # noqa: E402
from bench.serve_metrics import parse_slos, summarize  # noqa: E402

KEYS = {"quiet-key-0123": "quiet", "flood-key-0123": "flood"}


def config_yaml(arm: str, flood_max_queued: int) -> str:
    """fifo: both keys are one tenant, so the queue is by arrival alone (what serving was before flow control)."""
    if arm.startswith("overload"):
        return "api_keys: {quiet-key-0123: quiet}\n" + ("flow: {shed: on}\n" if arm == "overload" else "")
    tenants = KEYS if arm == "fair" else {k: "shared" for k in KEYS}
    keys = "api_keys: {" + ", ".join(f"{k}: {t}" for k, t in tenants.items()) + "}\n"
    if arm == "fair":
        keys += ("tenants: {quiet: {weight: 1}, flood: {weight: 1, max_queued: %d}}\n" % flood_max_queued)
    return keys


def sessions(space, n: int, rate: float, args, seed: int):
    out = serve_data.random_sessions(space, n, args.input_len, args.output_len, seed, 0.0)
    serve_data.assign_arrivals(out, rate, 1.0, seed)
    return out


async def vllm_client(base_url: str, model: str, key: str, n: int, rate: float, args, seed: int, out: Path) -> dict:
    """vLLM's `bench serve` against tandem as tenant `key`: the summary of its detailed result (errors by reason)."""
    import os

    from engine.model_loader import default_model_dir
    env = dict(os.environ, OPENAI_API_KEY=key)
    name = f"vllm-client-{KEYS[key]}-{seed}.json"
    cmd = [str(compare.ROOT / "bench/vllm_peer.sh"), "bench", "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", model, "--tokenizer", str(default_model_dir()),
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(n), "--request-rate", str(rate),
           "--seed", str(seed), "--ignore-eos", "--disable-tqdm", "--save-result", "--save-detailed",
           "--result-dir", str(out), "--result-filename", name, "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--goodput", "ttft:2000", "tpot:250"]
    proc = await asyncio.create_subprocess_exec(*cmd, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT)
    log, _ = await proc.communicate()
    (out / name.replace(".json", ".log")).write_bytes(log)
    if proc.returncode:
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {log.decode()[-2000:]}")
    result = json.loads((out / name).read_text())
    ttfts = sorted(t * 1000 for t, e in zip(result["ttfts"], result["errors"]) if not e)
    pick = (lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else float("nan"))
    outcomes = collections.Counter("served" if not e else f"HTTP {e.strip().splitlines()[-1][:40]}"
                                   for e in result["errors"])
    return {"ttft_ms": {"median": result.get("median_ttft_ms", pick(0.5)), "p99": result.get("p99_ttft_ms", pick(0.99))},
            "goodput": result.get("request_goodput") or 0.0, "completed": result["completed"],
            "outcomes": dict(outcomes)}


async def vllm_phase(base_url: str, model: str, args, seed: int, flood: bool, out: Path) -> dict:
    runs = [vllm_client(base_url, model, "quiet-key-0123", args.quiet_prompts, args.quiet_rate, args, seed, out)]
    if flood:
        runs.append(vllm_client(base_url, model, "flood-key-0123", args.quiet_prompts * args.flood_factor,
                                args.quiet_rate * args.flood_factor, args, seed + 1, out))
    done = await asyncio.gather(*runs)
    result = {"quiet": done[0]}
    if flood:
        result["flood"] = {"summary": done[1], "outcomes": {("HTTP 429" if "Too Many" in k else k): v
                                                            for k, v in done[1]["outcomes"].items()}}
    return result


async def phase(base_url: str, model: str, space, args, seed: int, flood: bool) -> dict:
    quiet = Target(base_url, model, api_key="quiet-key-0123", timeout_s=args.timeout_s)
    runs = [run_workload(quiet, sessions(space, args.quiet_prompts, args.quiet_rate, args, seed), None, False)]
    if flood:
        target = Target(base_url, model, api_key="flood-key-0123", timeout_s=args.timeout_s)
        n = args.quiet_prompts * args.flood_factor
        runs.append(run_workload(target, sessions(space, n, args.quiet_rate * args.flood_factor, args, seed + 1),
                                 None, False))
    done = await asyncio.gather(*runs)
    slos = parse_slos(compare.SLOS)
    out = {"quiet": summarize(*done[0], slos)}
    if flood:
        results, duration = done[1]
        outcomes = collections.Counter("served" if r.success else (r.error or "failed").split(":")[0]
                                       for r in results)
        out["flood"] = {"summary": summarize(results, duration, slos), "outcomes": dict(outcomes)}
    return out


async def priority_phase(base_url: str, model: str, space, args, seed: int) -> dict:
    """One tenant: priority 0 at the quiet rate beside priority 10 at flood_factor times it."""
    urgent = Target(base_url, model, api_key="quiet-key-0123", timeout_s=args.timeout_s, extra_body={"priority": 0})
    bulk = Target(base_url, model, api_key="flood-key-0123", timeout_s=args.timeout_s, extra_body={"priority": 10})
    n = args.quiet_prompts
    done = await asyncio.gather(
        run_workload(urgent, sessions(space, n, args.quiet_rate, args, seed), None, False),
        run_workload(bulk, sessions(space, n * args.flood_factor, args.quiet_rate * args.flood_factor, args,
                                    seed + 1), None, False))
    slos = parse_slos(compare.SLOS)
    return {"priority 0": summarize(*done[0], slos), "priority 10": summarize(*done[1], slos)}


async def rate_phase(base_url: str, model: str, space, args, seed: int, rate: float) -> dict:
    target = Target(base_url, model, api_key="quiet-key-0123", timeout_s=args.timeout_s)
    n = max(8, round(rate * args.overload_s))
    results, duration = await run_workload(target, sessions(space, n, rate, args, seed), None, False)
    out = summarize(results, duration, parse_slos(compare.SLOS))
    out["offered"] = n
    return out


def run_arm(arm: str, args, space, log_dir: Path) -> dict:
    config = Path(tempfile.mkdtemp()) / f"{arm}.yaml"
    config.write_text(config_yaml(arm, args.flood_max_queued)
                      + (f"audit: {{sink: 'file:{log_dir.resolve()}/{arm}-audit.jsonl'}}\n" if args.audit else ""))
    spec = compare.tandem(f"tandem-{arm}", "--config", str(config))
    spec.api_key = "quiet-key-0123"
    with compare.running(spec, log_dir) as base_url:
        model = asyncio.run(fetch_models(base_url, "quiet-key-0123"))[0]
        if arm == "priority":
            return {"arm": arm, "mixed": asyncio.run(priority_phase(base_url, model, space, args, args.seed + 200))}
        if arm.startswith("overload"):
            return {"arm": arm, "rates": {
                str(rate): asyncio.run(rate_phase(base_url, model, space, args, args.seed + 300 + i, rate))
                for i, rate in enumerate((args.knee_rate, 2 * args.knee_rate))}}
        if args.client == "vllm":
            alone = asyncio.run(vllm_phase(base_url, model, args, args.seed, False, log_dir))
            beside = asyncio.run(vllm_phase(base_url, model, args, args.seed + 100, True, log_dir))
        else:
            alone = asyncio.run(phase(base_url, model, space, args, args.seed, flood=False))
            beside = asyncio.run(phase(base_url, model, space, args, args.seed + 100, flood=True))
    return {"arm": arm, "alone": alone, "beside": beside}


def report(arms: list[dict]) -> str:
    return "\n\n".join(part for part in (report_tenants([a for a in arms if "beside" in a]),
                                          report_priority([a for a in arms if "mixed" in a]),
                                          report_overload([a for a in arms if "rates" in a])) if part)


def report_priority(arms: list[dict]) -> str:
    lines = ["| arm | priority 0 TTFT p50 / p99 | priority 10 TTFT p50 / p99 | p99 0 ÷ 10 | served 0 / 10 |",
             "|---|---|---|---|---|"]
    for a in arms:
        hi, lo = a["mixed"]["priority 0"], a["mixed"]["priority 10"]
        lines.append(f"| {a['arm']} | {hi['ttft_ms']['median']:.0f} / {hi['ttft_ms']['p99']:.0f} ms "
                     f"| {lo['ttft_ms']['median']:.0f} / {lo['ttft_ms']['p99']:.0f} ms "
                     f"| {hi['ttft_ms']['p99'] / lo['ttft_ms']['p99']:.2f}× | {hi['completed']} / {lo['completed']} |")
    return "\n".join(lines) if arms else ""


def report_overload(arms: list[dict]) -> str:
    lines = ["| arm | rate | offered | served | refused (503 / 429) | other | TTFT p50 / p99 | goodput | ÷ knee |",
             "|---|---|---|---|---|---|---|---|---|"]
    for a in arms:
        knee = None
        for rate, s in a["rates"].items():
            knee = knee if knee is not None else s["goodput"]
            refused = sum(v for k, v in s["errors"].items() if k.startswith("HTTP 503") or k.startswith("HTTP 429"))
            other = s["failed"] - refused
            t = s["ttft_ms"]
            lines.append(f"| {a['arm']} | {float(rate):g} req/s | {s['offered']} | {s['completed']} | {refused} | {other} "
                         f"| {t['median']:.0f} / {t['p99']:.0f} ms | {s['goodput']:.2f} req/s "
                         f"| {s['goodput'] / knee if knee else float('nan'):.2f}× |")
    return "\n".join(lines) if arms else ""


def report_tenants(arms: list[dict]) -> str:
    if not arms:
        return ""
    lines = ["| arm | quiet alone TTFT p50 / p99 | quiet beside the flood TTFT p50 / p99 | ÷ p99 | quiet goodput "
             "alone / beside | flood: served, refused, other |", "|---|---|---|---|---|---|"]
    for a in arms:
        q0, q1 = a["alone"]["quiet"], a["beside"]["quiet"]
        t0, t1 = q0["ttft_ms"], q1["ttft_ms"]
        outcomes = a["beside"]["flood"]["outcomes"]
        refused = sum(v for k, v in outcomes.items() if k.startswith("HTTP 429") or k.startswith("HTTP 503"))
        other = sum(outcomes.values()) - outcomes.get("served", 0) - refused
        lines.append(f"| {a['arm']} | {t0['median']:.0f} / {t0['p99']:.0f} ms | {t1['median']:.0f} / {t1['p99']:.0f} ms "
                     f"| {t1['p99'] / t0['p99']:.2f}× | {q0['goodput']:.2f} / {q1['goodput']:.2f} req/s "
                     f"| {outcomes.get('served', 0)}, {refused}, {other} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arms", default="fifo,fair")
    p.add_argument("--quiet-rate", type=float, default=0.3)
    p.add_argument("--flood-factor", type=int, default=10)
    p.add_argument("--quiet-prompts", type=int, default=12)
    p.add_argument("--flood-max-queued", type=int, default=4)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=120.0)
    p.add_argument("--client", choices=("tandem", "vllm"), default="tandem",
                   help="the fifo and fair arms' client: this repo's, or vLLM's `bench serve` (bench/vllm_peer.sh)")
    p.add_argument("--audit", action="store_true", help="write each arm's audit records (stage times, queue "
                   "waits) beside its server log")
    p.add_argument("--knee-rate", type=float, default=1.2, help="overload arms: the rate at capacity (req/s)")
    p.add_argument("--overload-s", type=float, default=60.0, help="overload arms: seconds of arrivals per rate")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    p.add_argument("--result-dir", default=str(compare.ROOT / "bench/results"))
    args = p.parse_args(argv)
    out_dir = Path(args.result_dir) / time.strftime("flow-%Y%m%d-%H%M%S")
    out_dir.mkdir(parents=True, exist_ok=True)
    space = serve.load_token_space(None)
    print(f"seed {args.seed}", flush=True)
    arms = []
    for arm in args.arms.split(","):
        arms.append(run_arm(arm, args, space, out_dir))
        (out_dir / "flow.json").write_text(json.dumps({"args": vars(args), "arms": arms}, indent=1))
        print(report(arms[-1:]), flush=True)
    print(report(arms))
    print(f"wrote {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
