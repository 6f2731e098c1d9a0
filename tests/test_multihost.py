"""tandem across hosts: simulated hosts (network namespaces on a bridge, bench/netns.py), one Ray node each,
`tandem serve --address` on the head, the prefill pool pinned to host b and the decode pool to host c (and d).

Each host has its own loopback, so a KV server advertising 127.0.0.1 cannot be reached from another host, as
on real machines. Host d joins only when a test needs a second decode host, so that which decode worker
runs where is known: decode-0 on c, the next one on d.
"""
from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams

pytestmark = pytest.mark.slow

PORT = 8000
ADMIN_KEY = "multihost-admin"
PROMPT_LEN = 200  # every prompt is prefilled remotely (max_local_prefill_length 0); this makes ~12 KV blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


class Server:
    """One `tandem serve --address <head>` process in the head's namespace, and an HTTP client to it that
    talks only to the head's address over the bridge."""

    def __init__(self, hosts, config: dict, workdir: Path):
        self.hosts, self.config = hosts, config
        self.url = hosts.url("a", PORT)
        self.http = requests.Session()
        self.http.trust_env = False  # no proxy: the request goes straight over the bridge
        path = workdir / f"{config['transfer']['backend']}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.log = workdir / f"serve-{config['transfer']['backend']}.log"
        self.proc = hosts.popen("a", ["tandem", "serve", "--address", hosts.gcs_address, "--config", str(path),
                                      "--host", hosts.ip("a"), "--port", str(PORT)], self.log)

    def wait_ready(self, timeout_s: float = 240) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"tandem serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                if self.http.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass  # not listening yet, or the ingress is still starting
            time.sleep(1)
        raise TimeoutError(f"tandem serve not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # tandem serve stops its pools and controller on SIGTERM
            try:
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120,
                             http_client=openai.DefaultHttpxClient(trust_env=False))

    def metrics(self) -> dict[str, dict[tuple, float]]:
        """Samples by name, then by sorted label items."""
        text = self.http.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, dict[tuple, float]] = {}
        for family in text_string_to_metric_families(text):
            out.setdefault(family.name, {})
            for s in family.samples:
                out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
        return out

    def status(self) -> dict:
        """The admin API's status (what `tandem status --json` prints)."""
        response = self.http.get(f"{self.url}/admin/status", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                                 timeout=30)
        response.raise_for_status()
        return response.json()

    def tandem(self, *args: str) -> str:
        return self.hosts.run("a", ["tandem", *args, "--url", self.url, "--admin-key", ADMIN_KEY],
                              timeout=240).stdout


def total(samples: dict[tuple, float], **labels) -> float:
    return sum(v for key, v in samples.items() if all((k, labels[k]) in key for k in labels))


def config(model_dir: str, backend: str) -> dict:
    # max_restarts 0: a worker whose host is lost is dead at once and the controller replaces it; with
    # restarts left, Ray holds it as restarting until a node with its resources comes back.
    pinned = {"num_cpus": 0, "num_threads": 1, "max_restarts": 0}
    return {"model": model_dir, "device": "cpu", "admin_key": ADMIN_KEY,
            "prefill": {**pinned, "replicas": 1, "resources": {"host_b": 1}},
            "decode": {**pinned, "replicas": 1, "max_replicas": 2, "resources": {"decode_slot": 1}},
            "engine": {"num_kv_blocks": 256, "max_num_batched_tokens": 256},
            "transfer": {"backend": backend, "lease_ttl_s": 30},
            "router": {"max_local_prefill_length": 0}}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 1000) for _ in range(PROMPT_LEN)] for _ in range(n)]


@pytest.fixture(scope="module")
def ray_hosts(simulated_hosts):
    """Ray on hosts a (head: Serve, the ingress, the controller), b (prefill) and c (decode). Hosts b and c
    offer no CPUs, so Serve's replicas stay on a; the pools (num_cpus 0) go where their resources are."""
    hosts = simulated_hosts
    hosts.start_ray_head("a", num_cpus=6, resources={"host_a": 1})
    hosts.start_ray_node("b", num_cpus=0, resources={"host_b": 1})
    hosts.start_ray_node("c", num_cpus=0, resources={"host_c": 1, "decode_slot": 1})
    return hosts


