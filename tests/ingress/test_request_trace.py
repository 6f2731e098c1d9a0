"""Request ids, stage timelines and traces through the real app (main: one prefill, two decode workers,
spans exported to an in-process OTLP collector)."""
import contextlib
import io
import json
import random

import requests
from prometheus_client.parser import text_string_to_metric_families

from cluster.cli import main as tandem
from tests.helpers import wait_for
from tests.ingress.conftest import ADMIN_KEY, MODEL

# main routes by Dynamo's thresholds with max_local_prefill_length 48: a longer uncached prompt is
# prefilled on the prefill worker and its KV pulled by decode.
REMOTE_PROMPT_TOKENS = 100


def fresh_prompt(n: int = REMOTE_PROMPT_TOKENS) -> list[int]:
    rng = random.Random()
    return [rng.randrange(100, 1000) for _ in range(n)]


def post(app, body: dict, headers: dict) -> requests.Response:
    return requests.post(f"{app.base_url}/v1/completions", json=body, timeout=60,
                         headers={"Authorization": "Bearer key-a", **headers})


def traced(app, prompt, request_id: str | None = None, stream: bool = False, max_tokens: int = 4):
    headers = {"X-Tandem-Trace": "1", **({"X-Request-Id": request_id} if request_id else {})}
    return app.client().completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream, extra_headers=headers,
        extra_body={"ignore_eos": True})


def test_the_clients_request_id_comes_back_in_the_response_headers(main_app):
    raw = main_app.client().completions.with_raw_response.create(
        model=MODEL, prompt="hello", max_tokens=2, extra_headers={"X-Request-Id": "client-id-1"})
    assert raw.headers["x-request-id"] == "client-id-1"
    assert raw.parse().choices[0].text is not None


def test_a_streamed_response_carries_the_request_id_header_too(main_app):
    raw = main_app.client().chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
        extra_headers={"X-Request-Id": "client-stream-1"})
    assert raw.headers["x-request-id"] == "client-stream-1"
    assert list(raw.parse())


def test_without_a_request_id_the_server_makes_a_new_one_each_time(main_app):
    ids = [main_app.client().completions.with_raw_response.create(model=MODEL, prompt="x", max_tokens=1)
           .headers["x-request-id"] for _ in range(2)]
    assert all(ids) and ids[0] != ids[1]


def test_a_bad_request_id_is_a_400_naming_the_header(main_app):
    for bad in ("has space", "x" * 129, "caf\u00e9".encode().decode("latin-1")):
        response = post(main_app, {"model": MODEL, "prompt": "x", "max_tokens": 1}, {"X-Request-Id": bad})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "X-Request-Id"


