"""Structured outputs, enforced while decoding with llguidance (picked by measurement: bench/HISTORY.md).

A request's constraint (`StructuredOutputs`) becomes an llguidance grammar, compiled into a matcher on
the manager's compile thread, never on the engine's step loop: the engine holds the request back from
scheduling until its matcher is ready (vLLM's WAITING_FOR_FSM). Compiled matchers are cached per
constraint and each request gets a copy, so a repeated schema compiles once. Every step the sampler asks
for one `grammar_bitmask` over the batch's constrained rows (filled by llguidance's thread pool) and
applies it with llguidance's kernel; every accepted token advances the request's matcher.
"""
from __future__ import annotations

import functools
import json
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import llguidance

from engine.errors import InvalidRequestError
from engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:  # the ingress validates constraints without torch; the engine's step loads these
    import torch

CACHE_SIZE = 256  # compiled constraints kept; a copy of one costs microseconds, a compile milliseconds
# JSON as `json.dumps` writes it, as vLLM's guidance backend does: flexible whitespace lets a model spend its
# tokens on blank lines (a weak model can loop there until max_tokens).
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_spec(structured: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint (no tokenizer needed)."""
    if structured.json is not None or structured.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema(structured.json or '{"type": "object"}',
                                                             defaults=JSON_DEFAULTS)
    if structured.regex is not None:
        return llguidance.grammar_from("regex", structured.regex)
    if structured.choice is not None:
        return llguidance.grammar_from("choice", json.dumps(list(structured.choice)))
    return llguidance.grammar_from("grammar", structured.grammar)


def validate_structured(structured: StructuredOutputs) -> None:
    """Raise InvalidRequestError naming the constraint's kind (`json`, `regex`, `choice`, `grammar`) when
    it cannot be compiled: a schema that is not JSON or not a valid schema, a bad regex or grammar."""
    error = grammar_error(structured)
    if error:
        raise InvalidRequestError(f"invalid {structured.kind}: {error}", field=structured.kind)


@functools.lru_cache(maxsize=CACHE_SIZE)
def grammar_error(structured: StructuredOutputs) -> str | None:
    """Why `structured` cannot be compiled, or None; cached, since clients repeat their schemas."""
    if structured.json is not None:
        try:
            schema = json.loads(structured.json)
        except ValueError as exc:
            return f"the JSON schema is not valid JSON: {exc}"
        if not isinstance(schema, (dict, bool)):
            return "a JSON schema must be an object or a boolean"
    if structured.choice is not None and not (structured.choice and all(structured.choice)):
        return "choice must be a non-empty list of non-empty strings"
    try:
        return llguidance.LLMatcher.validate_grammar(grammar_spec(structured)).strip() or None
    except (ValueError, TypeError) as exc:
        return str(exc)


class StructuredOutputRequest:
    """One request's grammar state: its matcher, ready once compiled."""

    def __init__(self, structured: StructuredOutputs, matcher: Future):
        self.structured = structured
        self._matcher = matcher

    @property
    def ready(self) -> bool:
        return self._matcher.done()

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The compiled matcher; raises InvalidRequestError when the constraint did not compile."""
        return self._matcher.result()

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance the grammar by `tokens`; False when one of them is not allowed."""
        matcher = self.matcher
        return all(matcher.consume_token(t) for t in tokens)

    @property
    def is_terminated(self) -> bool:
        """The grammar accepts nothing more: the output is complete."""
        return self.matcher.is_stopped()


class StructuredOutputManager:
    """Compiles constraints off the step loop (one thread, with a cache) and fills the batch's bitmask.

    The tokenizer's llguidance view is built on the compile thread with the first constraint, so an
    engine that never sees one never pays for it."""

    def __init__(self, tokenizer, vocab_size: int, max_num_seqs: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self._ll_tokenizer = None
        self._cache: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        self._bitmask: torch.Tensor | None = None
        self._executor: llguidance.LLExecutor | None = None

    def request(self, structured: StructuredOutputs) -> StructuredOutputRequest:
        """Start compiling `structured`; the returned request is ready when its matcher is."""
        return StructuredOutputRequest(structured, self._compiler.submit(self._compile, structured))

    def wait_any(self, reqs: list[StructuredOutputRequest], timeout: float) -> None:
        """Block until one of `reqs` is ready or `timeout` seconds pass (the engine has nothing else to run)."""
        wait([r._matcher for r in reqs], timeout=timeout, return_when="FIRST_COMPLETED")

    def _compile(self, structured: StructuredOutputs) -> llguidance.LLMatcher:
        template = self._cache.get(structured)
        if template is None:
            validate_structured(structured)
            if self._ll_tokenizer is None:
                from llguidance.hf import from_tokenizer
                self._ll_tokenizer = from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
            template = llguidance.LLMatcher(self._ll_tokenizer, grammar_spec(structured))
            if template.is_error():
                raise InvalidRequestError(f"invalid {structured.kind}: {template.get_error()}",
                                          field=structured.kind)
            self._cache[structured] = template
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(structured)
        return template.deep_copy()

    def grammar_bitmask(self, reqs: list[StructuredOutputRequest]) -> torch.Tensor:
        """The allowed-token bitmask of each request, one int32 row per request (bit t of a row: token t
        is allowed), filled in parallel by llguidance. The tensor is reused by the next call, so only
        the engine's step loop calls this."""
        from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask_par
        if self._bitmask is None or self._bitmask.shape[0] < len(reqs):
            rows = max(self.max_num_seqs, len(reqs))
            self._bitmask = allocate_token_bitmask(rows, self.vocab_size)
            self._executor = self._executor or llguidance.LLExecutor()
        bitmask = self._bitmask[: len(reqs)]
        fill_next_token_bitmask_par(self._executor, [(r.matcher, i) for i, r in enumerate(reqs)], bitmask)
        return bitmask


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on `rows` of the batch (row i of `bitmask`
    belongs to `rows[i]`), with llguidance's kernel."""
    import torch
    from llguidance.torch import apply_token_bitmask_inplace
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        apply_token_bitmask_inplace(logits, bitmask)
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    constrained = logits.index_select(0, index)
    apply_token_bitmask_inplace(constrained, bitmask)
    logits.index_copy_(0, index, constrained)
