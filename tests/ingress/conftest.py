"""Two tandem applications on one real Serve instance (loopback, a free port), shared by the ingress
tests: `main` (disaggregated; two tenants' keys and an admin key; one prefill and two decode workers;
OpenTelemetry spans exported to an in-process OTLP collector) and
`aux` (colocated; no keys; three decode workers; an admission bound of two sequences), and `pair`
(colocated; one decode worker behind two ingress replicas; two model names and its own chat template). main
writes audit records (digests only) to a file; pair writes them with inputs logged, both replicas to one file.
The last tests of test_routing_e2e drain and kill aux's workers, so the modules run in their default (file
name) order."""
from __future__ import annotations

from dataclasses import dataclass

import openai
import pytest
import ray
import requests

from tests.helpers import free_port

KEYS = {"key-a": "tenant-a", "key-b": "tenant-b"}
ADMIN_KEY = "admin-secret"
MODEL = "tiny-llama"
ALIAS = "tiny-alias"
CHAT_TEMPLATE = ("{% if greeting is defined %}{{ greeting }}\n{% endif %}"
                 "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}[assistant]{% endif %}")


@dataclass
class App:
    """One deployed application, reached over HTTP like any client would."""
    name: str
    base_url: str
    config: object

    def client(self, key: str | None = "key-a") -> openai.OpenAI:
        # No retries: the tests look at every status code the server sends.
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=key or "unused", max_retries=0, timeout=60)

    def post(self, path: str, body: dict, key: str | None = "key-a", **kwargs) -> requests.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return requests.post(f"{self.base_url}{path}", json=body, headers=headers, timeout=60, **kwargs)

    def get(self, path: str) -> requests.Response:
        return requests.get(f"{self.base_url}{path}", timeout=30)

    @property
    def audit_path(self) -> str:
        return self.config.audit.sink.removeprefix("file:")

    def ingress(self):
        """The app's ingress replica, for what only its own view knows (index, schedulable workers)."""
        from ray import serve
        return serve.get_app_handle(self.name)

    def actors(self) -> dict[str, object]:
        from cluster.controller import get_controller
        membership = ray.get(get_controller(self.config.name, self.config.namespace).membership.remote())
        return {w.worker_id: w.actor for w in membership.workers}

    def stats(self) -> dict[str, object]:
        actors = self.actors()
        return dict(zip(actors, ray.get([a.stats.remote() for a in actors.values()])))


@pytest.fixture(scope="package")
def otlp_collector():
    """Where main's ingress and workers export their spans."""
    from bench.otlp_collector import OTLPCollector
    collector = OTLPCollector().start()
    yield collector
    collector.stop()


@pytest.fixture(scope="package")
def apps(ray_cluster, tiny_llama_dir, otlp_collector, tmp_path_factory):
    from ray import serve
    from ray.serve.api import RunTarget

    from cluster.config import ClusterConfig
    from cluster.app import build_app, shutdown_cluster

    engine = {"num_kv_blocks": 128, "max_num_batched_tokens": 256}
    audit_dir = tmp_path_factory.mktemp("audit")
    main = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="ingress-main", api_keys=KEYS,
                         admin_key=ADMIN_KEY, audit={"sink": f"file:{audit_dir / 'main.jsonl'}"},
                         engine=engine, router={"max_local_prefill_length": 48, "decode_wait_s": 2},
                         prefill={"num_cpus": 0.5}, decode={"replicas": 2, "num_cpus": 0.5, "replace_dead": False},
                         tracing={"otlp_endpoint": otlp_collector.url})
    # Workers these tests kill stay dead (not replaced), so each test knows which workers there are; main's
    # last test kills its last decode worker, and a stream waits only 2 s for one to come back.
    aux = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name="ingress-aux", mode="colocated",
                        engine=engine, router={"max_queued_requests": 2},
                        decode={"replicas": 3, "num_cpus": 0.5, "replace_dead": False})
    # Two ingress replicas over one decode worker: each replica must hold the same exact index.
    # pair also answers to a second model name and renders chats with its own template.
    pair = ClusterConfig(model=tiny_llama_dir, served_model_name=[MODEL, ALIAS], chat_template=CHAT_TEMPLATE,
                         name="ingress-pair", mode="colocated", engine=engine, decode={"num_cpus": 0.5},
                         ingress_replicas=2, admin_key=ADMIN_KEY,
                         audit={"sink": f"file:{audit_dir / 'pair.jsonl'}", "log_inputs": True})
    configs = {"main": main, "aux": aux, "pair": pair}
    port = free_port()
    try:
        # The apps first: their cluster controllers start the workers, which load while Serve starts.
        targets = [RunTarget(build_app(config.model_dump()), name=name, route_prefix=f"/{name}")
                   for name, config in configs.items()]
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        serve.run_many(targets)
        yield {name: App(name, f"http://127.0.0.1:{port}/{name}", config) for name, config in configs.items()}
    finally:
        serve.shutdown()
        for config in configs.values():
            shutdown_cluster(config.name, config.namespace)


@pytest.fixture(scope="package")
def main_app(apps) -> App:
    return apps["main"]


@pytest.fixture(scope="package")
def aux_app(apps) -> App:
    return apps["aux"]


@pytest.fixture(scope="package")
def pair_app(apps) -> App:
    return apps["pair"]


@pytest.fixture(scope="package")
def tokenizer(tiny_llama_dir):
    from engine.model_loader import load_tokenizer
    return load_tokenizer(tiny_llama_dir)
