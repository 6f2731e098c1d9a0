"""The OpenAI endpoints' logic, independent of Serve and HTTP framing.

Per request: auth -> validate the body and its limits -> model -> admission -> tokenize (chat template),
context check and block hashes with the tenant's salt, on the tokenizer pool -> n candidates placed and
run by the RequestRouter -> one response, or server-sent events. Admission comes before the expensive
work, and that work runs off the event loop, so a huge prompt holds up neither other streams nor memory.
"""
from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass, replace

from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.errors import InvalidRequestError
from engine.hashing import block_hashes
from engine.lora_request import LoRARequest
from engine.outputs import RequestOutput
from worker_runtime.protocol import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.structured import validate_structured
from engine.timeline import RequestTimeline
from worker_runtime.tracing import end_request_span
from router.api.admission import Admission, Ticket
from router.api.audit import Audit, AuditConfig, AuditEntry, AuditRecorder, chat_options
from router.api.auth import Authenticator, cache_salt
from router.api.chat_output import ChatParsing
from router.api.flow_control import FlowControl
from router.api.openai_api import APIError, ChatCompletionRequest, CompletionRequest, error_event, parse_body, sse
from router.api.openai_responses import (ChatFormatter, Choice, CompletionFormatter, Formatter, ModelCard, ModelList,
                                         usage)
from router.placement.routing import EXPECTED_OUTPUT_TOKENS, NoDecodeWorker
from router.api.request_limits import RequestLimits, TokenizerPool
from router.placement.request_router import RequestRouter
from router.api.request_trace import Trace
from router.trace_store import TraceStore, timeline_body
from router.placement.streams import cancel, merge_streams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelInfo:
    """What the ingress must know of the served model to validate requests as the workers would."""
    name: str  # the first served name: what responses say
    vocab_size: int
    max_model_len: int
    created: int
    aliases: tuple[str, ...] = ()  # further names requests may use (`--served-model-name a b`)
    revision: str | None = None  # the weights' digest (engine.model_loader.model_revision)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=self.max_model_len, revision=self.revision)

    def adapter_card(self, adapter: LoRARequest) -> ModelCard:
        return ModelCard(id=adapter.name, created=self.created, max_model_len=self.max_model_len,
                         revision=f"sha256:{adapter.digest}", root=adapter.path, parent=self.name)


@dataclass(slots=True)
class Candidates:
    """The n candidates of one prompt, run as one request on one decode worker (they share the prompt's
    blocks there); deltas fill `choices[delta.index]`."""
    choices: list[Choice]
    request: GenerateRequest
    block_hashes: list[int]
    on_placed: Callable[[], None] | None = None  # flow control's: called once the router has placed it


