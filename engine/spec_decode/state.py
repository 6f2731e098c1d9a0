"""One request's speculation state, carried on its Request (kept apart from the speculator, so that
engine/request.py imports nothing that imports it back)."""
from __future__ import annotations

from dataclasses import dataclass

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramIndex
from engine.spec_decode.suffix import SuffixTree

PRIOR_ACCEPTANCE = 0.5
ACCEPTANCE_ALPHA = 0.1  # weight of one position's outcome in a request's acceptance EWMA


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its n-gram index (method ngram) or suffix tree (method suffix), measured
    acceptance, and a guess it did not draft."""
    index: NgramIndex | SuffixTree | None
    acceptance: float = PRIOR_ACCEPTANCE
    shadow: int | None = None

    def observe(self, accepted: bool) -> None:
        self.acceptance += ACCEPTANCE_ALPHA * (float(accepted) - self.acceptance)


def new_spec_state(config: SpeculativeConfig) -> SpecState:
    if config.method == "ngram":
        return SpecState(NgramIndex(config.prompt_lookup_min, config.prompt_lookup_max))
    return SpecState(SuffixTree(config.suffix_decoding_max_tree_depth) if config.method == "suffix" else None)
