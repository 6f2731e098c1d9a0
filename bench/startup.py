"""How long `tandem serve` takes from the command to its first answered completion, and to a clean stop,
for this checkout against another revision, alternating in one run (the box is shared and noisy, so the
ratio of medians is the number to trust).

    flock /tmp/tandem-bench.lock .venv/bin/python bench/startup.py --baseline REV [--runs 3] [--model DIR]

REV is checked out into a temporary git worktree; both run with this checkout's virtualenv, the revision's
code first on the path (PYTHONPATH, inherited by Ray's processes). Without --model the default SmolLM2 runs,
as `make run` starts it. "ready" is the server's own "ready in" line; "answered" adds the first greedy
completion (8 tokens) through the OpenAI API; "stopped" is SIGTERM to exit.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_BOUND_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(url: str, model: str) -> None:
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 8, "temperature": 0}).encode()
    request = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        json.loads(response.read())


def models(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as response:
        return json.loads(response.read())["data"][0]["id"]


def one_start(code_dir: Path, model: str | None, log: Path) -> dict[str, float]:
    port = free_port()
    command = [sys.executable, "-m", "cluster.cli", "serve", "--port", str(port)] + (["--model", model] if model else [])
    env = {**os.environ, "PYTHONPATH": str(code_dir)}
    env.pop("RAY_ADDRESS", None)
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(command, cwd=code_dir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        while "tandem: ready in" not in log.read_text(errors="replace"):
            if process.poll() is not None or time.monotonic() - started > START_BOUND_S:
                raise RuntimeError(f"tandem serve did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)
        ready = time.monotonic() - started
        complete(url, models(url))
        answered = time.monotonic() - started
        stopping = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
        return {"ready_s": ready, "answered_s": answered, "stopped_s": time.monotonic() - stopping}
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", required=True, help="the git revision to compare against")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--model", default=None, help="a model directory (default: the default SmolLM2)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="tandem-startup-") as tmp:
        base_dir = Path(tmp) / "baseline"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(base_dir), args.baseline],
                       check=True)
        try:
            arms = {"baseline": base_dir, "this": ROOT}
            results: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
            for i in range(args.runs):
                for name, code_dir in arms.items():
                    result = one_start(code_dir, args.model, Path(tmp) / f"{name}-{i}.log")
                    results[name].append(result)
                    print(f"run {i + 1} {name:8s} " + "  ".join(f"{k} {v:5.1f}" for k, v in result.items()),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], check=False)
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                         text=True).stdout.strip()
    print(f"\nmedians over {args.runs} runs (this = {rev}, baseline = {args.baseline}):")
    for key in ("ready_s", "answered_s", "stopped_s"):
        base = statistics.median(r[key] for r in results["baseline"])
        this = statistics.median(r[key] for r in results["this"])
        print(f"  {key:11s} baseline {base:5.1f}  this {this:5.1f}  ratio {this / base:4.2f}")


if __name__ == "__main__":
    main()
