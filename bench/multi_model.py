"""Two models in one cluster against two separate `tandem serve`s at the same total cores (issue 42).

    .venv/bin/python bench/multi_model.py --rounds 2      # takes the bench lock itself

Both arms serve the same two models (the default SmolLM2 weights under two names, `left` and `right`), each on
one colocated decode worker of one core, unpinned (the two arms would otherwise pin differently):
  `one`  one `tandem serve --config` whose `models:` lists both (one Ray, one ingress routing by model);
  `two`  two `tandem serve` processes at once, one model each (two Rays, two ingresses).
Load: each model gets --prompts Poisson arrivals at --rate req/s of random --input-len-token prompts and
--output-len tokens, both models at once, from this repo's streaming client. Per arm: requests served, output
tokens/s of both models together, TTFT p50 / p99 and TPOT p50 over both. Rounds alternate the arms' order; the
ratio one ÷ two within a round is the figure (issue 42's goal: throughput >= 0.9x).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import compare, serve, serve_data  # noqa: E402
from bench.serve_client import Target, run_workload  # noqa: E402
from bench.serve_metrics import parse_slos, summarize  # noqa: E402

MODELS = ("left", "right")
WORKER = "mode: colocated\ncpu: {pin: false}\ndecode: {replicas: 1, num_cpus: 1}\n"


def one_config(directory: Path) -> Path:
    path = directory / "one.yaml"
    path.write_text("cpu: {pin: false}\nmodels:\n" + "".join(
        f"  - key: {m}\n    served_model_name: {m}\n    mode: colocated\n    decode: {{replicas: 1, num_cpus: 1}}\n"
        for m in MODELS))
    return path


def two_configs(directory: Path) -> list[Path]:
    paths = []
    for m in MODELS:
        path = directory / f"{m}.yaml"
        path.write_text(WORKER + f"served_model_name: {m}\nname: tandem-{m}\n")
        paths.append(path)
    return paths


@contextmanager
def server(name: str, config: Path, log_dir: Path):
    port = compare.free_port()
    log = open(log_dir / f"{name}.log", "w")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.Popen([str(compare.ROOT / ".venv/bin/tandem"), "serve", "--port", str(port), "--config",
                             str(config)], cwd=compare.ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(compare._wait_ready(base_url, proc, 400))
        yield base_url
    finally:
        compare.stop(proc)
        log.close()


async def load(urls: dict[str, str], space, args, seed: int) -> dict:
    """Both models at once; `urls`: model -> base URL."""
    runs = []
    for i, (model, url) in enumerate(urls.items()):
        sessions = serve_data.random_sessions(space, args.prompts, args.input_len, args.output_len, seed + i, 0.0)
        serve_data.assign_arrivals(sessions, args.rate, 1.0, seed + i)
        runs.append(run_workload(Target(url, model, timeout_s=300), sessions, None, False))
    done = await asyncio.gather(*runs)
    results = [r for rs, _ in done for r in rs]
    return summarize(results, max(d for _, d in done), parse_slos(compare.SLOS))


def run_arm(arm: str, directory: Path, space, args, seed: int) -> dict:
    with compare.bench_lock(), ExitStack() as stack:
        if arm == "one":
            url = stack.enter_context(server("one", one_config(directory), directory))
            urls = dict.fromkeys(MODELS, url)
        else:
            urls = {m: stack.enter_context(server(f"two-{m}", path, directory))
                    for m, path in zip(MODELS, two_configs(directory))}
        warm = asyncio.run(load(urls, space, argparse.Namespace(**{**vars(args), "prompts": 2, "rate": 10.0}), -1))
        assert warm["completed"] == 2 * len(MODELS), warm["errors"]
        return asyncio.run(load(urls, space, args, seed))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=24, help="per model and round")
    p.add_argument("--rate", type=float, default=0.5, help="req/s per model")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    args = p.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="multi-model-"))
    space = serve.load_token_space(None)
    print(f"seed {args.seed}, logs in {directory}", flush=True)
    rows = []
    for r in range(args.rounds):
        order = ("one", "two") if r % 2 == 0 else ("two", "one")
        got = {arm: run_arm(arm, directory, space, args, args.seed + 100 * r) for arm in order}
        rows.append(got)
        for arm in ("one", "two"):
            s = got[arm]
            print(f"round {r} {arm}: served {s['completed']}, {s['output_throughput']:.1f} tok/s, TTFT p50 "
                  f"{s['ttft_ms']['median']:.0f} p99 {s['ttft_ms']['p99']:.0f} ms, TPOT p50 "
                  f"{s['tpot_ms']['median']:.0f} ms", flush=True)
        print(f"round {r} one/two: throughput {got['one']['output_throughput'] / got['two']['output_throughput']:.2f}x, "
              f"TTFT p50 {got['one']['ttft_ms']['median'] / got['two']['ttft_ms']['median']:.2f}x, p99 "
              f"{got['one']['ttft_ms']['p99'] / got['two']['ttft_ms']['p99']:.2f}x", flush=True)
    ratio = statistics.median(g["one"]["output_throughput"] / g["two"]["output_throughput"] for g in rows)
    print(f"median throughput one/two: {ratio:.2f}x")
    (directory / "multi_model.json").write_text(json.dumps({"args": vars(args), "rounds": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