@pytest.fixture(scope="module")
def serve(ray_hosts, tiny_llama_dir):
    """serve(backend) -> the running Server for that transport; one at a time (the hosts' slots fit one)."""
    running: list[Server] = []

    def get(backend: str) -> Server:
        if running and running[0].config["transfer"]["backend"] == backend:
            return running[0]
        while running:
            running.pop().stop()
        server = Server(ray_hosts, config(tiny_llama_dir, backend), ray_hosts.workdir)
        running.append(server)
        server.wait_ready()
        return server

    yield get
    while running:
        running.pop().stop()


def complete(server: Server, prompt: list[int], max_tokens: int) -> str:
    out = server.client().completions.create(model=server.config["model"], prompt=prompt, max_tokens=max_tokens,
                                             temperature=0.0, extra_body={"ignore_eos": True})
    return out.choices[0].text


def reference(engine, prompt: list[int], max_tokens: int) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return engine.generate([prompt], params)[0].text


@pytest.mark.parametrize("backend", ["torch_dist", "grpc"])
def test_long_prompts_are_prefilled_remotely_and_their_kv_crosses_hosts(serve, tiny_engine, backend):
    server = serve(backend)
    assert any("PrefillWorker" in p for p in server.hosts.processes("b"))
    assert any("DecodeWorker" in p for p in server.hosts.processes("c"))
    batch = prompts(3, seed=11)
    texts = [complete(server, p, GREEDY.max_tokens) for p in batch]
    assert texts == [reference(tiny_engine, p, GREEDY.max_tokens) for p in batch]
    # Worker counters reach /metrics with the ingress's next stats poll: wait for every prefill to show.
    deadline = time.monotonic() + 30
    while total((metrics := server.metrics())["tandem:prefills_total"]) < len(batch) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert total(metrics["tandem:kv_transfer_bytes_total"]) > 0
    assert total(metrics["tandem:prefills_total"], where="remote") == len(batch)
    # another host (its own network namespace): over the network, never from a shared cache
    assert total(metrics["tandem:kv_pulls_total"], path="network") == len(batch)
    assert total(metrics["tandem:kv_pulls_total"], path="shm") == 0
    assert "tandem:kv_transfer_failures" in metrics, "the transfer failures counter is not exported"
    assert total(metrics.get("tandem:kv_transfer_failures_total", {})) == 0


@dataclass
class LinkDown:
    victim: str  # the host whose link went down while its decode worker streamed
    text: str
    expected: str
    error: BaseException | None
    migrations: float


@pytest.fixture(scope="module")
def link_down_mid_stream(serve, tiny_engine) -> LinkDown:
    """Two decode workers (decode-0 on c, decode-1 on d); a long greedy stream; the link of the host whose
    worker runs it goes down once the first tokens arrived; the stream is read to its end."""
    server = serve("grpc")
    hosts = server.hosts
    # The control plane stays on the head: a worker host's loss must not take the controller along.
    assert server.status()["controller_node"] == hosts.hosts["a"].ip, "the controller is not on the head"
    hosts.start_ray_node("d", num_cpus=0, resources={"host_d": 1, "decode_slot": 1})
    server.tandem("scale", "--decode", "2")
    assert any("DecodeWorker" in p for p in hosts.processes("d"))
    prompt, max_tokens = prompts(1, seed=21)[0], 280
    chunks: list[str] = []
    errors: list[BaseException] = []
    started = threading.Event()

    def read():
        try:
            for event in server.client().completions.create(
                    model=server.config["model"], prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                    stream=True, extra_body={"ignore_eos": True}):
                chunks.append(event.choices[0].text)
                if len(chunks) >= 5:
                    started.set()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)
        finally:
            started.set()

    migrations = total(server.metrics().get("tandem:request_migrations_total", {}))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert started.wait(60) and not errors, f"the stream did not start: {errors}"
    busy = [w["worker_id"] for w in server.status()["pools"]["decode"]["workers"] if w.get("running")]
    assert len(busy) == 1, f"expected one busy decode worker, got {busy}"
    victim = "c" if busy[0] == "decode-0" else "d"
    hosts.link_down(victim)
    reader.join(120)
    assert not reader.is_alive(), "the stream did not end after its decode host went down"
    migrations = total(server.metrics().get("tandem:request_migrations_total", {})) - migrations
    return LinkDown(victim, "".join(chunks), reference(tiny_engine, prompt, max_tokens),
                    errors[0] if errors else None, migrations)


