"""Suffix decoding (SuffixDecoding, arXiv 2411.04975; vLLM's method "suffix"): drafts from suffix trees.

Each request has its own tree over its prompt and output (`SuffixTree.extend`, grown as it decodes), and
the engine keeps global trees over the outputs of earlier finished requests (`GlobalSuffixCache`), one
per cache salt so that one tenant's outputs never draft another's. A tree here is a trie of every
substring up to `max_depth` tokens, each node counting the occurrences of its path. The pattern is the
request's last tokens; from the node of each matched length the draft follows the most frequent child
while the product of the branch frequencies stays at least `min_token_prob`, for at most
`max_spec_factor` x the match length tokens, and the draft expected to keep most tokens (the sum of those
products) wins. Drafts are a compute cache only: verification keeps exactly the target's tokens.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


ROOT = 0


class SuffixTree:
    """A trie of all substrings (up to `max_depth` tokens) of the sequences added to it, with counts.

    `extend` grows it with one sequence as that sequence grows (a request's tree); `current[i]` is then
    the node of the sequence's last i + 1 tokens. `add`/`remove` put a whole sequence in and take it out
    again (the global trees), so counts and nodes go back exactly to what they were. Nodes are ids into
    flat lists (children maps hold ints only, so the garbage collector never walks a tree)."""

    __slots__ = ("max_depth", "counts", "children", "free", "current", "num_indexed")

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.counts: list[int] = [0]
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child}
        self.free: list[int] = []  # ids of removed nodes, reused first
        self.current: list[int] = []
        self.num_indexed = 0

    @property
    def num_nodes(self) -> int:
        return len(self.counts) - len(self.free) - 1

    def extend(self, tokens: Sequence[int]) -> None:
        """Index the tokens of the growing sequence `tokens` not indexed yet: O(max_depth) per token."""
        for token in tokens[self.num_indexed:]:
            parents = [ROOT, *self.current[:self.max_depth - 1]]
            self.current = [self._child(parent, token, 1) for parent in parents]
        self.num_indexed = max(self.num_indexed, len(tokens))

    def add(self, tokens: Sequence[int], sign: int = 1) -> None:
        """Count every substring of `tokens` (sign -1: remove them again; nodes left at zero are freed)."""
        for start in range(len(tokens)):
            node = ROOT
            path = tokens[start:start + self.max_depth]
            for depth, token in enumerate(path):
                child = self._child(node, token, sign)
                if self.counts[child] == 0:  # only this occurrence used it: the rest of the path is its alone
                    del self.children[node][token]
                    self._free_chain(child, path[depth + 1:])
                    break
                node = child

    def remove(self, tokens: Sequence[int]) -> None:
        self.add(tokens, -1)

    def _child(self, node: int, token: int, sign: int) -> int:
        child = self.children[node].get(token)
        if child is None:
            if self.free:
                child = self.free.pop()
                self.counts[child], self.children[child] = 0, {}
            else:
                child = len(self.counts)
                self.counts.append(0)
                self.children.append({})
            self.children[node][token] = child
        self.counts[child] += sign
        return child

    def _free_chain(self, node: int, rest: Sequence[int]) -> None:
        self.free.append(node)
        for token in rest:
            node = self.children[node][token]
            self.free.append(node)

    def find(self, pattern: Sequence[int]) -> int | None:
        node: int | None = ROOT
        for token in pattern:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node


@dataclass(slots=True, frozen=True)
class DraftRule:
    """How far a draft goes: at most `max_spec_factor` x the match length tokens (and k), while the product
    of the branch frequencies taken stays at least `min_token_prob`."""
    max_spec_factor: float
    min_token_prob: float

    def draft(self, tree: SuffixTree, node: int, match_len: int, k: int, own: bool) -> tuple[list[int], float]:
        """The draft from the node of a matched pattern, and its score (expected tokens kept). `own`: the
        tree is the request's, whose chain of end nodes counts the end, which nothing follows yet."""
        limit = min(k, math.ceil(self.max_spec_factor * match_len))
        counts, current = tree.counts, tree.current
        tokens: list[int] = []
        score, prob, depth = 0.0, 1.0, match_len
        while len(tokens) < limit and tree.children[node]:
            seen = counts[node] - (own and depth <= len(current) and current[depth - 1] == node)
            token, child = max(tree.children[node].items(), key=lambda item: counts[item[1]])
            prob *= counts[child] / max(seen, counts[child])
            if prob < self.min_token_prob:
                break
            tokens.append(token)
            score += prob
            node, depth = child, depth + 1
        return tokens, score


def best_draft(rule: DraftRule, tree: SuffixTree, tokens: Sequence[int], k: int, own: bool) -> tuple[list[int], float]:
    """The best-scoring draft over the lengths of the pattern (the end of `tokens`) found in `tree`; `own`:
    `tree` is the request's own tree, already extended with `tokens`."""
    best: tuple[list[int], float] = ([], 0.0)
    for match_len in range(min(tree.max_depth - 1, len(tokens)), 0, -1):
        node = tree.current[match_len - 1] if own else tree.find(tokens[len(tokens) - match_len:])
        if node is None or not tree.children[node]:
            continue
        draft = rule.draft(tree, node, match_len, k, own)
        if draft[1] > best[1]:
            best = draft
    return best


class GlobalSuffixCache:
    """Suffix trees over the outputs of finished requests, one per cache salt, bounded by
    `max_cached_requests` and `max_tree_nodes` (all salts together): the least recently added requests'
    contributions are removed whole. A request's output goes in with up to max_depth - 1 tokens of its
    prompt before it, so a later request whose prompt ends alike gets drafts from its first token on."""

    def __init__(self, max_depth: int, max_cached_requests: int, max_tree_nodes: int):
        self.max_depth = max_depth
        self.max_cached_requests, self.max_tree_nodes = max_cached_requests, max_tree_nodes
        self.trees: dict[str | None, SuffixTree] = {}
        self.cached: OrderedDict[int, tuple[str | None, list[int]]] = OrderedDict()
        self._next_id = 0

    @property
    def num_nodes(self) -> int:
        return sum(tree.num_nodes for tree in self.trees.values())

    def tree(self, cache_salt: str | None) -> SuffixTree | None:
        return self.trees.get(cache_salt)

    def add(self, cache_salt: str | None, prompt: Sequence[int], output: Sequence[int]) -> None:
        if self.max_cached_requests == 0 or not output:
            return
        tokens = [*prompt[max(len(prompt) - self.max_depth + 1, 0):], *output]
        tree = self.trees.get(cache_salt)
        if tree is None:
            tree = self.trees[cache_salt] = SuffixTree(self.max_depth)
        tree.add(tokens)
        self.cached[self._next_id] = (cache_salt, tokens)
        self._next_id += 1
        while len(self.cached) > self.max_cached_requests or self.num_nodes > self.max_tree_nodes:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        _, (salt, tokens) = self.cached.popitem(last=False)
        tree = self.trees[salt]
        tree.remove(tokens)
        if tree.num_nodes == 0:
            del self.trees[salt]


class SuffixProposer:
    """Suffix decoding for a batch: each request drafts from its own tree (its SpecState's index) or from
    the global tree of its cache salt, whichever draft scores higher; `finished` feeds the global trees."""

    def __init__(self, config):
        self.rule = DraftRule(config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)
        self.cache = GlobalSuffixCache(config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests,
                                       config.suffix_decoding_max_tree_nodes)

    def propose(self, batch) -> list[list[int]]:
        return [self._propose(req, k) for req, k in batch]

    def _propose(self, req, k: int) -> list[int]:
        tokens, own = req.all_token_ids, req.spec.index
        own.extend(tokens)
        draft = best_draft(self.rule, own, tokens, k, own=True)
        shared = self.cache.tree(req.cache_salt)
        if shared is not None:
            other = best_draft(self.rule, shared, tokens, k, own=False)
            if other[1] > draft[1]:
                draft = other
        return draft[0]

    def finished(self, req) -> None:
        """Cache a finished request's output for later requests of its cache salt."""
        self.cache.add(req.cache_salt, req.prompt_token_ids, req.output_token_ids)