class OpenAIService:
    """Serves /v1/completions, /v1/chat/completions and /v1/models on top of a RequestRouter."""

    def __init__(self, model: ModelInfo, tokenizer, auth: Authenticator, admission: Admission,
                 requests: RequestRouter, block_size: int, limits: RequestLimits | None = None,
                 parsing: ChatParsing | None = None, traces: TraceStore | None = None,
                 audit: Audit | None = None, flow: FlowControl | None = None,
                 adapters: Callable[[], Mapping[str, LoRARequest]] | None = None):
        self.model = model
        # The LoRA adapters served now, by name (the controller's registry, followed by the worker view).
        self.adapters = adapters or dict
        self.tokenizer = tokenizer
        self.auth = auth
        self.admission = admission
        self.requests = requests
        self.block_size = block_size
        self.limits = limits or RequestLimits()
        self.tokenizers = TokenizerPool(self.limits.tokenizer_threads)
        self.parsing = parsing or ChatParsing(tokenizer, None, "hermes")
        self.traces = traces or TraceStore()
        self.audit = audit or Audit(AuditConfig(), model.name, model.revision, None)
        self.flow = flow or FlowControl()  # priorities, tenants' shares and quotas (router/api/flow_control.py)

    def pick_body(self, body: bytes) -> OpenAIService:
        """The service a body is for: this one (router/api/served_models.py picks among several)."""
        return self

    def models(self, authorization: str | None) -> ModelList:
        self.auth.tenant(authorization)
        return ModelList(data=[self.model.card(name) for name in self.model.names]
                         + [self.model.adapter_card(a) for _, a in sorted(self.adapters().items())])

    def model_card(self, model: str, authorization: str | None) -> ModelCard:
        """GET /v1/models/{model}."""
        self.auth.tenant(authorization)
        adapter = self.check_model(model)
        return self.model.card(model) if adapter is None else self.model.adapter_card(adapter)

    async def completions(self, body: bytes, authorization: str | None, trace: Trace | None = None) -> Response:
        trace = trace or Trace.from_headers({})
        tenant = self.auth.tenant(authorization)
        req = parse_body(CompletionRequest, body)
        lora = self.check_model(req.model)
        prompts = req.prompts()

        def tokenize() -> list[list[int]]:
            return [self.prompt_ids(p, req.add_special_tokens) for p in prompts]

        fmt = CompletionFormatter(self.model.name if lora is None else lora.name, self.tokenizer)
        audit = self.audit.entry(trace.request_id, fmt.id, tenant, "completions", req, prompts, {
            "add_special_tokens": req.add_special_tokens, "truncate_prompt_tokens": req.truncate_prompt_tokens})
        return await self._generate(req, len(prompts), tokenize, "prompt", req.max_tokens, tenant, fmt, trace,
                                    audit=audit, lora=lora)

    async def chat(self, body: bytes, authorization: str | None, trace: Trace | None = None) -> Response:
        trace = trace or Trace.from_headers({})
        tenant = self.auth.tenant(authorization)
        req = parse_body(ChatCompletionRequest, body)
        lora = self.check_model(req.model)
        messages, options = req.template_messages(), req.template_options()
        tools = req.tool_use()
        self.parsing.check_tools(tools)
        controls = {"max_reasoning_tokens": self.parsing.reasoning_budget(req),
                    "structured": tools.structured if tools else None}
        prompt_ids = []

        def tokenize() -> list[list[int]]:
            if tools is not None and tools.structured is not None:  # the tools' schema, compiled as a grammar
                try:
                    validate_structured(tools.structured)
                except InvalidRequestError as exc:
                    raise APIError.bad_request(f"the tools' parameters do not compile: {exc}", "tools") from None
            ids = render_chat(self.tokenizer, messages, tools=tools.tools if tools else None, **options)
            prompt_ids.extend(ids)
            return [ids]

        fmt = ChatFormatter(self.model.name if lora is None else lora.name, self.tokenizer,
                            lambda: self.parsing.output(tools, prompt_ids))
        audit = self.audit.entry(trace.request_id, fmt.id, tenant, "chat.completions", req, [messages],
                                 chat_options(req, tools))
        return await self._generate(req, 1, tokenize, "messages", req.requested_max_tokens, tenant, fmt, trace,
                                    controls, audit, lora)

    # ---- shared pipeline --------------------------------------------------------------------------

    async def _generate(self, req, num_prompts: int, tokenize, prompt_field: str, max_tokens: int | None,
                        tenant: str | None, fmt: Formatter, trace: Trace, controls: dict | None = None,
                        audit: AuditEntry | None = None, lora: LoRARequest | None = None) -> Response:
        """`tokenize()` makes the prompts' token ids; it runs on the tokenizer pool once admitted. `controls`:
        SamplingParams fields the endpoint sets beyond the request's own (None values are not set). Each
        prompt's (or candidate's) GenerateRequest carries a copy of `trace.timeline`. `audit` gets the
        request's record once it has run (or failed after being placed). `lora`: the adapter it runs with."""
        self.limits.check_sampling(req)
        params = req.sampling_params(max_tokens, self.model.vocab_size, controls)
        trace.timeline.stamp("validated")
        if ignored := req.ignored_fields():
            logger.debug("%s: ignoring %s (nothing this server outputs depends on them)", fmt.id, ", ".join(ignored))
        if req.truncate_prompt_tokens is not None:
            untruncated, keep = tokenize, req.truncate_prompt_tokens
            tokenize = lambda: [ids[-keep:] for ids in untruncated()]  # noqa: E731
        salt = cache_salt(tenant, req.cache_salt)
        self.flow.check_priority(tenant, req.priority)
        ticket = self.admission.acquire(num_prompts * params.beam_width)  # sequences that run
        try:
            prompts, hashes = await self.tokenizers.run(self._prepare, tokenize, salt, max_tokens, prompt_field,
                                                        req.max_tokens_param, req.check_structured,
                                                        lora and lora.key)
            trace.timeline.stamp("tokenized")
            # Its turn by priority and tenant share, within its tenant's quotas (429 past them).
            max_output = params.max_tokens or self.model.max_model_len - min(len(ids) for ids in prompts)
            queued_at = time.monotonic()
            arrival = trace.timeline.times.get("arrival", time.time())

            def predict(ingress_ahead: tuple[int, int]) -> float | None:  # the slowest prompt's first token
                return max((self.requests.predict_ttft(hashes[p], len(ids), req.priority, time.time() - arrival,
                                                       min(max_output, EXPECTED_OUTPUT_TOKENS), ingress_ahead)
                            for p, ids in enumerate(prompts)), key=lambda s: -1 if s is None else s)

            def ready() -> bool:  # placed now, no prompt would just wait for a prefill slot
                return params.use_beam_search or not any(
                    self.requests.would_wait(hashes[p], len(ids), req.priority, time.time() - arrival,
                                             min(max_output, EXPECTED_OUTPUT_TOKENS))
                    for p, ids in enumerate(prompts))

            grant = await self.flow.enter(tenant, req.priority, sum(len(ids) for ids in prompts),
                                          max_output * num_prompts * params.beam_width, trace.deadline_s, predict,
                                          ready)
            if audit is not None:
                audit.flow = {"priority": req.priority, "tenant_weight": self.flow.weight(tenant),
                              "queued_s": round(time.monotonic() - queued_at, 6), "ahead": grant.ahead}
            candidates, seeds = [], []

            def first_token_s() -> float | None:  # the slowest prompt's, from arrival, as `predict` predicted it
                firsts = [cand.request.times.get("first_token") for cand in candidates]
                return None if not firsts or None in firsts else max(firsts) - arrival

            ticket.on_release = lambda: grant.release(sum(c.num_tokens for cand in candidates for c in cand.choices),
                                                      first_token_s())
            for p, ids in enumerate(prompts):
                # Unseeded requests get a seed here: workers seed their generators alike, so letting each
                # worker pick would give equal samples on different workers. Candidate i of n draws from
                # candidate_seed(seed, i), on a prefill, a decode or a migration target alike.
                seeds.append(secrets.randbits(62) if params.seed is None else params.seed)
                seeded = params if params.seed is not None else replace(params, seed=seeds[-1])
                candidates += _candidates(f"{fmt.id}-{p}", p, ids, seeded, salt, hashes[p], trace.timeline,
                                          req.priority, grant.ahead, lora)
            grant.prefilled = lambda: all("first_token" in cand.request.times for cand in candidates)
            placed = grant.placements(len(candidates))
            for cand in candidates:
                cand.on_placed = placed
            logger.debug("%s: %d candidates for tenant %r user %r", fmt.id, len(candidates), tenant, req.user)
            prompt_lengths = [len(ids) for ids in prompts]
            record = AuditRecorder(audit, params, seeds, candidates, prompts)
            if req.stream:  # the stream releases the ticket (and writes the record) when it ends
                return await self._stream(candidates, prompt_lengths, req, fmt, ticket, trace, record)
            try:
                body = (await self._complete(candidates, prompt_lengths, fmt)).model_dump()
            except BaseException as exc:
                self._finished(candidates, trace, error=f"{type(exc).__name__}: {exc}")
                record(exc)
                raise
            self._finished(candidates, trace, body)
            record()
            return JSONResponse(body)
        except BaseException:
            ticket.release()
            raise
        finally:
            if not req.stream:
                ticket.release()

    def _prepare(self, tokenize, salt: str | None, max_tokens: int | None, prompt_field: str,
                 max_field: str, check_structured, lora_key: str | None = None) -> tuple[list[list[int]], list[list[int]]]:
        """The expensive part, on a pool thread: the output constraint's grammar checked, each prompt's token
        ids, checked against the context, and its block hashes."""
        check_structured()
        prompts = tokenize()
        for ids in prompts:
            self._check_context(ids, max_tokens, prompt_field, max_field)
        return prompts, [block_hashes(ids, self.block_size, salt, lora_key) for ids in prompts]

    async def _complete(self, candidates: list[Candidates], prompt_lengths: list[int], fmt: Formatter):
        async def collect(cand: Candidates) -> None:
            async with aclosing(self.requests.stream(cand.request, cand.block_hashes, cand.on_placed)) as deltas:
                async for delta in deltas:
                    cand.choices[delta.index].add(delta)

        tasks = [asyncio.ensure_future(collect(cand)) for cand in candidates]
        try:
            await asyncio.gather(*tasks)
        finally:  # one failure (or a client gone) stops the others
            await cancel(tasks)
        choices = [c for cand in candidates for c in cand.choices]
        if failed := next((c for c in choices if c.finish_reason == "error"), None):
            raise _failed(failed.error)
        return fmt.response(choices, usage(choices, prompt_lengths))

    def _finished(self, candidates: list[Candidates], trace: Trace, body: dict | None = None,
                  error: str | None = None) -> None:
        """A request that was placed ended (or failed: `error`): its timelines go to the store, so a failed
        request shows how far it got, and into `body` when the client asked for them."""
        if trace.stored:
            return
        trace.stored = True
        timelines = [cand.request.timeline for cand in candidates]
        self.traces.add(trace.request_id, timelines)
        end_request_span(trace.span, timelines, error)
        if trace.requested and body is not None:
            body["tandem"] = timeline_body(trace.request_id, timelines)

    async def _stream(self, candidates: list[Candidates], prompt_lengths: list[int], req, fmt: Formatter,
                      ticket: Ticket, trace: Trace, record: AuditRecorder) -> Response:
        streams = [self.requests.stream(cand.request, cand.block_hashes, cand.on_placed) for cand in candidates]
        # Wait for every first delta before answering, so a request no worker takes gets a real status code.
        first = [asyncio.ensure_future(anext(s)) for s in streams]
        try:
            firsts = await asyncio.gather(*first)
        except BaseException as exc:
            await cancel(first)
            await _close(streams)
            self._finished(candidates, trace, error=f"{type(exc).__name__}: {exc}")
            record(exc)
            raise
        events = self._events(candidates, streams, firsts, prompt_lengths, req, fmt, trace, record)

        async def close() -> None:
            await events.aclose()
            await _close(streams)
            ticket.release()
            self._finished(candidates, trace)  # unless the stream's last chunk did
            record()

        return EventStream(events, on_close=close)

    async def _events(self, candidates: list[Candidates], streams, firsts: list[RequestOutput],
                      prompt_lengths: list[int], req, fmt: Formatter, trace: Trace,
                      record: AuditRecorder) -> AsyncIterator[str]:
        """The stream's events; `req` says whether usage comes at the end and in every chunk. A candidate
        that fails ends with finish_reason "error", followed by an error event carrying the message. With
        the trace requested, a last chunk (the usage chunk, when asked for) carries the `tandem` field."""
        choices = [c for cand in candidates for c in cand.choices]
        try:
            for choice in choices:
                if (chunk := fmt.first_chunk(choice)) is not None:
                    yield sse(chunk)
            async with aclosing(_merge(streams, firsts)) as merged:
                async for i, delta in merged:
                    choice = candidates[i].choices[delta.index]
                    chunk = fmt.chunk(choice, delta, len(choice.text))
                    choice.add(delta)
                    if chunk is not None:
                        if req.continuous_usage:
                            chunk.usage = usage(choices, prompt_lengths)
                        yield sse(chunk)
                    if delta.finish_reason == "error":
                        yield error_event(_failed(delta.error))
            if req.include_usage and not trace.requested:
                yield sse(fmt.usage_chunk(usage(choices, prompt_lengths)))
            elif trace.requested:
                chunk = fmt.usage_chunk(usage(choices, prompt_lengths)).model_dump()
                if not req.include_usage:
                    chunk["usage"] = None
                self._finished(candidates, trace, chunk)
                yield sse(json.dumps(chunk))
        except Exception as exc:  # headers are out: the error goes into the stream
            record.error = exc
            yield error_event(to_api_error(exc))
        yield "data: [DONE]\n\n"

    # ---- validation -------------------------------------------------------------------------------

    def check_model(self, model: str) -> LoRARequest | None:
        """The LoRA adapter `model` names, None for the base model; 404 naming what is served otherwise."""
        if model in self.model.names:
            return None
        adapters = self.adapters()
        if model in adapters:
            return adapters[model]
        served = ", ".join(f"`{n}`" for n in (*self.model.names, *sorted(adapters)))
        raise APIError(404, f"the model `{model}` does not exist; this server serves {served}",
                       param="model", code="model_not_found")

    def prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            if not all(0 <= t < self.model.vocab_size for t in ids):
                raise APIError.bad_request(f"prompt token ids must be in [0, {self.model.vocab_size})", "prompt")
        if not ids:
            raise APIError.bad_request("prompt must not be empty", "prompt")
        return ids

    def _check_context(self, ids: list[int], max_tokens: int | None, prompt_field: str, max_field: str) -> None:
        limit = self.model.max_model_len
        if len(ids) >= limit:
            raise APIError.bad_request(f"the prompt has {len(ids)} tokens; the context window is {limit}, leaving "
                                       f"no room to generate", prompt_field)
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError.bad_request(f"{max_field}={max_tokens} does not fit: the prompt has {len(ids)} tokens "
                                       f"and the context window is {limit}", max_field)


