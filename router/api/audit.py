"""Audit records: one JSON line per finished request, saying what ran and how to reproduce it.

A record names the request, its tenant (never the key), the model and the revision of its weights, the
engine settings that shape outputs, the sampling parameters with the seed actually used, and per
candidate its finish reason, token counts, timings and digests; and the workers that served it. Prompts
and outputs appear as SHA-256 digests (of the text and of the token ids); with `log_inputs` they appear
as text and token ids too. `tandem replay` (cluster/replay.py) re-runs a record and compares digests.

Records are built on the event loop when a request ends and written by an AuditWriter thread
(router/api/audit_sink.py), so a slow disk never holds up a stream.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams
from engine.timeline import STAGES

logger = logging.getLogger(__name__)

RECORD_KIND = "tandem.audit.v1"


@dataclass(slots=True)
class AuditConfig:
    """`sink`: None (off), "stdout" or "file:/absolute/path"; `log_inputs` adds prompts and outputs as
    text; `engine`: the engine settings that shape outputs, as the cluster config gives them."""
    sink: str | None = None
    log_inputs: bool = False
    max_queue: int = 10000
    engine: dict = field(default_factory=dict)


def text_digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def token_digest(token_ids: list[int]) -> str:
    """The digest of token ids as compact JSON (`[1,2,3]`)."""
    return text_digest(json.dumps(list(token_ids), separators=(",", ":")))


def input_digest(given: str | list) -> str:
    """The digest of an input as the client gave it: a prompt's text, or token ids, or a chat's messages
    (as the chat template reads them) in canonical JSON."""
    if isinstance(given, str):
        return text_digest(given)
    if given and isinstance(given[0], int):
        return token_digest(given)
    return text_digest(json.dumps(given, sort_keys=True, ensure_ascii=False, separators=(",", ":")))


def sampling_record(params: SamplingParams) -> dict:
    """SamplingParams as JSON (logit_bias keys as strings, as JSON needs); `sampling_from_record` inverts it."""
    out = dataclasses.asdict(params)
    if params.logit_bias:
        out["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return out


def sampling_from_record(record: dict) -> SamplingParams:
    from engine.sampling_params import StructuredOutputs
    fields = dict(record)
    if fields.get("logit_bias"):
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    if fields.get("structured"):
        structured = dict(fields["structured"])
        if structured.get("choice") is not None:
            structured["choice"] = tuple(structured["choice"])
        fields["structured"] = StructuredOutputs(**structured)
    return SamplingParams(**fields)


def request_timings(requests: list) -> dict:
    """The request's stage times (epoch seconds, engine.timeline.STAGES) from the timelines of its
    GenerateRequests (one per prompt, or per candidate run alone): the earliest of each stage, the latest
    last token and finish."""
    times: dict[str, float] = {}
    for request in requests:
        for stage, at in request.timeline.times.items():
            latest = stage in ("last_token", "finished")
            times[stage] = max(at, times.get(stage, at)) if latest else min(at, times.get(stage, at))
    return {stage: times[stage] for stage in STAGES if stage in times}


@dataclass(slots=True)
class AuditEntry:
    """One request's record in the making: what is known when it is admitted, completed when it ends."""
    audit: Audit
    request_id: str  # the HTTP request's (X-Request-Id)
    response_id: str  # the response body's `id`
    tenant: str | None
    endpoint: str
    stream: bool
    options: dict
    inputs: list  # as the client gave them: prompts (text or ids), or one chat's messages
    written: bool = False
    flow: dict | None = None  # its priority, its tenant's weight and its time in the ingress queue

    def finish(self, params: SamplingParams, seeds: list[int], candidates: list, prompts: list[list[int]],
               error: BaseException | None = None) -> None:
        """Write the record once (later calls do nothing). `params`: the request's sampling parameters,
        `seeds`: the seed each prompt ran with (the client's, or one the ingress drew). Choices that never
        finished end as "abort", or as "error" when `error` ended the request."""
        if self.written:
            return
        self.written = True
        try:
            record = self._record(params, seeds, candidates, prompts, error)
        except Exception:  # a record that cannot be built must not fail the request
            logger.exception("%s: cannot build the audit record", self.request_id)
            self.audit.writer.dropped("build_failed")
            return
        self.audit.writer.put(record)

    def _record(self, params: SamplingParams, seeds: list[int], candidates: list, prompts: list[list[int]],
                error: BaseException | None) -> dict:
        log = self.audit.config.log_inputs
        choices = [c for cand in candidates for c in cand.choices]
        requests = [cand.request for cand in candidates]
        lists = {id(r.placements): r.placements for r in requests}  # migrated candidates share their list
        placements = [p for ps in lists.values() for p in ps]
        return {
            "record": RECORD_KIND, "request_id": self.request_id, "response_id": self.response_id,
            "time": time.time(), "tenant": self.tenant,
            "endpoint": self.endpoint, "stream": self.stream,
            "model": {"id": self.audit.model_id, "revision": self.audit.revision},
            "engine": self.audit.config.engine,
            "sampling": sampling_record(dataclasses.replace(params, seed=seeds[0] if seeds else params.seed)),
            "options": self.options,
            "flow": self.flow,
            "prompts": [_prompt_record(given, ids, seed, log) for given, ids, seed in zip(self.inputs, prompts, seeds)],
            "choices": [_choice_record(c, error, log) for c in sorted(choices, key=lambda c: c.index)],
            "usage": {"prompt_tokens": sum(len(ids) for ids in prompts),
                      "completion_tokens": sum(c.num_tokens for c in choices)},
            "timings": request_timings(requests),
            "workers": {"prefill": _unique(p["prefill"] for p in placements if p["prefill"]),
                        "decode": _unique(p["decode"] for p in placements)},
            "placements": placements,
        }