def test_a_bad_trace_flag_is_a_400_naming_the_header(main_app):
    response = post(main_app, {"model": MODEL, "prompt": "x", "max_tokens": 1}, {"X-Tandem-Trace": "maybe"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Tandem-Trace"


def test_errors_carry_the_request_id_too(main_app):
    response = post(main_app, {"model": "no-such-model", "prompt": "x"}, {"X-Request-Id": "err-1"})
    assert response.status_code == 404 and response.headers["x-request-id"] == "err-1"


def test_the_traced_response_shows_every_stage_of_a_remote_prefill_in_order(main_app):
    raw = traced(main_app, fresh_prompt(), "timeline-1")
    body = json.loads(raw.text)
    assert body["tandem"]["request_id"] == "timeline-1"
    (timeline,) = body["tandem"]["timelines"]
    assert timeline["request_id"] == "timeline-1"
    expected = ["arrival", "validated", "tokenized", "routed", "prefill_queued", "prefill_started", "prefill_done",
                "transfer_started", "transfer_done", "decode_admitted", "decode_started", "first_token",
                "last_token", "finished"]
    assert list(timeline["stages"]) == expected
    assert timeline["prefill_path"] == "remote" and timeline["prefill_worker"] == "prefill-0"
    assert timeline["decode_worker"] in ("decode-0", "decode-1")
    assert timeline["blocks_pulled"] == REMOTE_PROMPT_TOKENS // 16 + 1 and timeline["bytes_pulled"] > 0
    assert set(timeline["phases"]) >= {"queue", "prefill", "transfer", "decode_admission", "decode"}


def test_blocks_the_decode_worker_caches_are_skipped_and_counted(main_app):
    prompt = fresh_prompt()
    first = json.loads(traced(main_app, prompt).text)["tandem"]["timelines"][0]
    longer = json.loads(traced(main_app, prompt + fresh_prompt()).text)["tandem"]["timelines"][0]
    assert longer["decode_worker"] == first["decode_worker"]  # prefix-aware: where the prefix is cached
    assert longer["prefill_path"] == "remote"
    assert longer["decode_overlap_blocks"] == REMOTE_PROMPT_TOKENS // 16
    assert longer["blocks_skipped"] == REMOTE_PROMPT_TOKENS // 16


def test_a_traced_stream_ends_with_the_timeline_in_its_last_chunk(main_app):
    response = post(main_app, {"model": MODEL, "prompt": fresh_prompt(), "max_tokens": 4, "stream": True},
                    {"X-Request-Id": "stream-timeline-1", "X-Tandem-Trace": "1"})
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == [] and last["tandem"]["request_id"] == "stream-timeline-1"
    assert "finished" in last["tandem"]["timelines"][0]["stages"]


def test_untraced_responses_carry_no_timeline(main_app):
    body = main_app.client().completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert getattr(body, "tandem", None) is None


def test_tandem_trace_prints_a_recent_requests_stage_timeline(main_app):
    traced(main_app, fresh_prompt(), "cli-trace-1")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = tandem(["trace", "cli-trace-1", "--url", main_app.base_url, "--admin-key", ADMIN_KEY])
    assert code == 0
    text = out.getvalue()
    assert text.startswith("request cli-trace-1: 1 timeline")
    rows = [line.split()[0] for line in text.splitlines()[2:] if line and not line.startswith(("routed:", "KV", "phases"))]
    assert rows[:5] == ["STAGE", "arrival", "validated", "tokenized", "routed"] and rows[-1] == "finished"
    assert "routed: remote" in text and "blocks" in text


def test_the_trace_of_a_request_is_found_whichever_ingress_replica_served_it(pair_app):
    ids = [f"pair-trace-{i}" for i in range(6)]
    for rid in ids:
        pair_app.client().completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers={"X-Request-Id": rid})

    def found(rid: str) -> bool:
        response = requests.get(f"{pair_app.base_url}/admin/requests/{rid}/trace", timeout=30,
                                headers={"Authorization": f"Bearer {ADMIN_KEY}"})
        return response.status_code == 200 and response.json()["request_id"] == rid

    assert all(wait_for(lambda: found(rid), timeout_s=30) for rid in ids)


def test_the_admin_trace_route_needs_the_admin_key_and_knows_unknown_ids(main_app):
    url = f"{main_app.base_url}/admin/requests/never-sent/trace"
    assert requests.get(url, headers={"Authorization": "Bearer key-a"}, timeout=30).status_code == 401
    missing = requests.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=30)
    assert missing.status_code == 404 and "never-sent" in missing.json()["error"]["message"]


def test_spans_of_one_request_form_one_trace_across_ingress_prefill_and_decode(main_app, otlp_collector):
    traced(main_app, fresh_prompt(), "otel-1")
    roles = {"ingress", "prefill", "decode"}
    assert wait_for(lambda: {s.role for s in otlp_collector.spans_with("otel-1")} >= roles, timeout_s=60)
    spans = otlp_collector.spans_with("otel-1")
    assert len({s.trace_id for s in spans}) == 1
    (root,) = [s for s in spans if s.name == "tandem.request"]
    assert all(s.parent_span_id == root.span_id for s in spans if s is not root)
    names = {s.role: set() for s in spans}
    for s in spans:
        names[s.role].add(s.name)
    assert names["prefill"] == {"queue", "prefill"}
    assert {"transfer", "decode"} <= names["decode"]


def test_queue_time_runs_to_first_scheduled_on_the_prefill_worker(main_app):
    def queue_sum() -> float:
        text = main_app.get("/metrics").text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "vllm:request_queue_time_seconds_sum" and s.labels.get("pool") == "prefill"
                   and s.labels.get("worker") == "prefill-0")

    before = queue_sum()
    timeline = json.loads(traced(main_app, fresh_prompt()).text)["tandem"]["timelines"][0]
    expected = timeline["times"]["prefill_started"] - timeline["times"]["arrival"]
    assert abs(queue_sum() - before - expected) < 1e-6
    assert expected < timeline["times"]["decode_admitted"] - timeline["times"]["arrival"]


def test_stage_histograms_cover_each_stage_with_pool_and_worker(main_app):
    traced(main_app, fresh_prompt())
    text = main_app.get("/metrics").text
    seen = {(s.labels["stage"], s.labels["pool"]) for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "tandem:request_stage_seconds_count" and s.value > 0}
    assert {("queue", "prefill"), ("prefill", "prefill"), ("transfer", "decode"),
            ("decode_admission", "decode"), ("tokenization", "ingress")} <= seen
