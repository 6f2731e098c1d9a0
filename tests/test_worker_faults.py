"""Worker processes killed outright (SIGKILL) at the worst moments cost no client its request, through the
real app with one prefill and one decode worker (the default pools) on a tiny random-weight model:

- a prefill worker killed mid-prefill: the request is placed again (here on its decode worker, which
  prefills it) and completes, counted in tandem:request_reroutes;
- a prefill worker killed while the decode worker pulls the KV it computed: decode recomputes the prompt
  and the stream goes on, counted in tandem:kv_transfer_failures_total{reason="peer_gone"};
- the only decode worker killed mid-stream: the request waits for Ray to restart it and continues there,
  one stream with the text of an uninterrupted run; a request arriving meanwhile waits too;
- a decode worker whose engine loop hangs (alive, answering calls, never stepping) is found by the
  controller's health check, restarted, and its stream migrates, counted in
  tandem:scaling_events{action="stalled"};
- with no decode worker coming back, the wait ends at its bound with finish_reason "error".

A worker is caught at the moment by freezing it there from inside (its engine loop after a step that
satisfies a condition, or its KV export): the test waits for the worker to say it froze, then kills it.
"""
from __future__ import annotations

import asyncio
import threading

import openai
import pytest
import ray
import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.config import ClusterConfig
from cluster.controller import get_controller
from engine.hashing import block_hashes
from worker_runtime.protocol import GenerateRequest
from engine.sampling_params import SamplingParams
from router.placement.index import PrefixIndex
from router.placement.latency_report import LatencyReporter
from router.metrics import Metrics
from router.placement.cost_model import DisaggConfig
from router.placement.routing import Router
from router.placement.request_router import RequestRouter
from router.placement.worker_view import WorkerView
from tests.cluster_load import serve_tandem
from tests.helpers import metric, token_prompt
from tests.worker_kills import freeze_kv_export, kill_when_frozen, pid_of, wait_for

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"
NAME = "worker-faults"
BLOCK = 16
STALL_S = 15  # far above a tiny model's step, even on a loaded machine; the kills below come within seconds


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_llama_dir):
    """One prefill and one decode worker; every prompt with uncached tokens is prefilled remotely, in
    chunks of 32 tokens. Ray restarts a killed worker in place; the controller never replaces one, but
    restarts one whose engine loop is stuck for STALL_S."""
    config = ClusterConfig(model=tiny_llama_dir, served_model_name=MODEL, name=NAME, namespace="tandem-tests",
                           engine={"num_kv_blocks": 128, "max_num_batched_tokens": 32},
                           router={"placement": "thresholds", "max_local_prefill_length": 0, "decode_wait_s": 120},
                           prefill={"num_cpus": 0.5, "replace_dead": False, "stall_timeout_s": STALL_S},
                           decode={"num_cpus": 0.5, "replace_dead": False, "stall_timeout_s": STALL_S})
    with serve_tandem(config) as url:
        yield url


# ---- helpers ----------------------------------------------------------------------------------------


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def params(prompt: list[int], max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "extra_body": {"ignore_eos": True}}


def actor(worker_id: str):
    membership = ray.get(get_controller(NAME, "tandem-tests").membership.remote())
    return next(w.actor for w in membership.workers if w.worker_id == worker_id)


def ready(worker_id: str) -> bool:
    """Whether the worker answers calls (a killed one does once Ray restarted it: until then calls fail with
    ActorUnavailableError) and the app routes to it."""
    def answers() -> bool:
        try:
            return pid_of(actor(worker_id)) > 0
        except ray.exceptions.ActorUnavailableError:
            return False

    return wait_for(answers, interval_s=0.5) and wait_for(lambda: schedulable(worker_id))


def schedulable(worker_id: str) -> bool:
    from ray import serve
    return serve.get_app_handle(NAME).workers.remote().result().get(worker_id, {}).get("schedulable", False)


