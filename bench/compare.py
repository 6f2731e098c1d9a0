"""Side-by-side serving comparison on one machine in one run (issue 12, capability 4).

    .venv/bin/python bench/compare.py                 # the full comparison (~40 min on 2 cores, plus lock waits)
    .venv/bin/python bench/compare.py --smoke         # 8 prompts at one rate per case: proves it runs
    .venv/bin/python bench/compare.py --cases a --mixes long,prefix --rates 0.5 --dtype float32

Cases, each server fresh (started and stopped here, one at a time, each under
/tmp/tandem-bench.lock), every workload from bench/serve.py:
  a. tandem with `make run` defaults against vLLM's CPU build at its own defaults (bench/vllm_peer.sh:
     compiled, prefix cache on), both pinned to --dtype (bfloat16 unless told), on three mixes
     (bench/compare_mixes.py: random 256/64, long 1k-4k-token prompts, a shared prefix), each at its rates
     (one below both servers' capacity, some past it); one server per side serves every mix, the same
     prompts for both, fresh prompts per run (both cache prefixes). Per rate: throughput, TTFT, ITL, TPOT,
     goodput, the ratios tandem ÷ vLLM, and where the first token's time goes on each side;
  b. tandem disaggregated against colocated on the long-prompt-burst mix: the short requests' ITL
     while long prompts arrive;
  c. prefix-aware routing against round-robin with two decode workers on the prefix-repetition set:
     TTFT and prefix hit rate (from the server's vllm:prefix_cache_* counters). Both arms run with the
     same KV cache per worker, sized so that one worker holds only --prefix-cache-share of the prefixes
     (two hold them all): the working set of a real deployment outgrows one worker's cache, and that is
     where routing matters. --prefix-cache-share 0 keeps the default cache, which holds every prefix.
Writes compare.json, plots and summary.md under bench/results/<timestamp>/ and prints the tables.
"""
from __future__ import annotations

import argparse
import asyncio
import fcntl
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare_mixes, serve, serve_client  # noqa: E402
from bench.serve_data import Session, Turn  # noqa: E402
from bench.serve_metrics import RequestResult, format_slowest, max_rate_meeting_slos, parse_slos  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# A caller that already holds the machine-wide lock (a script between two suite runs) names another here.
LOCK = os.environ.get("TANDEM_BENCH_LOCK", "/tmp/tandem-bench.lock")
SLOS = ["ttft:2000", "tpot:250"]
ROUND_ROBIN_YAML = "router: {routing: round_robin}\n"


@dataclass(slots=True)
class ServerSpec:
    """How to start one server: argv with {port} filled in, and how long it may take to come up."""
    name: str
    argv: list[str]
    startup_timeout_s: float = 300.0
    trace: bool = False  # a tandem server: ask for each request's stage timeline (serve.py --tandem-trace)
    api_key: str | None = None  # a server with API keys: the key its readiness check uses


def tandem(name: str, *flags: str) -> ServerSpec:
    return ServerSpec(name, [str(ROOT / ".venv/bin/tandem"), "serve", "--port", "{port}", *flags], trace=True)


