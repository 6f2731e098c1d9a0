"""One request's stage timeline: created at the ingress, carried in GenerateRequest to every worker, stamped
by each stage, and sent back in what the workers already return (PrefillResult.first, the finished
RequestOutput); the ingress merges the copies.

Stage names, in the order a request passes them (a stage it skips is absent):

    arrival            the ingress received the request
    validated          auth, body and limits checked
    tokenized          prompt tokens (chat template) and block hashes made
    routed             prefill/decode workers chosen
    prefill_queued     on the worker that computes the prompt: handed to its engine
    prefill_started    ... first scheduled there (vLLM's "scheduled")
    prefill_done       ... first token sampled (remote prefill)
    transfer_started   the decode worker starts pulling the KV it lacks
    transfer_done      ... pulled
    decode_admitted    the request joins the decode worker's batch
    decode_started     ... first scheduled in it (after a remote prefill)
    first_token        the ingress received the first token
    last_token         the ingress received the last token
    finished           the ingress saw the request finish
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

STAGES = ("arrival", "validated", "tokenized", "routed", "peer_pull_started", "peer_pull_done", "prefill_queued", "prefill_started", "prefill_done",
          "transfer_started", "transfer_done", "decode_admitted", "decode_started", "first_token", "last_token",
          "finished")

# Spans between stages: (name, start stage, end stage), what the Prometheus stage histograms and the
# OpenTelemetry spans cover.
PHASES = (("validation", "arrival", "validated"), ("tokenization", "validated", "tokenized"),
          ("routing", "tokenized", "routed"), ("queue", "prefill_queued", "prefill_started"),
          ("prefill", "prefill_started", "prefill_done"), ("transfer", "transfer_started", "transfer_done"),
          ("decode_admission", "decode_admitted", "decode_started"), ("decode", "decode_admitted", "finished"))


@dataclass(slots=True)
class RequestTimeline:
    """Where one request's time went. `request_id` is the HTTP request's (the client's X-Request-Id, or one
    the ingress made): every prompt and candidate of that request shares it. `times`: stage -> time.time()
    on the process that passed it."""
    request_id: str
    times: dict[str, float] = field(default_factory=lambda: {"arrival": time.time()})
    # The routing decision (router/placement/routing.py): the chosen workers, the prompt blocks each already caches,
    # where the prompt is computed ("remote" on the prefill worker, "local" on the decode worker), why,
    # and the predicted seconds to the first token on the path taken.
    prefill_worker: str | None = None
    decode_worker: str | None = None
    prefill_overlap_blocks: int = 0
    decode_overlap_blocks: int = 0
    prefill_path: str | None = None
    routing_reason: str | None = None
    predicted_ttft_s: float | None = None
    # The KV transfer, on the decode worker: blocks and bytes pulled, blocks it already cached.
    blocks_pulled: int = 0
    blocks_skipped: int = 0
    bytes_pulled: int = 0
    # The forwards that computed the prompt, counted by the engine that computed it: how many, how many on
    # borrowed cores (worker_runtime/cpu_cores.py), and their seconds (a step's whole time, shared with its
    # batch): what a slow prefill spent its time on.
    prefill_steps: int = 0
    prefill_borrowed_steps: int = 0
    prefill_forward_s: float = 0.0
    # W3C trace context of the ingress span when OpenTelemetry tracing is on (router/tracing.py).
    traceparent: str | None = None

    def stamp(self, stage: str, at: float | None = None) -> None:
        self.times[stage] = time.time() if at is None else at

    def count_prefill_step(self, seconds: float, borrowed: bool) -> None:
        """One forward that carried the prompt (a chunk, or a recomputation after a preemption)."""
        self.prefill_steps += 1
        self.prefill_borrowed_steps += borrowed
        self.prefill_forward_s += seconds

    def copy(self) -> RequestTimeline:
        """A copy to send back (the worker goes on stamping its own)."""
        out = RequestTimeline(**{name: getattr(self, name) for name in self.__dataclass_fields__})
        out.times = dict(self.times)
        return out

    def merge(self, other: RequestTimeline | None) -> None:
        """Take in a worker's copy: its stages, the prefill it computed and the transfer it made."""
        if other is None:
            return
        self.times.update(other.times)
        if other.prefill_steps:
            self.prefill_steps, self.prefill_borrowed_steps = other.prefill_steps, other.prefill_borrowed_steps
            self.prefill_forward_s = other.prefill_forward_s
        if other.blocks_pulled or other.blocks_skipped:
            self.blocks_pulled, self.blocks_skipped = other.blocks_pulled, other.blocks_skipped
            self.bytes_pulled = other.bytes_pulled

    def phase_seconds(self) -> dict[str, float]:
        """Each phase's duration (PHASES) among those the request passed."""
        return {name: max(self.times[end] - self.times[start], 0.0) for name, start, end in PHASES
                if start in self.times and end in self.times}

    def to_dict(self) -> dict:
        """JSON-ready: stages in order, as seconds since arrival and as wall-clock times, with the phases."""
        out = asdict(self)
        arrival = self.times.get("arrival", 0.0)
        out["times"] = {s: self.times[s] for s in STAGES if s in self.times}
        out["stages"] = {s: round(t - arrival, 6) for s, t in out["times"].items()}
        out["phases"] = {name: round(s, 6) for name, s in self.phase_seconds().items()}
        return out
