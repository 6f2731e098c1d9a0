"""What a request migration costs the client: the stream's gap when its decode worker is killed mid-stream,
against the same stream's ordinary token gaps and against a fresh request's time to first token for a
prompt as long as the migrated context (the prefill the new worker must redo).

    .venv/bin/python bench/migration.py [--rounds 3] [--prompt-len 256] [--kill-after 64] [--max-tokens 128]

The default model (SmolLM2-135M) on a colocated cluster behind the real ingress; every round kills the
worker serving its stream, so the cluster starts with rounds + 1 decode workers. Greedy decoding: each
migrated stream's text is checked against an uninterrupted run of the same prompt.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

# The repo before bench/: bench/router.py would otherwise shadow the `router` package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import openai  # noqa: E402
import ray  # noqa: E402

from cluster.config import ClusterConfig  # noqa: E402
from cluster.controller import get_controller  # noqa: E402
from local_serve import serve_app  # noqa: E402  (bench/, beside this script)

MODEL = "smollm2"


def stream(client: openai.OpenAI, prompt: list[int], max_tokens: int, on_token=None) -> tuple[str, list[float]]:
    """The streamed text and the arrival time of each chunk; `on_token(i)` runs after chunk i."""
    text, times = "", []
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    for i, chunk in enumerate(chunks):
        times.append(time.perf_counter())
        text += chunk.choices[0].text
        if on_token is not None:
            on_token(i)
    return text, times


def serving_worker(controller) -> tuple[str, object]:
    workers = ray.get(controller.membership.remote()).workers
    alive = []
    for w in workers:
        try:
            alive.append((w, ray.get(w.actor.stats.remote(), timeout=5)))
        except ray.exceptions.RayError:
            pass
    (serving,) = [w for w, stats in alive if stats.num_running]
    return serving.worker_id, serving.actor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--kill-after", type=int, default=64, help="tokens streamed before the kill")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    config = ClusterConfig(served_model_name=MODEL, name="bench-migration", mode="colocated",
                           decode={"replicas": args.rounds + 1, "num_cpus": 0.5})
    with serve_app(config) as url:
        controller = get_controller(config.name)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        rng = random.Random(0)
        context = args.prompt_len + args.kill_after
        stream(client, [rng.randrange(100, 40000) for _ in range(32)], 8)  # warm up
        print(f"{args.prompt_len}-token prompts, killed after {args.kill_after} of {args.max_tokens} tokens")
        for r in range(args.rounds):
            prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
            whole, _ = stream(client, prompt, args.max_tokens)
            fresh = [rng.randrange(100, 40000) for _ in range(context)]
            started = time.perf_counter()
            _, fresh_times = stream(client, fresh, 1)
            ttft = fresh_times[0] - started
            killed: dict[str, str] = {}

            def kill() -> None:
                killed["id"], actor = serving_worker(controller)
                ray.kill(actor, no_restart=True)

            killer = threading.Thread(target=kill)  # off the reading loop, so its own time is no gap
            text, times = stream(client, prompt, args.max_tokens,
                                 lambda i: killer.start() if i == args.kill_after - 1 else None)
            killer.join()
            gaps = [b - a for a, b in zip(times, times[1:])]
            k = args.kill_after - 1
            stall = max(range(k, len(gaps)), key=gaps.__getitem__)  # old worker's last token -> new one's first
            ordinary = statistics.median(gaps[1:stall] + gaps[stall + 1:])
            print(f"round {r}: killed {killed['id']}; stall {gaps[stall] * 1000:7.1f} ms after chunk {stall + 1}, "
                  f"ordinary gap {ordinary * 1000:5.1f} ms, fresh {context}-token TTFT {ttft * 1000:7.1f} ms; "
                  f"text {'identical' if text == whole else 'DIFFERS'}")


if __name__ == "__main__":
    main()