def vllm(dtype: str = "bfloat16") -> ServerSpec:
    """vLLM's CPU build on the same weights at its own defaults (compiled), in `dtype`: bfloat16 is what its
    `auto` picks for this fp32 checkpoint on CPU."""
    return ServerSpec(f"vllm-cpu-{dtype}", ["env", f"VLLM_DTYPE={dtype}", str(ROOT / "bench/vllm_peer.sh"),
                                            "serve", "{port}"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def bench_lock():
    """One Ray cluster or server at a time on the shared machine (DESIGN.md §7)."""
    with open(LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


async def _wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, api_key: str | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
        try:
            if await serve_client.fetch_models(base_url, api_key, timeout_s=5):
                return
        except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError):
            pass
        await asyncio.sleep(1)
    raise RuntimeError(f"not ready after {timeout_s:g} s")


def stop(proc: subprocess.Popen, grace_s: float = 90.0) -> None:
    """SIGTERM to the server (tandem shuts its Ray down on it), then SIGKILL to its process group after
    the grace. Not SIGTERM to the group: Ray's own processes would die under tandem's clean stop, which
    then waited out its 30 s deadline every time (bench/HISTORY.md, eighteenth session)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # children left behind by a clean exit go too
    except ProcessLookupError:
        pass
    proc.wait()


@contextmanager
def running(spec: ServerSpec, log_dir: Path):
    """A fresh server on a free 127.0.0.1 port for the block's duration, under the bench lock."""
    with bench_lock():
        port = free_port()
        log = open(log_dir / f"{spec.name}.log", "w")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # never join another cluster
        proc = subprocess.Popen([a.format(port=port) for a in spec.argv], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, env=env)
        base_url = f"http://127.0.0.1:{port}"
        started = time.monotonic()
        try:
            asyncio.run(_wait_ready(base_url, proc, spec.startup_timeout_s, spec.api_key))
            print(f"[{spec.name}] up on {base_url} in {time.monotonic() - started:.0f} s", flush=True)
            yield base_url
        finally:
            stopping = time.monotonic()
            stop(proc)
            log.close()
            print(f"[{spec.name}] stopped in {time.monotonic() - stopping:.0f} s", flush=True)


async def _bench(base_url: str, workloads: list[tuple[str, list[str], list[float]]], seed: int,
                 trace: bool) -> list[dict]:
    """Per workload (mix name, serve.py argv, rates): warm the server up with one request shaped like the
    workload's (as `vllm bench serve`'s initial test run: a 256-token prompt reaches the prefill pool, a
    16-token one did not), then one serve.py run per rate, each with its own seed (seed + 1000·workload + i)."""
    model = (await serve_client.fetch_models(base_url))[0]
    runs = []
    for w, (mix, serve_argv, rates) in enumerate(workloads):
        args = serve.build_parser().parse_args(serve_argv + ["--tandem-trace"] * trace)
        endpoint = "/v1/chat/completions" if args.dataset == "multi-turn" else "/v1/completions"
        target = serve_client.Target(base_url, model, endpoint, timeout_s=args.request_timeout,
                                     extra_headers={"X-Tandem-Trace": "1"} if args.tandem_trace else {})
        space = serve.load_token_space(args.tokenizer)
        warm_len = args.random_input_len if args.dataset == "random" else 16
        warm = [Session([Turn(4, space.sample(random.Random(-1 - seed - w), warm_len), prompt_len=warm_len)])]
        await serve_client.run_workload(target, warm, show_progress=False)
        for i, rate in enumerate(rates):
            run = await serve.run_one(args, target, space, rate, seed + 1000 * w + i, parse_slos(SLOS))
            runs.append({"mix": mix, **run})
    return runs


def run_case(spec: ServerSpec, serve_argv: list[str], rates: list[float], seed: int, out_dir: Path) -> dict:
    """One fresh server through one workload at each rate."""
    return run_mixes(spec, [("", serve_argv, rates)], seed, out_dir)


def run_mixes(spec: ServerSpec, workloads: list[tuple[str, list[str], list[float]]], seed: int,
              out_dir: Path) -> dict:
    """One fresh server through each workload (mix name, serve.py argv, rates) in turn."""
    try:
        with running(spec, out_dir) as base_url:
            runs = asyncio.run(_bench(base_url, workloads, seed, spec.trace))
    except Exception as exc:  # noqa: BLE001 -- one server failing must not lose the others' figures
        print(f"[{spec.name}] failed: {type(exc).__name__}: {exc} (log: {out_dir / (spec.name + '.log')})")
        return {"server": spec.name, "argv": spec.argv, "error": f"{type(exc).__name__}: {exc}", "runs": []}
    for run in runs:
        s = run["summary"]
        print(f"[{spec.name}] {run['mix']} {run['request_rate']:g} req/s: {s['completed']} done, {s['failed']} "
              f"failed, TTFT p50/p99 {s['ttft_ms']['median']:.0f}/{s['ttft_ms']['p99']:.0f} ms, ITL p99 "
              f"{s['itl_ms']['p99']:.0f} ms", flush=True)
        if run.get("slowest_ttfts"):
            print(format_slowest(run["slowest_ttfts"]), flush=True)
    return {"server": spec.name, "argv": spec.argv, "serve_args": [w[1] for w in workloads], "runs": runs}


# ---- the three cases -----------------------------------------------------------------------------------

def case_a(cfg) -> list[dict]:
    workloads = [(mix, compare_mixes.MIXES[mix] + ["--num-prompts", str(cfg.mix_prompts), "--disable-tqdm"],
                  cfg.rates or compare_mixes.DEFAULT_RATES[mix]) for mix in cfg.mixes.split(",")]
    specs = [tandem("tandem", "--dtype", cfg.dtype, *cfg.tandem_flag)] + ([] if cfg.no_vllm else [vllm(cfg.dtype)])
    return [run_mixes(spec, workloads, cfg.seed, cfg.out) for spec in specs]


def case_b(cfg) -> list[dict]:
    argv = ["--dataset", "long-prompt-burst", "--num-prompts", str(cfg.num_prompts), "--disable-tqdm",
            "--burst-every", str(cfg.burst_every), "--burst-long-input-len", str(cfg.long_input_len)]
    specs = [tandem("tandem-disaggregated")] + ([] if cfg.burst_no_colocated else [tandem("tandem-colocated", "--colocated")])
    for arm in cfg.burst_arm:  # NAME=YAML: one more disaggregated arm with that config
        name, _, text = arm.partition("=")
        path = cfg.out / f"{name}.yaml"
        path.write_text(text + "\n")
        specs.append(tandem(name, "--config", str(path)))
    return [run_case(spec, argv, cfg.burst_rates, cfg.seed + 100, cfg.out) for spec in specs]


def case_c(cfg) -> list[dict]:
    argv = ["--dataset", "prefix-repetition", "--num-prompts", str(cfg.num_prompts), "--disable-tqdm",
            "--prefix-num-prefixes", str(cfg.num_prefixes), "--prefix-len", str(cfg.prefix_len)]
    # Colocated: each decode worker prefills its own requests, so where a request goes decides
    # whether its prefix is already cached (one shared prefill worker would hide the routing).
    flags = ["--colocated", "--decode", "2"]
    blocks = prefix_case_blocks(cfg.num_prefixes, cfg.prefix_len, cfg.prefix_cache_share)
    engine = f"engine: {{num_kv_blocks: {blocks}}}\n" if blocks else ""
    configs = {"tandem-prefix-aware": engine or None, "tandem-round-robin": engine + ROUND_ROBIN_YAML}
    if cfg.round_robin_config is not None:
        configs["tandem-round-robin"] = cfg.round_robin_config.read_text()
    runs = []
    for name, text in configs.items():
        extra = []
        if text:
            path = cfg.out / f"{name}.yaml"
            path.write_text(text)
            extra = ["--config", str(path)]
        runs.append(run_case(tandem(name, *flags, *extra), argv, cfg.prefix_rates, cfg.seed + 200, cfg.out))
        runs[-1]["num_kv_blocks"] = blocks or "default"
    return runs


def prefix_case_blocks(num_prefixes: int, prefix_len: int, share: float | None, block_size: int = 16,
                       headroom_blocks: int = 64) -> int | None:
    """KV blocks per decode worker for case c: room for `share` of the prefixes' blocks plus headroom
    for the requests in flight. With share < 1 no worker can hold every prefix, which is where routing
    matters (each of two workers holds its half under prefix-aware routing, round-robin spreads every
    prefix over both); None (share 0 or unset): the default cache, which holds them all."""
    if not share:
        return None
    prefix_blocks = num_prefixes * -(-prefix_len // block_size)
    return max(2, int(share * prefix_blocks) + headroom_blocks)


# ---- report --------------------------------------------------------------------------------------------

def _ms(d: dict, *stats: str) -> str:
    return " / ".join(f"{d[s] / 1000:.2f} s" if d[s] >= 1000 else f"{d[s]:.0f} ms" for s in stats)


def table_a(servers: list[dict]) -> str:
    """Per mix and rate: both sides' figures and their ratio, then where each side's first token went."""
    tandem_srv = next((srv for srv in servers if srv["server"].startswith("tandem")), {"runs": []})
    vllm_srv = next((srv for srv in servers if srv["server"].startswith("vllm")), {"runs": []})
    rows, stages, notes = list(compare_mixes.TABLE_HEAD), list(compare_mixes.BREAKDOWN_HEAD), []
    rows += [f"| – | – | {srv['server']} | {srv['error']} | | | | | |" for srv in servers if srv.get("error")]
    for mix in dict.fromkeys(r["mix"] for srv in servers for r in srv["runs"]):
        t_runs = [r for r in tandem_srv["runs"] if r["mix"] == mix]
        v_runs = [r for r in vllm_srv["runs"] if r["mix"] == mix]
        rows += compare_mixes.comparison_rows(mix, t_runs, v_runs)
        best = [max_rate_meeting_slos([(r["request_rate"], r["summary"]) for r in runs]) for runs in (t_runs, v_runs)]
        notes.append(f"{mix}: highest rate with ≥ 90% within {' '.join(SLOS)}: tandem {best[0]}, vLLM {best[1]}")
        v_by_rate = {r["request_rate"]: r for r in v_runs}
        for t in t_runs:
            stages += compare_mixes.breakdown_rows(mix, t["request_rate"], t, v_by_rate.get(t["request_rate"]))
    rows += [""] + notes
    rows.append(f"\ngoodput: requests meeting TTFT ≤ 2 s and TPOT ≤ 250 ms per second (share of all sent); "
                f"**÷** rows: tandem ÷ vLLM.\n\nWhere the first token goes (tandem: p50 ms per phase, per prefill "
                f"path; vLLM: means from its /metrics histograms):\n")
    return "\n".join(rows + stages)


def prefills(run: dict) -> str:
    """tandem's prefills over the run by where they ran (remote on a prefill worker, local on decode)."""
    where = {"remote": 0, "local": 0}
    for series, value in run["server_counters"].get("series", {}).items():
        for w in where:
            if series.startswith("tandem:prefills") and f'where="{w}"' in series:
                where[w] += int(value)
    return f"{where['remote']} / {where['local']}" if any(where.values()) else "–"


def table_b(servers: list[dict]) -> str:
    rows = ["| mode | rate | short ITL p50 / p99 | p99 ÷ p50 | long TTFT p50 / p99 | prefills remote / local | failed |",
            "|---|---|---|---|---|---|---|"]
    for srv in servers:
        if srv.get("error"):
            rows.append(f"| {srv['server']} | – | {srv['error']} | | | | |")
        for run in srv["runs"]:
            short, long_ = run["by_kind"].get("short"), run["by_kind"].get("long")
            if not short or not long_:
                continue
            ratio = short["itl_ms"]["p99"] / short["itl_ms"]["median"] if short["itl_ms"]["median"] else float("nan")
            rows.append(f"| {srv['server']} | {run['request_rate']:g} | {_ms(short['itl_ms'], 'median', 'p99')} | "
                        f"{ratio:.1f} | {_ms(long_['ttft_ms'], 'median', 'p99')} | {prefills(run)} | "
                        f"{run['summary']['failed']} |")
    return "\n".join(rows)


def table_c(servers: list[dict]) -> str:
    rows = ["| routing | KV blocks per worker | rate | TTFT p50 / p99 | prefix hit rate | failed |",
            "|---|---|---|---|---|---|"]
    for srv in servers:
        blocks = srv.get("num_kv_blocks", "default")
        if srv.get("error"):
            rows.append(f"| {srv['server']} | {blocks} | – | {srv['error']} | | |")
        for run in srv["runs"]:
            s, hit = run["summary"], run["server_counters"].get("prefix_hit_rate")
            rows.append(f"| {srv['server']} | {blocks} | {run['request_rate']:g} | "
                        f"{_ms(s['ttft_ms'], 'median', 'p99')} | {'n/a' if hit is None else f'{hit:.1%}'} | "
                        f"{s['failed']} |")
    return "\n".join(rows)


def plots(results: dict, out: Path) -> None:
    from bench.serve_plots import plot_latency_cdfs, plot_rate_sweep

    for case, servers in results["cases"].items():
        runs = {f"{srv['server']} {r.get('mix', '')} @ {r['request_rate']:g}": [
            RequestResult(**{k: v for k, v in q.items() if k != "tpot"}) for q in r["requests"]]
            for srv in servers for r in srv["runs"]}
        if runs:
            plot_latency_cdfs(runs, out / f"{case}_cdf.png", f"case {case}")
        sweep = {}
        for srv in servers:
            for r in srv["runs"]:
                sweep.setdefault(f"{srv['server']} {r.get('mix', '')}".strip(), []).append((r["request_rate"], r["summary"]))
        sweep = {name: points for name, points in sweep.items() if len(points) > 1}
        if sweep:
            plot_rate_sweep(sweep, out / f"{case}_rates.png", f"case {case}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="8 prompts at one rate per case")
    p.add_argument("--cases", default="a,b,c")
    p.add_argument("--rates", type=serve.parse_rates, default=None,
                   help="case a's rates for every mix (default: each mix's own, bench/compare_mixes.py)")
    p.add_argument("--mixes", default=",".join(compare_mixes.MIXES), help="case a's mixes")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="case a: both servers' precision (tandem --dtype, vLLM --dtype)")
    p.add_argument("--burst-rates", type=serve.parse_rates, default=[1.0], help="case b's short-request rates")
    p.add_argument("--prefix-rates", type=serve.parse_rates, default=[1.0], help="case c's rates")
    p.add_argument("--num-prompts", type=int, default=48, help="cases b and c: requests per rate")
    p.add_argument("--mix-prompts", type=int, default=24,
                   help="case a: requests per mix and rate (24 keeps case a near 25 min on 2 cores: long prompts "
                        "at 0.1 req/s take 4 min a side)")
    p.add_argument("--burst-every", type=int, default=8)
    p.add_argument("--long-input-len", type=int, default=1536)
    p.add_argument("--num-prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--prefix-cache-share", type=float, default=0.6,
                   help="case c: each decode worker's KV cache holds this share of all prefixes' blocks "
                        "(plus in-flight headroom); 0: the default cache, which holds every prefix")
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000,
                   help="default: from the clock, so a rerun never hits the last run's cached prefixes")
    p.add_argument("--burst-arm", action="append", default=[], metavar="NAME=YAML",
                   help="case b: another disaggregated arm, e.g. 'no-slice=cpu: {borrow_slice_ms: 0}' (repeatable)")
    p.add_argument("--no-vllm", action="store_true", help="case a: tandem alone (e.g. to read its --tandem-trace tail)")
    p.add_argument("--tandem-flag", action="append", default=[], metavar="FLAG",
                   help="case a: one more `tandem serve` flag (repeat), e.g. --tandem-flag=--config=my.yaml")
    p.add_argument("--burst-no-colocated", action="store_true", help="case b: skip the colocated arm")
    p.add_argument("--round-robin-config", type=Path,
                   help="tandem --config YAML for the round-robin arm (default: router.routing round_robin)")
    p.add_argument("--result-dir", type=Path, default=ROOT / "bench/results")
    p.add_argument("--replot", type=Path, metavar="RUN_DIR",
                   help="only draw the plots of a finished run (its compare.json) into RUN_DIR; runs nothing")
    cfg = p.parse_args(argv)
    if cfg.smoke:
        cfg.rates, cfg.burst_rates, cfg.prefix_rates = cfg.rates or [1.0], [1.0], [1.0]
        cfg.num_prompts, cfg.mix_prompts, cfg.burst_every, cfg.long_input_len, cfg.num_prefixes = 8, 8, 3, 768, 2
        cfg.prefix_len = 128
    if cfg.replot:
        return cfg
    cfg.out = cfg.result_dir / time.strftime("%Y%m%d-%H%M%S")
    cfg.out.mkdir(parents=True, exist_ok=True)
    return cfg


def main(argv=None) -> int:
    cfg = parse_args(argv)
    if cfg.replot:
        plots(json.loads((cfg.replot / "compare.json").read_text()), cfg.replot)
        print(f"wrote {sorted(p.name for p in cfg.replot.glob('*.png'))} in {cfg.replot}")
        return 0
    cases = {"a": (case_a, table_a, f"tandem (make run defaults) vs vLLM-CPU (compiled), both {cfg.dtype}"),
             "b": (case_b, table_b, "disaggregated vs colocated, long-prompt-burst"),
             "c": (case_c, table_c, "prefix-aware vs round-robin, two decode workers, prefix-repetition")}
    print(f"seed {cfg.seed}", flush=True)
    results = {"seed": cfg.seed, "smoke": cfg.smoke, "dtype": cfg.dtype, "cases": {}}
    md = [f"# bench/compare.py {'(smoke) ' if cfg.smoke else ''}— seed {cfg.seed}, {cfg.dtype}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}"]
    for key in cfg.cases.split(","):
        run, table, title = cases[key]
        results["cases"][key] = run(cfg)
        (cfg.out / "compare.json").write_text(json.dumps(results, indent=1, default=str))
        md += [f"\n## {key}. {title}\n", table(results["cases"][key])]
    try:
        plots(results, cfg.out)
    except ImportError:
        print("no plots: matplotlib is missing (pip install -e '.[bench]')")
    (cfg.out / "summary.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    print(f"\nwrote {cfg.out}")
    servers = [srv for case in results["cases"].values() for srv in case]
    failed = sum(r["summary"]["failed"] for srv in servers for r in srv["runs"])
    broken = [srv["server"] for srv in servers if srv.get("error")]
    if broken:
        print(f"servers that failed: {', '.join(broken)} (their logs are in {cfg.out})")
    return 1 if failed or broken else 0


if __name__ == "__main__":
    sys.exit(main())
