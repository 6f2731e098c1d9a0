"""Speculative decoding in the engine: n-gram drafts verified in the packed batch change no output and
leave the KV blocks and the prefix cache exactly as plain decoding does."""
from __future__ import annotations

import collections

import pytest

from engine import Engine, EngineConfig
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams, StructuredOutputs
from engine.spec_decode import SpeculativeConfig
from engine.spec_decode.speculator import num_drafts

# The tiny random Llama falls into loops that prompt lookup predicts; 33280 repeats itself under greedy.
LOOP_PROMPT = [33280] * 8 + [5, 6, 7, 8, 33280, 33280, 33280]
PROMPTS = [LOOP_PROMPT, [100, 200, 300, 400, 500], list(range(30, 70)), [5, 6, 7, 8, 9, 10] * 3]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def make_engine(model_dir: str, speculative: bool, adaptive: bool = False, **kwargs) -> Engine:
    """Tests of outputs draft 4 tokens whenever the lookup finds them (not adaptive): whether drafting pays
    on the tiny model depends on timing, which tests must not."""
    config = SpeculativeConfig(num_speculative_tokens=4, adaptive=adaptive) if speculative else None
    return Engine(EngineConfig(model=model_dir, num_kv_blocks=kwargs.pop("num_kv_blocks", 256),
                               speculative_config=config, **kwargs))


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return make_engine(tiny_llama_dir, speculative=False)


@pytest.fixture
def spec(tiny_llama_dir):
    return make_engine(tiny_llama_dir, speculative=True)


def token_ids(outputs) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_greedy_output_with_speculation_equals_output_without(plain, spec):
    expected = token_ids(plain.generate(PROMPTS, GREEDY))
    assert token_ids(spec.generate(PROMPTS, GREEDY)) == expected
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens_per_pos[3] > 0  # drafts were verified
    assert stats.num_accepted_tokens <= stats.num_draft_tokens


def test_mixed_batch_of_speculating_plain_and_prefilling_requests_matches(plain, spec):
    """Drafted decodes share forwards with plain decodes and prompt chunks arriving mid-stream."""
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculative=False)] * 2
    expected = token_ids(plain.generate(PROMPTS, params))
    for i in range(2):
        spec.add_request(f"r{i}", PROMPTS[i], params[i])
    done: dict[str, list[int]] = {}

    def step():
        for out in spec.step():
            done.setdefault(out.request_id, []).extend(out.new_token_ids)
    for _ in range(6):
        step()
    for i in range(2, 4):
        spec.add_request(f"r{i}", PROMPTS[i], params[i])
    while spec.has_unfinished_requests():
        step()
    assert [done[f"r{i}"] for i in range(4)] == expected
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_seeded_sampling_with_speculation_draws_the_same_tokens(plain, spec):
    """Each emitted token takes one draw from the request's generator, accepted or not: a seed gives the
    same output with and without speculation."""
    params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=32, ignore_eos=True, seed=s) for s in range(4)]
    prompts = [LOOP_PROMPT] * 4
    assert token_ids(spec.generate(prompts, params)) == token_ids(plain.generate(prompts, params))
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_sampled_token_distribution_matches_plain_decoding(plain, spec):
    """The token at output position 3 over 400 requests with different seeds per engine: the two
    empirical distributions agree within sampling noise (total variation distance; about 0.04 expected).
    A logit bias leaves three likely tokens (the loop's own about 0.6), so drafts are accepted and rejected."""
    n, position = 400, 3
    bias = {33280: 20.0, 500: 19.0, 501: 19.0}

    def histogram(engine: Engine, first_seed: int) -> collections.Counter:
        params = [SamplingParams(temperature=1.0, logit_bias=bias, max_tokens=position + 1, ignore_eos=True,
                                 seed=first_seed + i) for i in range(n)]
        return collections.Counter(o.token_ids[position] for o in engine.generate([[33280] * 16] * n, params))

    without, with_spec = histogram(plain, 0), histogram(spec, 10**6)
    stats = spec.speculator.stats
    assert stats.num_accepted_tokens_per_pos[1] > 50 and stats.num_accepted_tokens < stats.num_draft_tokens
    tv = sum(abs(without[t] - with_spec[t]) for t in without.keys() | with_spec.keys()) / (2 * n)
    assert len(without) == 3 and tv < 0.12, (without, with_spec)


