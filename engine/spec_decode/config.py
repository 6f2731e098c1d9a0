"""What speculative decoding an engine does, with vLLM's `speculative_config` names."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`ngram` proposes the tokens that followed the latest earlier occurrence of the request's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens (prompt lookup), up to `num_speculative_tokens` a step;
    `draft_model` has `model` (a smaller HF model of the same tokenizer) draft them greedily.
    `enabled_by_default`: requests that do not say (SamplingParams.speculative None) speculate; with False
    only requests that ask do. `adaptive` sizes each request's draft from its measured acceptance and the
    measured cost of a draft token, down to none where drafting does not pay; False always drafts
    `num_speculative_tokens` (when the lookup finds that many)."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    enabled_by_default: bool = True
    adaptive: bool = True
    model: str | None = None  # the draft model's directory (method draft_model)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a draft model (model) is what method draft_model needs, and only it")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= 16:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max <= 16, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
