"""Prompt-lookup proposals: the tokens that followed the latest earlier occurrence of the sequence's end."""
from __future__ import annotations


class NgramIndex:
    """Where each n-gram (n in [min_n, max_n]) of one token sequence last occurred, extended as the
    sequence grows, so a lookup costs a few dict probes however long the context is."""

    __slots__ = ("min_n", "max_n", "ends", "num_indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.ends: dict[tuple[int, ...], int] = {}  # n-gram -> end (exclusive) of its latest occurrence
        self.num_indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """`k` tokens that followed the longest n-gram ending `tokens`, at its latest earlier occurrence
        (none without one). An occurrence closer than `k` tokens to the end is a loop of that period: the
        draft goes round it."""
        self._extend(tokens)
        num = len(tokens)
        for n in range(min(self.max_n, num - 1), self.min_n - 1, -1):
            end = self.ends.get(tuple(tokens[num - n:]))
            if end is not None:
                period = num - end
                return tokens[end:end + k] if period >= k else [tokens[end + i % period] for i in range(k)]
        return []

    def _extend(self, tokens: list[int]) -> None:
        # Only n-grams that something followed: those ending before the last token.
        for end in range(max(self.num_indexed, self.min_n), len(tokens)):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.ends[tuple(tokens[end - n:end])] = end
        self.num_indexed = max(self.num_indexed, len(tokens))


class NgramProposer:
    """Prompt lookup for a batch: each request looks in its own tokens (its SpecState's index)."""

    @staticmethod
    def propose(batch) -> list[list[int]]:
        return [req.spec.index.propose(req.all_token_ids, k) for req, k in batch]