def test_rejected_drafts_leave_no_blocks_or_cached_hashes_behind(tiny_llama_dir, plain):
    spec = make_engine(tiny_llama_dir, speculative=True)
    plain.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    req = spec.add_request("r", PROMPTS[2], params)
    bm, bs = spec.block_manager, spec.config.block_size
    while spec.has_unfinished_requests():
        spec.step()
        if not req.finished:  # KV only for kept tokens, and every cached block holds kept tokens only
            assert len(req.block_table) == bm.blocks_needed(req.num_computed_tokens)
            assert req.num_computed_tokens == req.num_tokens - 1
            for i, block_id in enumerate(req.block_table):
                block = bm.blocks[block_id]
                if block.block_hash is not None:
                    assert list(block.token_ids) == req.all_token_ids[i * bs:(i + 1) * bs]
    plain.generate([PROMPTS[2]], params)
    assert spec.speculator.stats.num_draft_tokens > spec.speculator.stats.num_accepted_tokens  # some rejected
    assert bm.num_free_blocks == plain.block_manager.num_free_blocks == bm.num_blocks
    assert set(bm.cached) == set(plain.block_manager.cached)


def test_abort_mid_speculation_frees_like_plain_decoding(tiny_llama_dir, plain):
    spec = make_engine(tiny_llama_dir, speculative=True)
    plain.block_manager.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    req = spec.add_request("r", LOOP_PROMPT, params)
    while req.num_output_tokens < 30:
        spec.step()
    ref = plain.add_request("r", LOOP_PROMPT, params)
    while ref.num_output_tokens < req.num_output_tokens:
        plain.step()
    assert spec.abort("r") and plain.abort("r")
    assert spec.block_manager.num_free_blocks == plain.block_manager.num_free_blocks == spec.block_manager.num_blocks
    assert set(spec.block_manager.cached) == set(plain.block_manager.cached)


def test_preempted_speculating_requests_match_plain_decoding(tiny_llama_dir, plain):
    spec = make_engine(tiny_llama_dir, speculative=True, num_kv_blocks=9)
    expected = token_ids(plain.generate(PROMPTS, GREEDY))
    assert token_ids(spec.generate(PROMPTS, GREEDY)) == expected
    assert spec.scheduler.num_preemptions > 0 and spec.speculator.stats.num_accepted_tokens > 0


def test_requests_opt_out_of_the_engine_default(spec):
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, speculative=False)
    spec.generate([LOOP_PROMPT], params)
    assert spec.speculator.stats.num_drafts == 0


def test_requests_opt_in_on_an_engine_without_a_default(tiny_llama_dir, plain):
    engine = make_engine(tiny_llama_dir, speculative=False)
    expected = token_ids(plain.generate([LOOP_PROMPT], GREEDY))
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, speculative=True)
    assert token_ids(engine.generate([LOOP_PROMPT], params)) == expected
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_speculative_must_be_a_boolean():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(speculative="yes")
    assert err.value.field == "speculative"


def test_structured_output_drafts_stop_at_the_grammar_and_match_plain_decoding(plain, spec):
    """Drafts the grammar refuses are cut before verification; the grammar advances on kept tokens only."""
    regex = StructuredOutputs(regex="(abc ){6}done")
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=regex)
    prompt = plain.tokenize("abc abc abc abc")
    expected = plain.generate([prompt], params)[0]
    got = spec.generate([prompt], params)[0]
    assert got.token_ids == expected.token_ids and got.text == "abc " * 6 + "done"
    assert spec.speculator.stats.num_accepted_tokens > 0


def test_migrated_request_replays_its_output_and_speculates_on(plain, spec):
    expected = plain.generate([LOOP_PROMPT], GREEDY)[0].token_ids
    req = spec.make_request("moved", LOOP_PROMPT, GREEDY, output_token_ids=expected[:10])
    spec.add(req)
    while spec.has_unfinished_requests():
        spec.step()
    assert req.output_token_ids == expected and spec.speculator.stats.num_accepted_tokens > 0


