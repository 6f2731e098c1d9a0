"""The request timeline, its store, the request id in log records, and spans, as plain objects (no Ray)."""
import asyncio
import logging

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from worker_runtime import tracing
from worker_runtime.request_log import install_request_log_records, set_request_id
from engine.timeline import RequestTimeline
from router.trace_store import TraceStore


def test_log_records_made_for_a_request_carry_its_id(caplog):
    install_request_log_records()
    set_request_id(None)  # whatever a test before this one left in the thread's context
    logger = logging.getLogger("tests.request_log")

    async def handle(request_id: str) -> None:
        set_request_id(request_id)
        await asyncio.sleep(0)  # the other request's task runs meanwhile
        logger.warning("working")

    async def both() -> None:
        await asyncio.gather(handle("req-a"), handle("req-b"))

    with caplog.at_level(logging.WARNING, logger="tests.request_log"):
        asyncio.run(both())
        logger.warning("outside any request")
    assert sorted((r.tandem_request_id, r.getMessage()) for r in caplog.records if r.tandem_request_id) == [
        ("req-a", "[req-a] working"), ("req-b", "[req-b] working")]
    assert caplog.records[-1].tandem_request_id is None and caplog.records[-1].getMessage() == "outside any request"


def test_loggers_that_pass_their_own_request_id_still_log(caplog):
    install_request_log_records()  # Ray Serve logs with extra={"request_id": ...}
    set_request_id("req-c")
    try:
        with caplog.at_level(logging.INFO, logger="tests.request_log"):
            logging.getLogger("tests.request_log").info("served", extra={"request_id": "serve-id"})
    finally:
        set_request_id(None)  # the thread's context outlives the test
    assert caplog.records[-1].request_id == "serve-id" and caplog.records[-1].tandem_request_id == "req-c"


def test_merging_a_workers_copy_adds_its_stages_and_transfer():
    timeline = RequestTimeline("r1")
    timeline.stamp("routed")
    worker = timeline.copy()
    worker.stamp("transfer_started")
    worker.stamp("transfer_done")
    worker.blocks_pulled, worker.blocks_skipped, worker.bytes_pulled = 3, 2, 4096
    assert "transfer_done" not in timeline.times  # the copy is the worker's own
    timeline.merge(worker)
    assert list(timeline.to_dict()["stages"]) == ["arrival", "routed", "transfer_started", "transfer_done"]
    assert (timeline.blocks_pulled, timeline.blocks_skipped, timeline.bytes_pulled) == (3, 2, 4096)
    assert set(timeline.phase_seconds()) == {"transfer"}


def test_merging_takes_the_prefill_accounting_of_the_worker_that_computed_the_prompt():
    timeline = RequestTimeline("r2")
    prefill = timeline.copy()
    prefill.prefill_steps, prefill.prefill_borrowed_steps, prefill.prefill_forward_s = 4, 1, 0.8
    timeline.merge(prefill)
    timeline.merge(RequestTimeline("r2"))  # the decode worker's copy's copy: it computed no prompt
    assert (timeline.prefill_steps, timeline.prefill_borrowed_steps, timeline.prefill_forward_s) == (4, 1, 0.8)
    assert timeline.to_dict()["prefill_steps"] == 4


def test_the_store_keeps_only_the_most_recent_requests():
    store = TraceStore(capacity=2)
    for rid in ("a", "b", "c"):
        store.add(rid, [RequestTimeline(rid)])
    assert store.get("a") is None
    assert store.get("c")[0].request_id == "c" and len(store) == 2


def test_with_tracing_off_no_span_is_made_and_no_context_travels():
    tracing.configure_tracing(None)
    timeline = RequestTimeline("off")
    assert tracing.start_request_span(timeline) is None and timeline.traceparent is None


def test_spans_made_from_a_workers_copy_join_the_ingress_trace():
    exporter = InMemorySpanExporter()
    tracing.configure_tracing(None, exporter=exporter)
    try:
        timeline = RequestTimeline("on")
        span = tracing.start_request_span(timeline)
        for stage in ("validated", "tokenized", "routed"):
            timeline.stamp(stage)
        worker = timeline.copy()  # what a prefill worker gets in the GenerateRequest
        for stage in ("prefill_queued", "prefill_started", "prefill_done"):
            worker.stamp(stage)
        tracing.emit_spans(worker, ("queue", "prefill"))
        timeline.merge(worker)
        timeline.stamp("finished")
        tracing.end_request_span(span, [timeline])
        spans = exporter.get_finished_spans()
        assert {s.name for s in spans} == {"tandem.request", "validation", "tokenization", "routing", "queue",
                                           "prefill"}
        root = next(s for s in spans if s.name == "tandem.request")
        assert {s.context.trace_id for s in spans} == {root.context.trace_id}
        assert all(s.parent.span_id == root.context.span_id for s in spans if s is not root)
    finally:
        tracing.configure_tracing(None)
