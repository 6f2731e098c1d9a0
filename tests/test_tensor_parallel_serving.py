"""Tensor-parallel workers through the real app (issue 40): a prefill worker of TP 2 and decode workers of TP 2
(each rank a process of its own, on a tiny random Llama in fp32) serve TP=1's greedy tokens with the KV pulled
whole; metrics and `tandem status` show each logical worker's ranks; a rank killed mid-stream fails its worker as a
unit (its ping says so, the controller restarts it) and the stream migrates and completes."""
from __future__ import annotations

import functools
import os
import signal
import urllib.request
import json

import openai
import pytest
import ray

from cluster.config import ClusterConfig
from cluster.controller import get_controller
from engine import Engine, EngineConfig, SamplingParams
from tests import helpers
from tests.cluster_load import serve_tandem
from tests.helpers import metric, token_prompt

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NAME = "tp-serving"
ADMIN = "tp-admin-key-0123456789"
STALL_S = 15
wait_for = functools.partial(helpers.wait_for, timeout_s=180.0, interval_s=0.2)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_dir):
    """Every prompt with uncached tokens is prefilled remotely; two decode workers, so that a stream whose worker
    fails has one to migrate to."""
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name=NAME, namespace="tandem-tests",
                           dtype="float32", admin_key=ADMIN,
                           engine={"num_kv_blocks": 96, "max_num_batched_tokens": 64},
                           router={"placement": "thresholds", "max_local_prefill_length": 0, "decode_wait_s": 120},
                           prefill={"num_cpus": 0.5, "tensor_parallel_size": 2, "replace_dead": False},
                           decode={"num_cpus": 0.5, "replicas": 2, "tensor_parallel_size": 2, "replace_dead": False,
                                   "stall_timeout_s": STALL_S})
    with serve_tandem(config) as url:
        yield url


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64))
    return lambda prompt, n: engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n,
                                                                      ignore_eos=True))[0].text


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def complete(url: str, prompt: list[int], n: int, stream: bool = False):
    return client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                          stream=stream, extra_body={"ignore_eos": True})


def text(completion) -> str:
    return completion.choices[0].text


def actor(worker_id: str):
    membership = ray.get(get_controller(NAME, "tandem-tests").membership.remote())
    return next(w.actor for w in membership.workers if w.worker_id == worker_id)


def test_tp_workers_serve_tp1s_greedy_tokens_with_the_kv_pulled_whole(app, reference):
    for seed in range(3):
        prompt = token_prompt(40, seed=seed)
        assert text(complete(app, prompt, 12)) == reference(prompt, 12)
    assert metric(app, "tandem:kv_transfer_bytes_total") > 0
    assert metric(app, "tandem:kv_transfer_failures_total") == 0  # nothing recomputed
    assert metric(app, "tandem:tp_collectives_over_gloo_total") == 0
    for worker in ("prefill-0", "decode-0", "decode-1"):
        assert metric(app, "tandem:worker_tp_ranks", worker=worker) == 2
        assert metric(app, "tandem:worker_tp_ranks_alive", worker=worker) == 2


def test_tandem_status_shows_each_workers_ranks(app):
    from cluster.cli import format_status

    request = urllib.request.Request(app + "/admin/status", headers={"Authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        status = json.load(resp)
    rows = {w["worker_id"]: w for pool in status["pools"].values() for w in pool["workers"]}
    assert all(rows[w]["tensor_parallel_size"] == 2 and rows[w]["tp_ranks_alive"] == 2 for w in rows)
    table = format_status(status, app).splitlines()
    header = next(line for line in table if line.startswith("WORKER"))
    row = next(line for line in table if line.startswith("decode-0"))
    assert row.split()[header.split().index("RANKS")] == "2"


def test_a_rank_killed_mid_stream_fails_its_worker_as_a_unit_and_the_stream_migrates(app, reference):
    """Rank 1 of the decode worker serving a stream is SIGKILLed after a few tokens: the worker's loop parks, its
    ping raises, the controller restarts it (a `stalled` scaling event), and the stream moves to the other decode
    worker and completes with TP=1's tokens."""
    prompt = token_prompt(24, seed=41)
    expected = reference(prompt, 60)
    stalled = metric(app, "tandem:scaling_events_total", pool="decode", action="stalled")
    migrations = sum(metric(app, "tandem:request_migrations_total", worker=w) for w in ("decode-0", "decode-1"))
    chunks, killed = [], None
    for chunk in complete(app, prompt, 60, stream=True):
        if not chunk.choices:
            continue
        chunks.append(chunk)
        if killed is None and len(chunks) == 5:
            serving = [w for w in ("decode-0", "decode-1")
                       if ray.get(actor(w).__ray_call__.remote(lambda worker: len(worker.in_flight)), timeout=60)]
            assert len(serving) == 1, serving
            killed = serving[0]
            pid = ray.get(actor(killed).__ray_call__.remote(lambda worker: worker.engine.ranks.processes[0].pid))
            os.kill(pid, signal.SIGKILL)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert sum(metric(app, "tandem:request_migrations_total", worker=w)
               for w in ("decode-0", "decode-1")) == migrations + 1
    assert wait_for(lambda: metric(app, "tandem:scaling_events_total", pool="decode", action="stalled")
                    == stalled + 1)
    # the worker came back whole
    assert wait_for(lambda: metric(app, "tandem:worker_tp_ranks_alive", worker=killed) == 2)
    assert text(complete(app, prompt, 60)) == expected