def _candidates(request_id: str, prompt: int, ids: list[int], params: SamplingParams, salt: str | None,
                hashes: list[int], timeline: RequestTimeline, priority: int = 0, ahead: bool = False,
                lora: LoRARequest | None = None) -> list[Candidates]:
    """Prompt `prompt`'s n candidates: one request whose candidates fork on one worker, or, for outputs
    under a grammar or a reasoning budget (which forked candidates do not carry yet), n requests of one
    candidate each, seeded candidate_seed(seed, i) alike."""
    first = prompt * params.n
    request = GenerateRequest(request_id, ids, params, salt, timeline.copy(), priority=priority, ahead=ahead,
                              lora=lora)
    if params.n == 1 or (params.structured is None and params.max_reasoning_tokens is None):
        return [Candidates([Choice(first + i, prompt) for i in range(params.n)], request, hashes)]
    return [Candidates([Choice(first + i, prompt)], request.candidate(i), hashes) for i in range(params.n)]


class EventStream(StreamingResponse):
    """An SSE response that runs `on_close` however it ends: finished, client gone (even before the
    first event was sent), or failed."""

    def __init__(self, events: AsyncIterator[str], on_close):
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def render_chat(tokenizer, messages: list[dict], tokenize: bool = True, **options) -> list[int] | str:
    """The conversation through the chat template: token ids (or the text); a template that rejects the
    conversation (roles, order) is the client's 400."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=tokenize, return_dict=False, **options)
    except Exception as exc:
        raise APIError.bad_request(f"the chat template cannot render these messages: {exc}", "messages") from None
    return list(out) if tokenize else out


def to_api_error(exc: BaseException) -> APIError:
    """Any failure of the request path as an OpenAI error; unexpected ones are logged with their traceback."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):  # a worker refused it (Ray keeps the class of the cause)
        cause = getattr(exc, "cause", exc)
        return APIError.bad_request(str(cause), getattr(cause, "field", None))
    if isinstance(exc, NoDecodeWorker):
        return APIError(503, f"no decode worker can take the request right now: {exc}", type="service_unavailable",
                        headers={"Retry-After": "1"})
    logger.error("request failed", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type="internal_error")


def _failed(message: str | None) -> APIError:
    """The error of a candidate that ended with finish_reason "error" (its worker failed and it could not move)."""
    return APIError(500, message or "the request failed on its worker", type="internal_error")


async def _merge(streams: list, firsts: list[RequestOutput]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The already received first deltas, then every stream's deltas as they come, tagged by index."""
    for i, delta in enumerate(firsts):
        yield i, delta
    async with aclosing(merge_streams(streams)) as merged:
        async for i, delta in merged:
            yield i, delta


async def _close(streams: list) -> None:
    for stream in streams:
        await stream.aclose()
