"""Suffix decoding (method "suffix"): drafts from the request's own suffix tree and from a global tree of
earlier outputs per cache salt change no output, and a request repeating an earlier answer gets long drafts."""
from __future__ import annotations

import pydantic
import pytest

from cluster.config import SpeculativeOptions
from engine import Engine, EngineConfig
from engine.sampling_params import SamplingParams
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.suffix import GlobalSuffixCache, SuffixTree

LOOP_PROMPT = [33280] * 8 + [5, 6, 7, 8, 33280, 33280, 33280]
# Greedy, the tiny random Llama answers this prompt with 44 distinct tokens in 48: lookup in the request's
# own tokens finds (almost) nothing to draft.
FRESH_PROMPT = [7800, 19422, 17836, 4276, 12125, 19792, 15536, 20506, 19036, 2150, 19847, 434]
PROMPTS = [LOOP_PROMPT, [100, 200, 300, 400, 500], list(range(30, 70)), [5, 6, 7, 8, 9, 10] * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def make_engine(model_dir: str, method: str | None, **suffix) -> Engine:
    """Not adaptive: tests draft whatever the proposer finds, whatever drafting costs on this machine."""
    config = None if method is None else SpeculativeConfig(method=method, num_speculative_tokens=4, adaptive=False,
                                                           **suffix)
    return Engine(EngineConfig(model=model_dir, num_kv_blocks=256, speculative_config=config))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_engine(tiny_llama_dir, None)


@pytest.fixture
def suffix(tiny_llama_dir):
    return make_engine(tiny_llama_dir, "suffix")


def accepted_for(engine: Engine, prompt: list[int], cache_salt: str | None = None) -> tuple[list[int], int]:
    """One greedy request's output and the draft tokens accepted for it."""
    before = engine.speculator.stats.num_accepted_tokens
    engine.add_request(f"r{engine.num_generation_tokens}", prompt, GREEDY, cache_salt)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            if out.finished:
                return tokens, engine.speculator.stats.num_accepted_tokens - before
    raise AssertionError("the request did not finish")


def test_greedy_output_with_suffix_decoding_equals_output_without(plain, suffix):
    expected = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in suffix.generate(PROMPTS, GREEDY)] == expected
    stats = suffix.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens_per_pos[3] > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_seeded_sampling_with_suffix_decoding_draws_the_same_tokens(plain, suffix):
    params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=32, ignore_eos=True, seed=s) for s in range(4)]
    prompts = [LOOP_PROMPT] * 4
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in suffix.generate(prompts, params)] == expected
    assert suffix.speculator.stats.num_accepted_tokens > 0


def test_a_request_repeating_an_earlier_answer_drafts_it_from_the_global_tree(tiny_llama_dir, plain, suffix):
    """Prompt lookup has nothing to go on in a fresh answer; the global tree holds the earlier one."""
    ngram = make_engine(tiny_llama_dir, "ngram")
    expected = plain.generate([FRESH_PROMPT], GREEDY)[0].token_ids
    results = {}
    for name, engine in (("ngram", ngram), ("suffix", suffix)):
        first, _ = accepted_for(engine, FRESH_PROMPT)
        second, accepted = accepted_for(engine, FRESH_PROMPT)
        assert first == second == expected
        results[name] = accepted
    # 47 tokens after the prefill's: 4 accepted + 1 bonus a step, from the first decode step on.
    assert results["suffix"] >= 36 and results["ngram"] < 10, results


def test_global_tree_is_not_shared_across_cache_salts(tiny_llama_dir, suffix):
    fresh = make_engine(tiny_llama_dir, "suffix")
    _, own_only = accepted_for(fresh, FRESH_PROMPT, cache_salt="tenant-b")  # nothing cached anywhere yet
    accepted_for(suffix, FRESH_PROMPT, cache_salt="tenant-a")
    output, other_tenant = accepted_for(suffix, FRESH_PROMPT, cache_salt="tenant-b")
    _, same_tenant = accepted_for(suffix, FRESH_PROMPT, cache_salt="tenant-a")
    assert other_tenant == own_only < same_tenant
    assert set(suffix.speculator.proposer.cache.trees) == {"tenant-a", "tenant-b"}


