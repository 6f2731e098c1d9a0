"""Audit records without Ray: the sink's validation, the writer thread's drops and reopenings (each counted),
the weights' revision, and sampling parameters through a record."""
from __future__ import annotations

import json
import os
import shutil
import threading

import pytest

from cluster.cli import main
from cluster.config import ConfigError, load_config
from engine.model_loader import model_revision
from engine.sampling_params import SamplingParams, StructuredOutputs
from router.api.audit import sampling_from_record, sampling_record
from router.api.audit_sink import AuditWriter
from router.metrics import Metrics
from tests.helpers import wait_for


def writer(sink: str, max_queue: int = 100) -> tuple[AuditWriter, Metrics]:
    metrics = Metrics()
    return AuditWriter(sink, max_queue, metrics.audit_records, metrics.audit_dropped), metrics


def count(metrics: Metrics, name: str, **labels) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("sink", ["audit.jsonl", "file:audit.jsonl", "stderr", ""])
def test_the_audit_sink_must_be_stdout_or_an_absolute_file(sink):
    with pytest.raises(ConfigError, match="audit.sink"):
        load_config(None, **{"audit.sink": sink})


def test_tandem_serve_refuses_a_relative_audit_sink(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--audit-sink", "file:audit.jsonl"])
    assert exc.value.code == 2 and "--audit-sink" in capsys.readouterr().err


def test_records_are_written_as_json_lines_and_counted(tmp_path):
    audit, metrics = writer(f"file:{tmp_path / 'audit.jsonl'}")
    audit.put({"request_id": "a"})
    audit.put({"request_id": "b", "text": "é"})
    audit.close()
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == ["a", "b"]
    assert count(metrics, "tandem:audit_records_total") == 2


def test_a_full_queue_drops_records_and_counts_them(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    audit, metrics = writer(f"file:{fifo}", max_queue=1)
    audit.put({"n": 1})  # the writer takes it and blocks opening the FIFO, which has no reader yet
    assert wait_for(audit.queue.empty)
    audit.put({"n": 2})  # queued
    audit.put({"n": 3})  # dropped
    assert count(metrics, "tandem:audit_records_dropped_total", reason="queue_full") == 1
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(open(fifo).read().splitlines()))
    reader.start()
    audit.close()
    reader.join(10)
    assert [json.loads(line)["n"] for line in lines] == [1, 2]


def test_a_failed_write_is_counted_and_the_file_is_opened_again_later(tmp_path):
    path = tmp_path / "not-yet" / "audit.jsonl"
    audit, metrics = writer(f"file:{path}")
    audit.put({"n": 1})
    assert wait_for(lambda: count(metrics, "tandem:audit_records_dropped_total", reason="write_failed") == 1)
    path.parent.mkdir()
    audit.put({"n": 2})
    audit.close()
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == [2]


def test_a_rotated_file_is_reopened(tmp_path):
    path = tmp_path / "audit.jsonl"
    audit, metrics = writer(f"file:{path}")
    audit.put({"n": 1})
    assert wait_for(lambda: count(metrics, "tandem:audit_records_total") == 1)
    path.rename(tmp_path / "audit.jsonl.1")
    audit.put({"n": 2})
    audit.close()
    assert [json.loads(line)["n"] for line in path.read_text().splitlines()] == [2]


def test_the_revision_names_the_weights(tiny_llama_dir, tmp_path):
    copy = shutil.copytree(tiny_llama_dir, tmp_path / "copy")
    assert model_revision(copy) == model_revision(tiny_llama_dir)  # the bytes, not the place
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert model_revision(copy) != model_revision(tiny_llama_dir)


def test_sampling_params_come_back_whole_from_a_record():
    params = SamplingParams(n=2, temperature=0.7, seed=-5, logit_bias={3: -1.5}, stop=["."],
                            structured=StructuredOutputs(choice=("yes", "no")), max_tokens=None)
    assert sampling_from_record(json.loads(json.dumps(sampling_record(params)))) == params


def finished_record(tmp_path, error: BaseException | None, finish_reason: str | None) -> dict:
    """The record AuditEntry writes for one candidate that got two tokens and then `finish_reason` (None: it
    never finished) with `error` ending the request."""
    from engine.outputs import RequestOutput
    from worker_runtime.protocol import GenerateRequest
    from router.api.audit import Audit, AuditConfig
    from router.api.openai_api import CompletionRequest
    from router.api.openai_responses import Choice
    from router.api.service import Candidates

    path = tmp_path / "audit.jsonl"
    sink, _ = writer(f"file:{path}")
    params = SamplingParams(seed=9, max_tokens=8)
    choice = Choice(0, 0)
    choice.add(RequestOutput("r-0", [5, 6], "ab"))
    if finish_reason is not None:
        choice.add(RequestOutput("r-0", [], "", finished=True, finish_reason=finish_reason, error="worker gone"))
    candidates = [Candidates([choice], GenerateRequest("r-0", [1, 2, 3], params), [])]
    entry = Audit(AuditConfig(sink=f"file:{path}"), "m", "sha256:x", sink).entry(
        "req-1", "cmpl-1", "tenant-a", "completions", CompletionRequest(model="m", prompt="abc"), ["abc"], {})
    entry.finish(params, [9], candidates, [[1, 2, 3]], error)
    entry.finish(params, [9], candidates, [[1, 2, 3]], error)  # written once however often it is called
    sink.close()
    [line] = path.read_text().splitlines()
    return json.loads(line)


def test_a_request_the_client_left_is_recorded_as_aborted(tmp_path):
    import asyncio
    [choice] = finished_record(tmp_path, asyncio.CancelledError(), None)["choices"]
    assert (choice["finish_reason"], choice["num_output_tokens"]) == ("abort", 2)


def test_a_failed_request_is_recorded_as_an_error_with_its_reason(tmp_path):
    [choice] = finished_record(tmp_path, RuntimeError("no decode worker"), None)["choices"]
    assert choice["finish_reason"] == "error" and choice["error"] == "RuntimeError: no decode worker"


def test_a_candidate_its_worker_failed_is_recorded_as_an_error_with_the_workers_message(tmp_path):
    [choice] = finished_record(tmp_path, None, "error")["choices"]
    assert (choice["finish_reason"], choice["error"]) == ("error", "worker gone")


def test_the_serve_flags_reach_the_ingress_config(monkeypatch, tmp_path):
    """`tandem serve --audit-sink ... --audit-log-inputs` as the ingress gets it (the launcher is replaced by
    one that keeps the config instead of starting Ray)."""
    import cluster.launcher
    from cluster.app import ingress_config

    seen = []
    monkeypatch.setattr(cluster.launcher, "serve_until_stopped", lambda config, address, say: seen.append(config))
    assert main(["serve", "--audit-sink", f"file:{tmp_path / 'a.jsonl'}", "--audit-log-inputs"]) == 0
    audit = ingress_config(seen[0]).audit
    assert (audit.sink, audit.log_inputs) == (f"file:{tmp_path / 'a.jsonl'}", True)
    assert audit.engine["block_size"] == 16 and audit.engine["dtype"] == "auto"


def test_the_stdout_sink_writes_one_line_per_record(capsys):
    audit, metrics = writer("stdout")
    audit.put({"request_id": "a"})
    audit.close()
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [{"request_id": "a"}]
