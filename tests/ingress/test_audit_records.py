"""Audit records written by the real ingress (main: digests only; pair: inputs logged, two replicas, one
file), and `tandem replay` run as a subprocess on them, offline and against the running server."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from engine.model_loader import model_revision
from router.api.audit import input_digest, text_digest, token_digest
from tests.helpers import wait_for
from tests.ingress.conftest import MODEL

ROOT = Path(__file__).resolve().parents[2]
# Longer than main's max_local_prefill_length (48 tokens): prefilled on the prefill worker.
LONG = " ".join(f"audit{i}" for i in range(40))
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
FIELDS = {"record", "request_id", "response_id", "time", "tenant", "endpoint", "stream", "model", "engine", "sampling", "options",
          "prompts", "choices", "usage", "timings", "workers", "placements", "flow"}


def record_of(path: str, request_id: str) -> dict:
    """The record of `request_id` (or of the response id), once the writer thread has written it."""
    found = {}

    def written() -> bool:
        if os.path.exists(path):
            # Only whole lines: a reader can see a record's write half done (the last line then lacks its newline).
            for line in Path(path).read_text().split("\n")[:-1]:
                record = json.loads(line)
                if request_id in (record["request_id"], record["response_id"]):
                    found["record"] = record
        return "record" in found

    assert wait_for(written, timeout_s=60), f"no audit record of {request_id} in {path}"
    return found["record"]


def replay(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cluster.cli", "replay", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "TANDEM_API_KEY": ""})


@pytest.fixture(scope="module")
def greedy(main_app, tmp_path_factory):
    """A greedy completion on main, its prompt in a file, and its record."""
    out = main_app.client().completions.create(model=MODEL, prompt=LONG, max_tokens=8, **GREEDY)
    prompt_file = tmp_path_factory.mktemp("replay") / "prompt.txt"
    prompt_file.write_text(LONG)
    return out, str(prompt_file), record_of(main_app.audit_path, out.id)


@pytest.fixture(scope="module")
def seeded(main_app):
    """A seeded sampling completion with two candidates on main, and its record."""
    out = main_app.client().completions.create(model=MODEL, prompt="a seeded audit prompt", max_tokens=8, n=2,
                                               seed=1234, temperature=1.0, extra_body={"ignore_eos": True})
    return out, record_of(main_app.audit_path, out.id)


def test_a_record_has_every_field_and_says_what_ran_where(main_app, greedy, tiny_llama_dir):
    out, _, record = greedy
    assert FIELDS <= set(record)
    assert (record["tenant"], record["endpoint"], record["stream"]) == ("tenant-a", "completions", False)
    flow = record["flow"]  # its priority (the default), its tenant's weight (the default) and its ingress queue time
    assert (flow["priority"], flow["tenant_weight"]) == (0, 1.0) and 0 <= flow["queued_s"] < 60
    assert record["model"] == {"id": MODEL, "revision": model_revision(tiny_llama_dir)}
    assert record["engine"]["block_size"] == 16 and record["engine"]["dtype"] == "auto"
    assert record["sampling"]["temperature"] == 0 and isinstance(record["sampling"]["seed"], int)
    [prompt] = record["prompts"]
    assert prompt["num_tokens"] == out.usage.prompt_tokens and prompt["input_sha256"] == text_digest(LONG)
    [choice] = record["choices"]
    assert choice["text_sha256"] == text_digest(out.choices[0].text)
    assert (choice["finish_reason"], choice["num_output_tokens"]) == ("length", 8)
    assert record["usage"] == {"prompt_tokens": out.usage.prompt_tokens, "completion_tokens": 8}
    times = record["timings"]
    assert times["arrival"] <= times["routed"] <= times["first_token"] <= times["finished"]
    workers = set(main_app.actors())
    assert record["workers"]["prefill"][0] in workers and record["workers"]["decode"][0] in workers
    assert record["workers"]["prefill"][0].startswith("prefill")


def test_the_record_carries_the_clients_request_id(main_app):
    response = requests.post(f"{main_app.base_url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": "an audit with an id", "max_tokens": 2},
        headers={"Authorization": "Bearer key-a", "X-Request-Id": "audit-id-1"})
    assert response.status_code == 200
    record = record_of(main_app.audit_path, "audit-id-1")
    assert (record["request_id"], record["response_id"]) == ("audit-id-1", response.json()["id"])


def test_records_hold_digests_not_text_by_default(main_app, greedy):
    _, _, record = greedy
    assert LONG not in Path(main_app.audit_path).read_text()
    assert "input" not in record["prompts"][0] and "text" not in record["choices"][0]


def test_the_seed_and_every_candidate_are_recorded(seeded):
    out, record = seeded
    assert record["sampling"]["seed"] == 1234 == record["prompts"][0]["seed"]
    assert [c["index"] for c in record["choices"]] == [0, 1]
    assert [c["text_sha256"] for c in record["choices"]] == [text_digest(c.text) for c in out.choices]


def test_a_greedy_record_replays_offline_to_the_same_digests(main_app, greedy, tiny_llama_dir):
    out, prompt_file, record = greedy
    result = replay(main_app.audit_path, "--request-id", out.id, "--prompt-file", prompt_file)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "choice 0 token ids: match" in result.stdout and "result: MATCH" in result.stdout


def test_a_seeded_record_replays_on_the_server_to_the_same_digests(main_app, seeded, tmp_path):
    out, record = seeded
    (tmp_path / "prompt.txt").write_text("a seeded audit prompt")
    result = replay(main_app.audit_path, "--request-id", out.id, "--prompt-file", str(tmp_path / "prompt.txt"),
                    "--url", main_app.base_url, "--api-key", "key-b")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "choice 1 text: match" in result.stdout and "result: MATCH" in result.stdout


def test_a_seeded_record_replays_offline_to_the_same_digests(main_app, seeded, tmp_path):
    out, _ = seeded
    (tmp_path / "prompt.txt").write_text("a seeded audit prompt")
    result = replay(main_app.audit_path, "--request-id", out.id, "--prompt-file", str(tmp_path / "prompt.txt"))
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_changed_input_replays_to_a_mismatch(main_app, greedy, tmp_path):
    out, _, _ = greedy
    (tmp_path / "prompt.txt").write_text(LONG.replace("audit7", "audit8"))
    result = replay(main_app.audit_path, "--request-id", out.id, "--prompt-file", str(tmp_path / "prompt.txt"))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "prompt 0 input: MISMATCH" in result.stdout and "result: MISMATCH" in result.stdout


def test_another_model_revision_is_refused_unless_ignored(greedy, tmp_path):
    _, prompt_file, record = greedy
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({**record, "model": {**record["model"], "revision": "sha256:" + "0" * 64}}))
    refused = replay(str(other), "--prompt-file", prompt_file)
    assert refused.returncode == 2 and "revision" in refused.stderr and "--ignore-revision" in refused.stderr
    ignored = replay(str(other), "--prompt-file", prompt_file, "--ignore-revision")
    assert ignored.returncode == 1 and "model revision: MISMATCH" in ignored.stdout


def test_a_streamed_chat_is_recorded_and_replays_from_its_messages_offline_and_on_the_server(main_app, tmp_path):
    messages = [{"role": "user", "content": "a streamed audit chat"}]
    stream = main_app.client("key-b").chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                              seed=7, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    record = record_of(main_app.audit_path, chunks[0].id)
    assert (record["endpoint"], record["stream"], record["tenant"]) == ("chat.completions", True, "tenant-b")
    assert record["prompts"][0]["input_sha256"] == input_digest(messages)
    (tmp_path / "messages.json").write_text(json.dumps(messages))
    for where in ([], ["--url", main_app.base_url, "--api-key", "key-a"]):  # offline, and on the server
        result = replay(main_app.audit_path, "--request-id", chunks[0].id, "--messages-file",
                        str(tmp_path / "messages.json"), *where)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "prompt 0 token ids: match" in result.stdout


def test_a_stream_the_client_leaves_is_recorded_as_aborted(main_app):
    stream = main_app.client().completions.create(model=MODEL, prompt="an abandoned audit stream", max_tokens=400,
                                                  stream=True, **GREEDY)
    first = next(iter(stream))
    stream.close()
    record = record_of(main_app.audit_path, first.id)
    assert record["choices"][0]["finish_reason"] == "abort"
    assert record["choices"][0]["num_output_tokens"] < 400


def test_logged_inputs_are_in_the_record_and_replay_from_it_alone(pair_app):
    # No seed from the client: the replay matches only if the record holds the seed the ingress drew.
    out = pair_app.client().completions.create(model=MODEL, prompt="a logged audit prompt", max_tokens=6,
                                               temperature=0.8, extra_body={"ignore_eos": True})
    record = record_of(pair_app.audit_path, out.id)
    assert record["prompts"][0]["input"] == "a logged audit prompt"
    assert token_digest(record["prompts"][0]["token_ids"]) == record["prompts"][0]["token_ids_sha256"]
    assert record["choices"][0]["text"] == out.choices[0].text
    result = replay("-", stdin=json.dumps(record))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_record_is_written_and_none_dropped(main_app, greedy):
    metrics = main_app.get("/metrics").text
    written = [line for line in metrics.splitlines() if line.startswith("tandem:audit_records_total")]
    assert written and all(float(line.rsplit(" ", 1)[1]) >= 1 for line in written)
    assert "tandem:audit_records_dropped_total{" not in metrics


def test_a_digests_only_record_without_its_input_is_refused(greedy):
    _, _, record = greedy
    result = replay("-", stdin=json.dumps(record))
    assert result.returncode == 2 and "--prompt-file" in result.stderr