def test_misleading_global_tree_changes_no_output(plain, suffix):
    """The global tree is a compute cache: filled with wrong answers, its drafts are rejected."""
    expected = plain.generate([FRESH_PROMPT], GREEDY)[0].token_ids
    wrong = [(t + 1) % 1000 + 3 for t in expected]
    for _ in range(5):
        suffix.speculator.proposer.cache.add(None, FRESH_PROMPT, wrong)
    output, _ = accepted_for(suffix, FRESH_PROMPT)
    stats = suffix.speculator.stats
    assert output == expected
    assert stats.num_draft_tokens > stats.num_accepted_tokens


def test_global_tree_stays_under_its_caps_and_evicts_whole_requests(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "suffix", suffix_decoding_max_cached_requests=3)
    cache = engine.speculator.proposer.cache
    prompts = [[7 + i, 11 * i + 3, 500 + i] for i in range(8)]
    engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert len(cache.cached) == 3
    rebuilt = SuffixTree(cache.max_depth)
    for _, tokens in cache.cached.values():
        rebuilt.add(tokens)
    assert cache.num_nodes == rebuilt.num_nodes  # the evicted requests' nodes are all gone

    by_nodes = GlobalSuffixCache(max_depth=8, max_cached_requests=1000, max_tree_nodes=300)
    for i in range(50):
        by_nodes.add(f"salt-{i % 3}", [1, 2, 3], [(i * 7 + j) % 97 for j in range(20)])
        assert by_nodes.num_nodes <= 300
    assert 0 < len(by_nodes.cached) < 50


def test_removing_every_sequence_empties_a_tree():
    tree = SuffixTree(max_depth=5)
    sequences = [[1, 2, 3, 1, 2, 3, 4], [2, 3, 4, 5], [1, 1, 1, 1, 1, 1, 1, 1]]
    for tokens in sequences:
        tree.add(tokens)
    assert tree.counts[tree.find([1, 2, 3])] == 2 and tree.counts[tree.find([1, 1, 1, 1, 1])] == 4
    for tokens in sequences[::-1]:
        tree.remove(tokens)
    assert tree.num_nodes == 0 and not tree.children[0]
    tree.add(sequences[1])  # freed nodes are reused
    assert tree.num_nodes == len(tree.counts) - 1 - len(tree.free) and tree.counts[tree.find([3, 4])] == 1


@pytest.mark.parametrize("bad", [
    {"suffix_decoding_max_tree_depth": 4},  # not above num_speculative_tokens (4)
    {"suffix_decoding_max_tree_depth": 65},
    {"suffix_decoding_max_cached_requests": -1},
    {"suffix_decoding_max_tree_nodes": 0},
    {"suffix_decoding_max_spec_factor": 0.0},
    {"suffix_decoding_min_token_prob": 1.5},
    {"model": "/some/draft"},
])
def test_invalid_suffix_config_is_rejected(bad):
    with pytest.raises(ValueError, match=next(iter(bad)) if "model" not in bad else "draft model"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=4, **bad)


def test_cluster_config_takes_method_suffix_and_validates_its_knobs():
    options = SpeculativeOptions(method="suffix", suffix_decoding_max_cached_requests=10)
    assert options.engine_config().method == "suffix"
    assert options.engine_config().suffix_decoding_max_cached_requests == 10
    with pytest.raises(pydantic.ValidationError, match="suffix_decoding_min_token_prob"):
        SpeculativeOptions(method="suffix", suffix_decoding_min_token_prob=2)
    with pytest.raises(pydantic.ValidationError, match="method"):
        SpeculativeOptions(method="suffix-tree")
