"""What speculative decoding an engine does, with vLLM's `speculative_config` names."""
from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model", "suffix")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """`ngram` proposes the tokens that followed the latest earlier occurrence of the request's last
    `prompt_lookup_max` .. `prompt_lookup_min` tokens (prompt lookup), up to `num_speculative_tokens` a step;
    `draft_model` has `model` (a smaller HF model of the same tokenizer) draft them greedily; `suffix` drafts
    from suffix trees over the request's own tokens and the outputs of earlier requests of its cache salt
    (suffix.py; the `suffix_decoding_*` knobs).
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
    suffix_decoding_max_tree_depth: int = 24  # longest pattern + draft a tree holds
    suffix_decoding_max_cached_requests: int = 1000  # finished outputs kept for later requests (0: none)
    suffix_decoding_max_tree_nodes: int = 500_000  # nodes of all global trees together
    suffix_decoding_max_spec_factor: float = 1.0  # a draft is at most this x the matched length
    suffix_decoding_min_token_prob: float = 0.1  # a draft stops where its estimated chance falls below

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
        if not self.num_speculative_tokens < self.suffix_decoding_max_tree_depth <= 64:
            raise ValueError("suffix_decoding_max_tree_depth must exceed num_speculative_tokens and be at most 64, "
                             f"got {self.suffix_decoding_max_tree_depth}")
        if self.suffix_decoding_max_cached_requests < 0 or self.suffix_decoding_max_tree_nodes < 1:
            raise ValueError("suffix_decoding_max_cached_requests must be >= 0 and suffix_decoding_max_tree_nodes "
                             f">= 1, got {self.suffix_decoding_max_cached_requests} and "
                             f"{self.suffix_decoding_max_tree_nodes}")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(f"suffix_decoding_max_spec_factor must be > 0, got {self.suffix_decoding_max_spec_factor}")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError("suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob}")
