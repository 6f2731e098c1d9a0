"""Placement through the real ingress: prefixes go where they are cached, unrelated requests spread,
tenants never share blocks, every view of the cluster keeps an exact index, dead workers drop out."""
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from cluster.controller import get_controller
from engine.hashing import block_hashes
from router.api.auth import cache_salt
from tests.helpers import token_prompt, wait_for
from tests.ingress.conftest import MODEL

BLOCK = 16


def complete(client, prompt: list[int], **kwargs):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, **kwargs)


def decode_overlap(app, hashes: list[int]) -> dict[str, int]:
    overlap = app.ingress().overlap.remote(hashes).result()
    return {w: n for w, n in overlap.items() if w.startswith("decode")}


def view_of(app, worker: str) -> dict | None:
    """What the app's ingress knows of `worker`; None once the worker has left the membership."""
    return app.ingress().workers.remote().result().get(worker)


def schedulable(app, worker: str) -> bool:
    return (view_of(app, worker) or {}).get("schedulable", False)


def routed_to(app) -> dict[str, float]:
    """Decode placements so far per worker, from the app's /metrics."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(app.get("/metrics").text):
        for s in family.samples:
            if s.name == "tandem:routing_decisions_total" and s.labels["pool"] == "decode":
                counts[s.labels["worker"]] = counts.get(s.labels["worker"], 0) + s.value
    return counts


def test_requests_sharing_a_long_prefix_land_on_the_worker_that_caches_it(main_app):
    client, prefix = main_app.client("key-a"), token_prompt(64, seed=10)
    hashes = block_hashes(prefix, BLOCK, cache_salt("tenant-a", None))
    complete(client, prefix + [7, 8, 9])
    assert wait_for(lambda: sorted(decode_overlap(main_app, hashes).values()) == [0, 4])
    holder = max(overlap := decode_overlap(main_app, hashes), key=overlap.get)
    before = main_app.stats()
    out = complete(client, prefix + [11, 12, 13, 14])
    after = main_app.stats()
    hits = {w: after[w].prefix_cache_hits - before[w].prefix_cache_hits for w in overlap}
    assert hits.pop(holder) == 64 and set(hits.values()) == {0}
    assert out.usage.prompt_tokens_details.cached_tokens == 64


def test_unrelated_requests_spread_over_the_decode_workers(main_app):
    """Eight requests in flight at once: each goes to the decode worker with fewer running, so the two
    workers get four each. Only between equally loaded workers does the router's random tie-break
    choose, and that does not change the counts."""
    client, before = main_app.client("key-a"), routed_to(main_app)
    start = threading.Barrier(8)

    def run(seed: int):
        start.wait(timeout=60)  # all at once, and long enough to overlap
        return client.completions.create(model=MODEL, prompt=token_prompt(24, seed=seed), max_tokens=64,
                                         temperature=0, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(8) as pool:
        outs = [f.result(timeout=120) for f in [pool.submit(run, 100 + i) for i in range(8)]]
    assert [out.usage.completion_tokens for out in outs] == [64] * 8
    after = routed_to(main_app)
    placed = {w: after[w] - before.get(w, 0) for w in after}
    assert sum(placed.values()) == 8
    assert len(placed) == 2 and min(placed.values()) >= 3, placed


def test_tenant_b_gets_no_hits_on_tenant_a_blocks(main_app):
    prompt = token_prompt(80, seed=11)
    tenant_a, tenant_b = main_app.client("key-a"), main_app.client("key-b")
    complete(tenant_a, prompt)
    hashes_a = block_hashes(prompt, BLOCK, cache_salt("tenant-a", None))
    assert wait_for(lambda: max(decode_overlap(main_app, hashes_a).values()) == 5)
    before = main_app.stats()
    out_b = complete(tenant_b, prompt)
    after = main_app.stats()
    assert out_b.usage.prompt_tokens_details.cached_tokens == 0
    assert sum(after[w].prefix_cache_hits - before[w].prefix_cache_hits for w in after) == 0
    assert complete(tenant_a, prompt).usage.prompt_tokens_details.cached_tokens > 0


def test_request_cache_salt_separates_blocks_within_a_tenant(main_app):
    client, prompt = main_app.client("key-a"), token_prompt(40, seed=12)
    complete(client, prompt)
    # KV events reach the index asynchronously: route the repeat only once the index knows the blocks.
    hashes = block_hashes(prompt, BLOCK, cache_salt("tenant-a", None))
    assert wait_for(lambda: max(decode_overlap(main_app, hashes).values()) == 2)
    assert complete(client, prompt).usage.prompt_tokens_details.cached_tokens == 32
    salted = complete(client, prompt, extra_body={"cache_salt": "conversation-1"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_two_live_ingress_replicas_each_hold_the_exact_index_of_each_worker(pair_app):
    """What lets several ingress replicas agree: each follows every worker's events on its own."""
    for seed in (14, 15, 16):  # whichever replica each request reaches
        complete(pair_app.client(None), token_prompt(90, seed=seed))
    actors = pair_app.actors()
    snapshots = {w: sorted(ray.get(a.kv_events.remote(-1, 0.0)).snapshot) for w, a in actors.items()}
    assert sum(map(len, snapshots.values())) >= 15  # the comparison is not vacuous
    every_hash = sorted({h for held in snapshots.values() for h in held})
    expected = {w: {"num_blocks": len(held), "held": [h for h in every_hash if h in set(held)]}
                for w, held in snapshots.items()}
    reports = {}
    for _ in range(200):  # a handle call reaches either replica; stop once both showed an exact index
        report = pair_app.ingress().index_report.remote(every_hash).result()
        if report["workers"] == expected:
            reports[report["replica"]] = report
        if len(reports) == 2:
            break
        time.sleep(0.05)
    assert len(reports) == 2, f"exact on {len(reports)} of 2 replicas"


