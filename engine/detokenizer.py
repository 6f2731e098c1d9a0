"""Incremental detokenization with stop strings that never leak and no half UTF-8 characters."""
from __future__ import annotations

from engine.sampling_params import SamplingParams

PROMPT_CONTEXT_TOKENS = 5


def backend_decode(tokenizer):
    """The Rust tokenizer's own `decode` when the HF wrapper would add nothing to it (no clean-up of
    spaces): the wrapper's argument conversion cost more than the decoding, twice per token."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    """Decodes a growing token list a window at a time, as vLLM does: text is released only once it
    no longer ends in a replacement character, and up to len(longest stop) - 1 characters are held
    back while streaming in case they begin a stop string."""

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int] | set[int] = frozenset()):
        self.decode = backend_decode(tokenizer)
        self.params = params
        # Token ids that end the request: their text is not output (as vLLM), EOS unless it is ignored.
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.emitted = 0
        self.num_output_tokens = 0
        self.hold_back = max((len(s) for s in params.stop), default=1) - 1

    def append(self, token_id: int) -> str | None:
        """Add one token; returns the stop string it completed, if any (the text is then cut before it).

        Like vLLM, stop strings and stop token ids count only once min_tokens are out, and the text of a
        token that ends the request (a stop token id, or EOS) stays out of the output unless
        include_stop_str_in_output; it shows only with skip_special_tokens=False for EOS."""
        self.num_output_tokens += 1
        stops_now = self.num_output_tokens >= self.params.min_tokens
        if stops_now and token_id in self.stop_ids and not self.params.include_stop_str_in_output:
            return None
        self.ids.append(token_id)
        skip = self.params.skip_special_tokens
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=skip)
        full = self.decode(self.ids[self.prefix_offset:], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new_text
        return self._check_stop(len(new_text)) if stops_now else None

    def _check_stop(self, num_new_chars: int) -> str | None:
        for stop in self.params.stop:
            # Only a match that ends in the new text is new; older text was searched already.
            idx = self.text.find(stop, max(0, len(self.text) - num_new_chars - len(stop) + 1))
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.text = self.text[:end]
                return stop
        return None

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, keeps back what could begin a stop string."""
        limit = len(self.text) if finished else max(self.emitted, len(self.text) - self.hold_back)
        out = self.text[self.emitted:limit]
        self.emitted = limit
        return out