def failures(url: str) -> dict[str, float]:
    """Every KV pull that fell back to local recompute, by worker and reason (to show in a failed assertion)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    return {f"{s.labels['worker']}/{s.labels['reason']}": s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "tandem:kv_transfer_failures_total" and s.value}


def _freeze_loop_when(worker, condition) -> None:
    """In the worker: after the first engine step at whose end `condition(engine)` holds, block the engine
    loop thread for good (that step's outputs are never delivered), and say so in `worker.frozen`."""
    worker.frozen = threading.Event()
    after_step = worker.loop.on_step

    def on_step(outputs):
        after_step(outputs)
        if condition(worker.engine):
            worker.frozen.set()
            threading.Event().wait()

    worker.loop.on_step = on_step


def prefilling(engine) -> bool:
    return any(0 < r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)


def decoded_8_tokens(engine) -> bool:
    return any(r.num_output_tokens >= 8 for r in engine.scheduler.running)


def text_of(chunks) -> str:
    return "".join(c.choices[0].text for c in chunks if c.choices)


# ---- prefill faults -----------------------------------------------------------------------------------


def test_a_prefill_worker_killed_mid_prefill_leaves_the_request_to_its_decode_worker(app):
    assert wait_for(lambda: schedulable("prefill-0") and schedulable("decode-0"))
    prefill = actor("prefill-0")
    ray.get(prefill.__ray_call__.remote(_freeze_loop_when, prefilling))
    prompt = token_prompt(100, seed=31)  # four chunks: the prefill freezes after the first
    before = metric(app, "tandem:request_reroutes_total", pool="prefill", worker="prefill-0", cause="failed")
    result = {}
    thread = threading.Thread(target=lambda: result.update(
        response=client(app).completions.create(**params(prompt, 40))))
    thread.start()
    kill_when_frozen(prefill)
    thread.join(timeout=300)
    assert result["response"].choices[0].finish_reason == "length"
    assert metric(app, "tandem:request_reroutes_total", pool="prefill", worker="prefill-0", cause="failed") \
        == before + 1
    again = client(app).completions.create(**params(prompt, 40))  # the decode worker caches it now
    assert result["response"].choices[0].text == again.choices[0].text


def test_a_prefill_worker_killed_while_its_kv_is_pulled_leaves_the_request_to_recompute(app):
    assert ready("prefill-0")
    prefill = actor("prefill-0")
    ray.get(prefill.__ray_call__.remote(freeze_kv_export))
    prompt = token_prompt(80, seed=32)
    reroutes = metric(app, "tandem:request_reroutes_total")
    recomputed = metric(app, "tandem:kv_transfer_failures_total", worker="decode-0", reason="peer_gone")
    # With logprobs every token is a chunk: the first token's text may be held back (half a UTF-8
    # character of the random model's vocabulary), and then its chunk would wait for decode.
    stream = client(app).completions.create(stream=True, logprobs=1, **params(prompt, 60))
    chunks = [next(stream)]  # the prefill worker's first token; decode is pulling now
    kill_when_frozen(prefill)
    chunks.extend(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert wait_for(lambda: metric(app, "tandem:kv_transfer_failures_total", worker="decode-0",
                                   reason="peer_gone") == recomputed + 1, timeout_s=30), failures(app)
    assert metric(app, "tandem:request_reroutes_total") == reroutes  # nothing was placed again
    whole = client(app).completions.create(**params(prompt, 60))
    assert text_of(chunks) == whole.choices[0].text


def test_the_normal_path_reroutes_and_recomputes_nothing(app):
    assert ready("prefill-0") and ready("decode-0")  # the last test killed prefill-0
    reroutes = metric(app, "tandem:request_reroutes_total")
    recomputed = metric(app, "tandem:kv_transfer_failures_total")
    remote = metric(app, "tandem:prefills_total", where="remote")
    for seed in (33, 34):
        assert client(app).completions.create(**params(token_prompt(50, seed), 8)).choices[0].finish_reason \
            == "length"
    assert wait_for(lambda: metric(app, "tandem:prefills_total", where="remote") == remote + 2, timeout_s=30), \
        failures(app)
    assert metric(app, "tandem:request_reroutes_total") == reroutes
    assert metric(app, "tandem:kv_transfer_failures_total") == recomputed, failures(app)
    assert metric(app, "tandem:scaling_events_total", action="stalled") == 0


# ---- decode faults ------------------------------------------------------------------------------------


def test_the_only_decode_worker_killed_mid_stream_is_waited_for_and_the_stream_completes(app):
    assert ready("decode-0")
    decode = actor("decode-0")
    ray.get(decode.__ray_call__.remote(_freeze_loop_when, decoded_8_tokens))
    prompt = token_prompt(24, seed=35)
    waits = {outcome: metric(app, "tandem:decode_worker_waits_total", outcome=outcome)
             for outcome in ("found", "timeout", "unhealable")}
    stream = client(app).completions.create(stream=True, stream_options={"include_usage": True},
                                            **params(prompt, 300))
    chunks = [next(stream)]
    kill_when_frozen(decode)
    # A request arriving while no decode worker is schedulable waits for one too.
    assert wait_for(lambda: not schedulable("decode-0"), timeout_s=30)
    arrived = {}
    thread = threading.Thread(target=lambda: arrived.update(
        response=client(app).completions.create(**params(token_prompt(20, seed=36), 16))))
    thread.start()
    chunks.extend(stream)
    thread.join(timeout=300)
    assert metric(app, "tandem:request_migrations_total", worker="decode-0") == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 300
    assert arrived["response"].choices[0].finish_reason == "length"
    assert metric(app, "tandem:decode_worker_waits_total", stage="migration", outcome="found") == 1
    assert metric(app, "tandem:decode_worker_waits_total", stage="arrival", outcome="found") == 1
    assert metric(app, "tandem:decode_worker_waits_total", outcome="found") == waits["found"] + 2
    assert metric(app, "tandem:decode_worker_waits_total", outcome="timeout") == waits["timeout"]
    whole = client(app).completions.create(**params(prompt, 300))
    assert text_of(chunks) == whole.choices[0].text


def test_candidates_of_one_prompt_migrate_alone_when_their_decode_worker_dies(app):
    """n = 2, seeded: the group's decode worker dies mid-stream; each candidate moves on alone with the
    tokens it streamed and draws the samples it would have drawn, so the text equals an uninterrupted run."""
    assert ready("decode-0")
    decode = actor("decode-0")
    ray.get(decode.__ray_call__.remote(_freeze_loop_when, decoded_8_tokens))
    sampled = {"model": MODEL, "prompt": token_prompt(24, seed=37), "max_tokens": 40, "temperature": 1.0,
               "seed": 3, "n": 2, "extra_body": {"ignore_eos": True}}
    before = metric(app, "tandem:request_migrations_total", worker="decode-0")
    stream = client(app).completions.create(stream=True, **sampled)
    chunks = [next(stream)]
    kill_when_frozen(decode)
    chunks.extend(stream)
    assert metric(app, "tandem:request_migrations_total", worker="decode-0") == before + 2
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    whole = client(app).completions.create(**sampled)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
    assert [c.finish_reason for c in whole.choices] == ["length", "length"]


def test_a_decode_worker_whose_engine_loop_hangs_is_restarted_and_its_stream_migrates(app):
    """Nobody kills the worker: it keeps answering calls while its engine loop hangs after 8 tokens. The
    controller's health check finds the loop stuck for over STALL_S, restarts the worker, and the stream
    migrates to it and completes with the text of an uninterrupted run."""
    assert ready("decode-0")
    decode = actor("decode-0")
    pid = pid_of(decode)
    ray.get(decode.__ray_call__.remote(_freeze_loop_when, decoded_8_tokens))
    stalled = metric(app, "tandem:scaling_events_total", pool="decode", action="stalled")
    migrations = metric(app, "tandem:request_migrations_total", worker="decode-0")
    prompt = token_prompt(24, seed=38)
    chunks = list(client(app).completions.create(stream=True, logprobs=1, **params(prompt, 40)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert metric(app, "tandem:request_migrations_total", worker="decode-0") == migrations + 1
    assert wait_for(lambda: metric(app, "tandem:scaling_events_total", pool="decode", action="stalled")
                    == stalled + 1, timeout_s=60)
    assert ready("decode-0") and pid_of(actor("decode-0")) != pid
    whole = client(app).completions.create(**params(prompt, 40))
    assert text_of(chunks) == whole.choices[0].text


def test_without_a_decode_worker_coming_back_a_stream_ends_with_an_error_at_the_wait_bound(app):
    """A RequestRouter over the app's workers, waiting at most 2 s; the decode worker is killed for good
    (no restart, and this pool does not replace dead workers). Last in the module: it leaves no decode
    worker."""
    assert wait_for(lambda: schedulable("decode-0"))
    decode = actor("decode-0")
    ray.get(decode.__ray_call__.remote(_freeze_loop_when, decoded_8_tokens))
    prompt = token_prompt(24, seed=37)
    metrics = Metrics()

    async def run() -> list:
        view = WorkerView(get_controller(NAME, "tandem-tests"), Router(PrefixIndex(), BLOCK, DisaggConfig()),
                          metrics, colocated=False)
        await view.start()
        try:
            router = RequestRouter(view, metrics, LatencyReporter(controller=None), decode_wait_s=2)
            await asyncio.to_thread(wait_for, lambda: view.num_schedulable("decode") == 1)
            request = GenerateRequest("no-heal", prompt, SamplingParams(temperature=0, max_tokens=300,
                                                                        ignore_eos=True))
            stream = router.stream(request, block_hashes(prompt, BLOCK))
            deltas = [await anext(stream)]
            await asyncio.to_thread(wait_for, lambda: ray.get(
                decode.__ray_call__.remote(lambda worker: worker.frozen.is_set()), timeout=30))
            ray.kill(decode, no_restart=True)
            deltas.extend([d async for d in stream])
            return deltas
        finally:
            await view.close()

    deltas = asyncio.run(run())
    assert deltas[-1].finished and deltas[-1].finish_reason == "error"
    assert "no decode worker became available within 2 s" in deltas[-1].error
    assert 0 < sum(len(d.new_token_ids) for d in deltas) < 300
    assert metrics.registry.get_sample_value("tandem:decode_worker_waits_total",
                                             {"stage": "migration", "outcome": "timeout"}) == 1