@dataclass(slots=True)
class AuditRecorder:
    """Writes a placed request's record when called as it ends (with the exception that ended it)."""
    entry: AuditEntry | None
    params: SamplingParams
    seeds: list[int]
    candidates: list  # router.api.service.Candidates
    prompts: list[list[int]]
    error: BaseException | None = None  # what ended a stream after its headers went out

    def __call__(self, error: BaseException | None = None) -> None:
        if self.entry is not None:
            self.entry.finish(self.params, self.seeds, self.candidates, self.prompts, error or self.error)


def chat_options(req, tools) -> dict:
    """What besides the messages shaped a chat's prompt, as the record keeps it (the template's variables
    and the tools may hold text: only whether they were given)."""
    return {"add_generation_prompt": req.add_generation_prompt, "continue_final_message": req.continue_final_message,
            "truncate_prompt_tokens": req.truncate_prompt_tokens, "chat_template_kwargs": bool(req.chat_template_kwargs),
            "tools": bool(tools and tools.tools)}


class Audit:
    """The ingress's audit log: `entry()` starts a request's record (None when auditing is off)."""

    def __init__(self, config: AuditConfig, model_id: str, revision: str | None, writer):
        self.config = config
        self.model_id = model_id
        self.revision = revision
        self.writer = writer  # router.api.audit_sink.AuditWriter, or None when off

    def entry(self, request_id: str, response_id: str, tenant: str | None, endpoint: str, req, inputs: list,
              options: dict) -> AuditEntry | None:
        if self.writer is None:
            return None
        return AuditEntry(self, request_id, response_id, tenant, endpoint, bool(req.stream), options, inputs)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _prompt_record(given, ids: list[int], seed: int, log: bool) -> dict:
    out = {"num_tokens": len(ids), "seed": seed, "input_sha256": input_digest(given),
           "token_ids_sha256": token_digest(ids)}
    if log:
        out.update(input=given, token_ids=list(ids))
    return out


def _choice_record(choice, error: BaseException | None, log: bool) -> dict:
    failed = error is not None and not isinstance(error, asyncio.CancelledError)  # cancelled: the client left
    reason = choice.finish_reason or ("error" if failed else "abort")
    out = {"index": choice.index, "prompt": choice.prompt, "finish_reason": reason, "stop_reason": choice.stop_reason,
           "num_output_tokens": choice.num_tokens, "num_cached_tokens": choice.num_cached_tokens,
           "text_sha256": text_digest(choice.text), "token_ids_sha256": token_digest(choice.token_ids),
           "first_token_time": choice.first_token_time, "finish_time": choice.finish_time}
    if reason == "error":
        out["error"] = choice.error or (f"{type(error).__name__}: {error}" if failed else None)
    if log:
        out.update(text=choice.text, token_ids=list(choice.token_ids))
    return out


def _unique(items) -> list:
    out = []
    for item in items:
        if item not in out:
            out.append(item)
    return out
