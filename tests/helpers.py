"""Small helpers shared by test modules: waiting for a state with a deadline, prompts, metrics, ports."""
from __future__ import annotations

import asyncio
import random
import socket
import time
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families


def wait_for(predicate, timeout_s: float = 30.0, interval_s: float = 0.05) -> bool:
    """Poll `predicate` until it holds or `timeout_s` has passed; whether it holds in the end."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


async def wait_for_async(predicate, timeout_s: float = 30.0, interval_s: float = 0.01) -> bool:
    """`wait_for` on this event loop, for a state its own tasks bring about."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(interval_s)
    return predicate()


async def wait_off_loop(predicate, timeout_s: float = 60.0, interval_s: float = 0.1) -> bool:
    """`wait_for` in a thread, for a predicate that blocks (a Ray call, an HTTP request) inside a test's
    event loop."""
    return await asyncio.to_thread(wait_for, predicate, timeout_s, interval_s)


def token_prompt(n: int, seed: int) -> list[int]:
    """`n` token ids drawn from a seeded generator, clear of the special ids below 3."""
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def metric(url: str, name: str, **labels) -> float:
    """The sum of the samples of `name` at `url`/metrics whose labels include `labels`."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def free_port() -> int:
    """A free port below the ephemeral range: a port the kernel hands out (bind to 0) can be handed out again,
    to a Ray gRPC server say, before the test's server binds it (test_cli_signals failed so, once)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.Random().sample(range(20000, max(low, 20001)), min(200, max(low - 20000, 1))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