def test_draft_length_follows_acceptance_against_the_cost_of_a_draft_token():
    assert num_drafts(0.95, 0.05, 4) == 4
    assert num_drafts(0.5, 0.2, 4) == 2  # 0.5, 0.25 beat 0.2; 0.125 does not
    assert num_drafts(0.3, 0.4, 4) == 0  # not worth a single token: speculation is off for the request
    assert num_drafts(0.0, 0.0, 4) == 0


def test_request_stops_drafting_when_rejected_and_resumes_when_its_guesses_come_true(tiny_llama_dir):
    """A request that stops drafting keeps scoring the guess it did not draft, so it starts again once
    its text turns predictable (here: at once, the model loops)."""
    engine = make_engine(tiny_llama_dir, speculative=True, adaptive=True)
    req = engine.add_request("r", [33280] * 16, SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True))
    engine.step()  # the prompt
    req.spec.acceptance = 0.0  # as after a run of rejections: no draft position pays, whatever a token costs
    engine.step()
    assert engine.speculator.stats.num_drafts == 0 and req.spec.acceptance == pytest.approx(0.1)  # guess scored
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.speculator.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("body, field", [
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "eagle"}, "speculative_config.method"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "speculative_config"),
    ({"method": "draft_model"}, "speculative_config"),
])
def test_cluster_speculative_config_is_validated_naming_the_field(body, field):
    from pydantic import ValidationError

    from cluster.config import ClusterConfig
    from engine.errors import first_field_error
    with pytest.raises(ValidationError) as err:
        ClusterConfig.model_validate({"speculative_config": body})
    assert first_field_error(err.value).path == field


def test_the_decode_pool_default_reaches_decode_workers_only():
    from cluster.config import ClusterConfig
    config = ClusterConfig.model_validate({"speculative_config": {"num_speculative_tokens": 3}})
    assert config.engine_config(config.decode, "decode").speculative_config.num_speculative_tokens == 3
    assert config.engine_config(config.prefill, "prefill").speculative_config is None


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.5),
    SamplingParams(temperature=0.0, max_tokens=40, frequency_penalty=1.0, logit_bias={33280: 3.0}, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=40, min_tokens=12, stop_token_ids=[33280]),
    SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.7, top_p=0.9, min_p=0.05, max_tokens=30, seed=7, ignore_eos=True, logprobs=1,
                   logit_bias={33280: 20.0, 500: 19.0, 501: 19.0}),
], ids=["repetition-presence", "frequency-bias", "min-tokens-stop-id", "max-tokens-logprobs", "top-p-min-p-seeded"])
def test_each_verified_position_is_sampled_as_a_plain_step_would(plain, spec, params):
    """Penalties count the draft tokens accepted before a position, min_tokens bans stop ids until the
    count is reached, max_tokens caps the draft, and logprobs come for every emitted token."""
    prompts = [LOOP_PROMPT, [33280] * 16]
    expected = plain.generate(prompts, params)
    got = spec.generate(prompts, params)
    for e, g in zip(expected, got):
        assert (g.token_ids, g.finish_reason, g.stop_reason) == (e.token_ids, e.finish_reason, e.stop_reason)
        assert [lp["token_id"] for lp in g.logprobs] == [lp["token_id"] for lp in e.logprobs]
        assert [lp["logprob"] for lp in g.logprobs] == pytest.approx([lp["logprob"] for lp in e.logprobs], abs=1e-3)
    assert spec.speculator.stats.num_draft_tokens > 0


def test_prefix_cache_hits_do_not_change_speculated_output(plain, spec):
    expected = token_ids(plain.generate(PROMPTS, GREEDY))
    assert token_ids(spec.generate(PROMPTS, GREEDY)) == expected
    again = spec.generate(PROMPTS, GREEDY)
    assert token_ids(again) == expected and sum(o.num_cached_tokens for o in again) > 0


def test_drafted_rows_match_on_the_gather_path_too(tiny_llama_dir, plain):
    """Where the CPU decode kernel does not run (GPU, other dtypes), a drafted row is a k+1-token chunk."""
    engine = make_engine(tiny_llama_dir, speculative=True)
    engine.runner.paged_kernel = False
    assert token_ids(engine.generate(PROMPTS, GREEDY)) == token_ids(plain.generate(PROMPTS, GREEDY))
    assert engine.speculator.stats.num_accepted_tokens > 0