def migrations(app) -> dict[str, float]:
    return {s.labels["worker"]: s.value for family in text_string_to_metric_families(app.get("/metrics").text)
            for s in family.samples if s.name == "tandem:request_migrations_total"}


def test_a_stream_whose_decode_worker_dies_moves_to_another_worker_and_goes_on(aux_app):
    """Request migration: the client sees one uninterrupted stream, token for token the one it would have
    had. The worker killed here is an extra one, so the tests after this one find aux as they expect."""
    ray.get(get_controller(aux_app.config.name, aux_app.config.namespace).scale.remote("decode", 4))
    assert wait_for(lambda: aux_app.get("/health").json()["decode_workers"] == 4)
    client, prompt = aux_app.client(key=None), token_prompt(40, seed=16)
    params = {"model": MODEL, "prompt": prompt, "max_tokens": 450, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**params)
    stream = client.completions.create(stream=True, stream_options={"include_usage": True}, **params)
    chunks = [next(stream)]
    serving = [w for w, s in aux_app.stats().items() if s.num_running]
    assert len(serving) == 1
    ray.kill(aux_app.actors()[serving[0]], no_restart=True)
    chunks.extend(stream)
    assert migrations(aux_app) == {serving[0]: 1.0}, "the kill must land mid-stream"
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (40, 450)
    assert wait_for(lambda: not schedulable(aux_app, serving[0]))


def test_a_draining_worker_is_routed_around_before_any_token_is_sent(aux_app):
    client, prefix = aux_app.client(key=None), token_prompt(64, seed=15)
    hashes = block_hashes(prefix, BLOCK, None)
    complete(client, prefix + [1])
    assert wait_for(lambda: max(decode_overlap(aux_app, hashes).values()) == 4)
    holder = max(overlap := decode_overlap(aux_app, hashes), key=overlap.get)
    ray.get(aux_app.actors()[holder].drain.remote())

    # Until its stats say so, the ingress prefers the holder for this prefix; the holder refuses, and the
    # request is placed on another worker.
    assert complete(client, prefix + [2]).choices[0].finish_reason == "length"
    assert wait_for(lambda: not schedulable(aux_app, holder))
    before = routed_to(aux_app).get(holder, 0)
    assert complete(client, prefix + [3]).choices[0].finish_reason == "length"
    assert routed_to(aux_app).get(holder, 0) == before


