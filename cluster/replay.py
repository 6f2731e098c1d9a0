"""`tandem replay`: run an audited request again and say whether its outputs match the record's digests.

    tandem replay audit.jsonl --request-id ID   [--prompt-file F | --messages-file F]
                  [--url http://host:8000 [--api-key KEY]] | [--model DIR] [--ignore-revision]
    tandem replay - < one-record.json

The input comes from the record (when the server logged inputs) or from --prompt-file (a completion's
prompt, the file's exact text) or --messages-file (a chat's messages as JSON); its digest is checked
against the record's. The model revision is compared before anything runs: a different one refuses the
replay (exit 2) unless --ignore-revision. Offline (the default) the engine runs on the model directory
(--model, else the record's); with --url the server runs it through /v1/completions with the record's
seed and sampling parameters (a chat's messages are turned into its token ids by the server's /tokenize).
Exit status: 0 every digest matches, 1 something differs, 2 the replay could not run.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from cluster.admin_client import CLIError
from cluster.replay_runners import OfflineRunner, Output, ServerRunner
from router.api.audit import RECORD_KIND, input_digest, text_digest, token_digest


@dataclass(slots=True)
class PromptInput:
    """One prompt of the record as the replay will run it: what the client gave (`given`: text, token ids
    or chat messages; None when only its token ids are known) and its token ids once known."""
    given: str | list | None
    token_ids: list[int] | None = None


@dataclass(slots=True)
class Report:
    lines: list[str] = field(default_factory=list)
    mismatch: bool = False

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        self.mismatch |= not ok
        self.lines.append(f"{what}: {'match' if ok else 'MISMATCH'}{f' ({detail})' if detail else ''}")


def load_record(source: str, request_id: str | None) -> dict:
    """The record of `request_id` (the X-Request-Id, or the response's `id`) in the JSON-lines file `source`
    ("-": stdin); without an id, the only one."""
    try:
        text = sys.stdin.read() if source == "-" else Path(source).read_text()
    except OSError as exc:
        raise CLIError(f"cannot read {source}: {exc.strerror}") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            raise CLIError(f"{source}, line {n}: not JSON; give a file of audit records (JSON lines)") from None
        if isinstance(record, dict) and record.get("record") == RECORD_KIND:
            records.append(record)
    found = [r for r in records if request_id is None or request_id in (r.get("request_id"), r.get("response_id"))]
    if not found:
        raise CLIError(f"no audit record {'of ' + request_id + ' ' if request_id else ''}in {source}")
    if len(found) > 1:
        raise CLIError(f"{source} holds {len(found)} records: pick one with --request-id "
                       f"(e.g. {found[-1].get('request_id')})")
    return found[0]


def prompt_inputs(record: dict, prompt_file: str | None, messages_file: str | None) -> list[PromptInput]:
    """Each prompt's input: from the file given, else from the record (logged inputs)."""
    prompts = record["prompts"]
    if prompt_file or messages_file:
        if len(prompts) != 1:
            raise CLIError(f"the record has {len(prompts)} prompts; a file supplies one (replay a record with "
                           f"logged inputs instead)")
        chat = record["endpoint"] == "chat.completions"
        if chat != bool(messages_file):
            raise CLIError(f"this record is a {record['endpoint']} request: give "
                           f"{'--messages-file' if chat else '--prompt-file'}")
        return [PromptInput(_read_messages(messages_file) if chat else _read_text(prompt_file))]
    if not all("token_ids" in p for p in prompts):
        raise CLIError("the record holds digests only (the server did not log inputs): supply the input with "
                       "--prompt-file FILE (a completion's prompt) or --messages-file FILE (a chat's messages)")
    return [PromptInput(p.get("input"), list(p["token_ids"])) for p in prompts]


def check_input(record: dict, inputs: list[PromptInput], report: Report) -> None:
    for i, (logged, given) in enumerate(zip(record["prompts"], inputs)):
        if given.given is not None:
            report.check(f"prompt {i} input", input_digest(given.given) == logged["input_sha256"])
        if given.token_ids is not None:
            report.check(f"prompt {i} token ids", token_digest(given.token_ids) == logged["token_ids_sha256"],
                         f"{len(given.token_ids)} tokens, recorded {logged['num_tokens']}")


def check_revision(record: dict, revision: str | None, where: str, ignore: bool, report: Report) -> None:
    """Refuse (CLIError) when `revision` is not the record's, unless `ignore`: then warn and go on."""
    wanted = record["model"]["revision"]
    if revision == wanted:
        report.check("model revision", True, wanted)
        return
    problem = (f"{where} runs model revision {revision or 'unknown (the server does not report one)'}, the record "
               f"was served by {wanted}")
    if not ignore:
        raise CLIError(f"{problem}: the outputs would not be comparable. Replay on the recorded weights, or pass "
                       f"--ignore-revision to run anyway")
    report.check("model revision", False, problem)


def compare_outputs(record: dict, outputs: dict[int, Output], report: Report) -> None:
    for choice in record["choices"]:
        out = outputs.get(choice["index"])
        name = f"choice {choice['index']}"
        if out is None:
            report.check(name, False, "the replay produced no such choice")
            continue
        cut = "" if choice["finish_reason"] in ("stop", "length") else \
            f"; the recorded request ended with {choice['finish_reason']}, so its output was cut short"
        report.check(f"{name} text", text_digest(out.text) == choice["text_sha256"],
                     f"finish {out.finish_reason}, recorded {choice['finish_reason']}{cut}")
        if out.token_ids is not None:
            report.check(f"{name} token ids", token_digest(out.token_ids) == choice["token_ids_sha256"],
                         f"{len(out.token_ids)} tokens, recorded {choice['num_output_tokens']}")


def replay(args) -> int:
    record = load_record(args.record, args.request_id)
    inputs = prompt_inputs(record, args.prompt_file, args.messages_file)
    report = Report([f"replaying {record['request_id']} ({record['endpoint']}, {len(record['choices'])} "
                     f"choice(s)) of model {record['model']['id']}"])
    runner = ServerRunner(args.url, args.api_key) if args.url else OfflineRunner(args.model, args.device, record)
    check_revision(record, runner.revision(record), runner.where, args.ignore_revision, report)
    for given in inputs:
        if given.token_ids is None:
            given.token_ids = runner.tokenize(record, given.given)
    check_input(record, inputs, report)
    compare_outputs(record, runner.generate(record, inputs), report)
    report.lines.append("result: " + ("MISMATCH: the replay's output differs from the record" if report.mismatch
                                      else "MATCH: the replay reproduced every recorded digest"))
    print("\n".join(report.lines))
    return 1 if report.mismatch else 0


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:
        raise CLIError(f"cannot read {path}: {exc.strerror}") from None


def _read_messages(path: str) -> list[dict]:
    """A chat's messages as the server's chat template reads them (the form the record's digest is of)."""
    from pydantic import ValidationError

    from router.api.openai_api import APIError, ChatTemplateControls
    try:
        messages = json.loads(_read_text(path))
        return ChatTemplateControls(messages=messages).template_messages()
    except (ValueError, ValidationError, APIError) as exc:
        raise CLIError(f"{path} is not a JSON list of chat messages: {exc}") from None