def test_a_stream_moves_to_another_decode_host_when_its_host_link_goes_down(link_down_mid_stream):
    result = link_down_mid_stream
    assert result.error is None
    assert result.text == result.expected
    assert result.migrations == 1


def test_a_host_whose_link_comes_back_serves_decode_again(serve, link_down_mid_stream, tiny_engine):
    server, victim = serve("grpc"), link_down_mid_stream.victim
    hosts = server.hosts
    hosts.link_up(victim)
    # Ray declared the host's node dead while its link was down, and its raylet exits when it hears so; the
    # host joins again as a new node, as a rebooted machine (or a restarted KubeRay pod) would.
    hosts.stop_ray_node(victim)
    hosts.start_ray_node(victim, num_cpus=0, resources={f"host_{victim}": 1, "decode_slot": 1})
    deadline = time.monotonic() + 90
    while True:
        decode = server.status()["pools"]["decode"]
        if decode["replicas"] == 2 and sum(w["state"] == "healthy" for w in decode["workers"]) == 2:
            break
        assert time.monotonic() < deadline, f"the decode pool is not back at 2 healthy workers: {decode}"
        time.sleep(1)
    assert any("DecodeWorker" in p for p in hosts.processes(victim))
    assert re.search(r"^decode\s+2\s+2\s", server.tandem("status"), re.M)
    prompt = prompts(1, seed=31)[0]
    assert complete(server, prompt, GREEDY.max_tokens) == reference(tiny_engine, prompt, GREEDY.max_tokens)


def traced(server: Server, prompt: list[int], max_tokens: int) -> tuple[str, dict]:
    """(text, timeline) of one greedy completion (X-Tandem-Trace): where it ran and what its KV pull skipped."""
    response = server.http.post(f"{server.url}/v1/completions", headers={"X-Tandem-Trace": "1"}, timeout=120,
                                json={"model": server.config["model"], "prompt": prompt, "max_tokens": max_tokens,
                                      "temperature": 0.0, "ignore_eos": True})
    response.raise_for_status()
    body = response.json()
    return body["choices"][0]["text"], body["tandem"]["timelines"][0]


def test_a_drained_decode_hosts_prefixes_are_pulled_over_the_network_by_the_host_that_stays(serve, tiny_engine):
    """Issue 41 across hosts: the decode worker (host c or d) that ran a prompt is drained; before it leaves, the
    one on the other host pulls its prefixes from it through the KV server it advertises on its own host (each
    host's loopback is its own). Sent again, the prompt's KV import on the worker that stays skips every full
    block: it holds them already."""
    server = serve("grpc")
    deadline = time.monotonic() + 90
    while sum(w["state"] == "healthy" for w in server.status()["pools"]["decode"]["workers"]) < 2:
        assert time.monotonic() < deadline, "two healthy decode workers are needed"
        time.sleep(1)
    prompt = prompts(1, seed=41)[0]
    text, timeline = traced(server, prompt, GREEDY.max_tokens)
    assert text == reference(tiny_engine, prompt, GREEDY.max_tokens)
    drained = timeline["decode_worker"]
    pulled_before = total(server.metrics().get("tandem:kv_peer_pull_blocks_total", {}))
    server.tandem("drain", drained)
    events = server.http.get(f"{server.url}/admin/events", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                             timeout=30).json()["events"]
    [handoff] = [e for e in events if e["action"] == "handoff" and e["worker_id"] == drained]
    assert not handoff["reason"].startswith("0 prefix blocks"), handoff
    again, timeline = traced(server, prompt, GREEDY.max_tokens)
    assert again == text and timeline["decode_worker"] != drained
    assert timeline["blocks_skipped"] == PROMPT_LEN // 16 and timeline["blocks_pulled"] <= 1
    deadline = time.monotonic() + 30
    while total((metrics := server.metrics()).get("tandem:kv_peer_pull_blocks_total", {})) - pulled_before \
            < PROMPT_LEN // 16 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert total(metrics["tandem:kv_peer_pull_blocks_total"]) - pulled_before >= PROMPT_LEN // 16
    assert total(metrics.get("tandem:kv_peer_pull_failures_total", {})) == 0