def test_a_killed_worker_is_never_chosen_again_and_its_index_entries_vanish(aux_app):
    client, prefix = aux_app.client(key=None), token_prompt(64, seed=13)
    hashes = block_hashes(prefix, BLOCK, None)
    complete(client, prefix + [1])
    assert wait_for(lambda: max(decode_overlap(aux_app, hashes).values()) == 4)
    victim = max(overlap := decode_overlap(aux_app, hashes), key=overlap.get)
    serving = aux_app.get("/health").json()["decode_workers"]
    ray.kill(aux_app.actors()[victim], no_restart=True)

    # Placed on the victim for its cached prefix, the request fails there and is placed again.
    assert complete(client, prefix + [2]).choices[0].finish_reason == "length"
    # Unschedulable with no index entries at once; gone from the membership once the controller is sure
    # it died (aux does not replace dead workers).
    assert wait_for(lambda: view_of(aux_app, victim) in (
        None, {"pool": "decode", "schedulable": False, "indexed_blocks": 0}))
    assert wait_for(lambda: victim not in aux_app.actors() and view_of(aux_app, victim) is None)
    before = routed_to(aux_app).get(victim, 0)
    for i in range(6):
        assert complete(client, prefix + [3 + i] if i % 2 else token_prompt(30, seed=200 + i)).choices
    assert routed_to(aux_app).get(victim, 0) == before
    assert aux_app.get("/health").json()["decode_workers"] == serving - 1


def test_without_a_schedulable_decode_worker_requests_and_health_are_503(aux_app):
    for actor in aux_app.actors().values():
        try:
            ray.get(actor.drain.remote(), timeout=10)
        except ray.exceptions.RayActorError:  # killed by the test above
            pass
    assert wait_for(lambda: aux_app.get("/health").status_code == 503)
    response = aux_app.post("/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, key=None)
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    assert response.json()["error"]["type"] == "service_unavailable"


def test_a_stream_migrates_after_a_remote_prefill_when_its_decode_worker_dies(main_app):
    """Disaggregated: the first token came from the prefill worker and the KV moved; the decode worker dies
    mid-stream, and the request continues on the other decode worker, which prefills it locally. Last in
    the package: it leaves main with one decode worker."""
    client, prompt = main_app.client("key-a"), token_prompt(60, seed=17)  # over max_local_prefill_length
    params = {"model": MODEL, "prompt": prompt, "max_tokens": 440, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    prefill = main_app.actors()["prefill-0"]
    before = ray.get(prefill.stats.remote()).prompt_tokens
    stream = client.completions.create(stream=True, **params)
    chunks = [next(stream), next(stream)]  # the prefill worker's first token, then decode's
    serving = [w for w, s in main_app.stats().items() if w.startswith("decode") and s.num_running]
    assert len(serving) == 1
    ray.kill(main_app.actors()[serving[0]], no_restart=True)
    chunks.extend(stream)
    assert migrations(main_app) == {serving[0]: 1.0}, "the kill must land mid-stream"
    assert ray.get(prefill.stats.remote()).prompt_tokens - before == 60  # its prompt was prefilled remotely
    whole = client.completions.create(**params)  # on the surviving decode worker
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_a_stream_whose_last_decode_worker_dies_ends_with_an_error_not_a_hang(main_app):
    """Nowhere to migrate to: the client gets what was generated, finish_reason "error" and an error event
    saying why. Runs after the
    test above, when main has one decode worker left."""
    (last,) = [w for w in main_app.actors() if w.startswith("decode") and schedulable(main_app, w)]
    client, prompt = main_app.client("key-a"), token_prompt(20, seed=18)
    params = {"model": MODEL, "prompt": prompt, "max_tokens": 480, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**params)
    stream = client.completions.create(stream=True, **params)
    chunks = [next(stream)]
    ray.kill(main_app.actors()[last], no_restart=True)
    with pytest.raises(openai.APIError) as raised:  # the error event after the last chunk carries why
        for chunk in stream:
            chunks.append(chunk)
    assert f"worker {last} failed mid-stream" in raised.value.message
    assert chunks[-1].choices[0].finish_reason == "error"
    text = "".join(c.choices[0].text for c in chunks)
    assert whole.choices[0].text.startswith(text) and len(text) < len(whole.choices[0].text)
