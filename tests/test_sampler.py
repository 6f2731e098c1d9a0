"""Sampler semantics (vLLM's): greedy, seeded sampling, top-k/top-p/min-p sets, penalties, logit bias,
min_tokens masking, logprobs, and n candidates through Engine.generate."""
import pytest
import torch

from engine import SamplingParams
from engine.request import Request
from engine.sampler import Sampler, filtered_probs

EOS = 0
VOCAB = 16
SAMPLER = Sampler(eos_token_ids={EOS})


def sampler(logits, reqs):
    """The engine hands the sampler each step's logits once and it writes into them; these tests reuse theirs."""
    return SAMPLER(logits.clone(), reqs)


def make_request(params: SamplingParams, prompt=(1, 2), output=(), seed=0) -> Request:
    generator = None if params.greedy else torch.Generator().manual_seed(seed)
    req = Request("r", list(prompt), params, max_tokens=1000, generator=generator)
    req.all_token_ids.extend(output)
    return req


def support(probs: torch.Tensor) -> set[int]:
    return set(torch.nonzero(probs > 0).flatten().tolist())


def peaked_logits(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits as spread out as a real model's: a few likely tokens and a long tail."""
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- greedy and seeds ---------------------------------------------------------------------------

def test_temperature_zero_picks_the_argmax_whatever_the_filters():
    logits = peaked_logits(1, VOCAB)
    params = SamplingParams(temperature=0.0, top_k=3, top_p=0.1, min_p=0.5)
    tokens, _ = sampler(logits, [make_request(params)])
    assert tokens == [int(logits[0].argmax())]


def draw(logits_row: torch.Tensor, others: list[tuple[torch.Tensor, SamplingParams]], position: int,
         steps: int = 12) -> list[int]:
    """Draws `steps` tokens for a request seeded 7, placed at `position` among the `others`."""
    target = make_request(SamplingParams(temperature=0.9, seed=7), seed=7)
    others_reqs = [make_request(p, seed=100 + i) for i, (_, p) in enumerate(others)]
    reqs = others_reqs[:position] + [target] + others_reqs[position:]
    rows = [row for row, _ in others]
    logits = torch.stack(rows[:position] + [logits_row] + rows[position:])
    drawn = []
    for _ in range(steps):
        tokens, _ = sampler(logits, reqs)
        drawn.append(tokens[position])
    return drawn


def test_seeded_request_draws_the_same_tokens_alone_or_in_any_batch():
    rows = peaked_logits(4, 4096)
    alone = draw(rows[0], [], 0)
    with_filters = [(rows[1], SamplingParams(temperature=0.0)), (rows[2], SamplingParams(top_k=5, top_p=0.8)),
                    (rows[3], SamplingParams(min_p=0.2, temperature=1.5))]
    assert draw(rows[0], with_filters, 1) == alone
    assert draw(rows[0], with_filters[::-1], 3) == alone
    assert draw(rows[0], with_filters[1:], 0) == alone
    assert len(set(alone)) > 1, "the draws should not all be one token, or the test proves nothing"


def test_top_p_one_keeps_the_whole_vocabulary_when_another_row_filters():
    logits = peaked_logits(2, 49152) * 3
    plain = SamplingParams()
    alone = filtered_probs(logits[:1], [make_request(plain)])
    batched = filtered_probs(logits, [make_request(plain), make_request(SamplingParams(top_k=5))])
    assert torch.equal(batched[0], alone[0])
    assert support(alone[0]) == set(range(49152))


def test_engine_seeded_sampling_does_not_depend_on_batch_neighbours(tiny_engine):
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=4, ignore_eos=True)
    prompt = "The quick brown fox"
    alone = tiny_engine.generate([prompt], params)[0].token_ids
    neighbours = [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                  SamplingParams(temperature=1.0, top_k=8, seed=5, max_tokens=4, ignore_eos=True)]
    batched = tiny_engine.generate(["Hello", prompt, [5, 6, 7] * 9], [neighbours[0], params, neighbours[1]])
    assert batched[1].token_ids == alone


# ---- filtered sets ------------------------------------------------------------------------------

def test_temperature_scales_logits_before_softmax():
    logits = peaked_logits(1, VOCAB)
    probs = filtered_probs(logits, [make_request(SamplingParams(temperature=2.5))])
    assert torch.allclose(probs[0], torch.softmax(logits[0] / 2.5, dim=-1))


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = peaked_logits(3, VOCAB)
    reqs = [make_request(SamplingParams(top_k=k)) for k in (1, 4, VOCAB)]
    probs = filtered_probs(logits, reqs)
    for row, k in zip(range(3), (1, 4, VOCAB)):
        assert support(probs[row]) == set(logits[row].topk(k).indices.tolist())
        assert probs[row].sum().item() == pytest.approx(1.0)


def smallest_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    probs, order = torch.softmax(logits, dim=-1).sort(descending=True)
    kept, mass = set(), 0.0
    for p, token in zip(probs.tolist(), order.tolist()):
        kept.add(token)
        mass += p
        if mass >= top_p:
            return kept
    return kept


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.75, 0.95])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(top_p):
    logits = peaked_logits(1, VOCAB, seed=3)
    probs = filtered_probs(logits, [make_request(SamplingParams(top_p=top_p))])
    assert support(probs[0]) == smallest_nucleus(logits[0], top_p)


def test_top_p_applies_to_the_top_k_survivors_renormalized():
    logits = peaked_logits(1, VOCAB, seed=4)
    probs = filtered_probs(logits, [make_request(SamplingParams(top_k=5, top_p=0.6))])
    top5 = logits[0].masked_fill(logits[0] < logits[0].topk(5).values[-1], float("-inf"))
    assert support(probs[0]) == smallest_nucleus(top5, 0.6)


@pytest.mark.parametrize("min_p", [0.01, 0.2, 0.9])
def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability(min_p):
    logits = peaked_logits(1, VOCAB, seed=5)
    probs = filtered_probs(logits, [make_request(SamplingParams(min_p=min_p, temperature=0.8))])
    base = torch.softmax(logits[0] / 0.8, dim=-1)
    assert support(probs[0]) == set(torch.nonzero(base >= min_p * base.max()).flatten().tolist())


@pytest.mark.parametrize("params", [SamplingParams(top_k=3), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3),
                                    SamplingParams(top_k=4, top_p=0.7, min_p=0.05, temperature=1.3)],
                         ids=["top_k", "top_p", "min_p", "combined"])
def test_sampler_draws_only_from_the_filtered_set_in_proportion(params):
    logits = peaked_logits(1, VOCAB, seed=6)
    expected = filtered_probs(logits, [make_request(params)])[0]
    draws = 3000
    reqs = [make_request(params, seed=s) for s in range(draws)]
    tokens, _ = sampler(logits.expand(draws, VOCAB), reqs)
    counts = torch.bincount(torch.tensor(tokens), minlength=VOCAB) / draws
    assert set(tokens) <= support(expected)
    assert torch.allclose(counts, expected, atol=0.04)
    assert len(set(tokens)) > 1 or len(support(expected)) == 1


# ---- penalties and bias -------------------------------------------------------------------------

def assert_adjusted(params: SamplingParams, token: int, raw: float, expected: float, prompt=(), output=()):
    """The token's logit after penalties and bias is `expected`: it loses to a neutral rival just above
    that value and beats one just below."""
    rival = next(t for t in range(1, VOCAB) if t not in (token, *prompt, *output, *(params.logit_bias or {})))
    for rival_logit, winner in ((expected + 1e-3, rival), (expected - 1e-3, token)):
        logits = torch.full((1, VOCAB), -30.0)
        logits[0, token], logits[0, rival] = raw, rival_logit
        tokens, _ = sampler(logits, [make_request(params, prompt=prompt, output=output)])
        assert tokens == [winner], f"logit of {token} should become {expected}"


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kwargs)


def test_repetition_penalty_divides_a_positive_logit_of_a_prompt_token():
    assert_adjusted(greedy(repetition_penalty=2.0), token=3, raw=3.0, expected=1.5, prompt=(3, 4))


def test_repetition_penalty_multiplies_a_negative_logit_of_an_output_token():
    assert_adjusted(greedy(repetition_penalty=2.0), token=3, raw=-1.0, expected=-2.0, prompt=(4,), output=(3,))


def test_repetition_penalty_leaves_unseen_tokens_alone():
    assert_adjusted(greedy(repetition_penalty=2.0), token=3, raw=3.0, expected=3.0, prompt=(4,), output=(5,))


def test_frequency_penalty_subtracts_per_output_occurrence():
    assert_adjusted(greedy(frequency_penalty=0.5), token=3, raw=3.0, expected=2.0, output=(3, 4, 3))


def test_frequency_and_presence_penalties_ignore_prompt_tokens():
    assert_adjusted(greedy(frequency_penalty=1.0, presence_penalty=1.0), token=3, raw=3.0, expected=3.0,
                    prompt=(3, 3, 3), output=(4,))


def test_presence_penalty_subtracts_once_for_any_number_of_occurrences():
    assert_adjusted(greedy(presence_penalty=0.7), token=3, raw=3.0, expected=2.3, output=(3, 3, 3))


def test_negative_frequency_penalty_rewards_repetition():
    assert_adjusted(greedy(frequency_penalty=-0.5), token=3, raw=1.0, expected=2.0, output=(3, 3))


def test_logit_bias_adds_to_the_logit():
    assert_adjusted(greedy(logit_bias={3: -1.25}), token=3, raw=3.0, expected=1.75)


def test_penalties_combine_repetition_first_then_frequency_and_presence():
    params = greedy(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    assert_adjusted(params, token=3, raw=4.0, expected=4.0 / 2 - 2 * 0.5 - 0.25, output=(3, 5, 3))


def test_penalties_and_bias_apply_to_random_sampling_too():
    params = SamplingParams(temperature=0.1, logit_bias={3: -100.0}, presence_penalty=2.0, frequency_penalty=1.0)
    logits = torch.zeros(1, VOCAB)
    logits[0, [3, 4, 6]] = 20.0
    tokens = {sampler(logits, [make_request(params, output=(4, 4), seed=s)])[0][0] for s in range(20)}
    assert tokens == {6}


# ---- min_tokens and logprobs ----------------------------------------------------------------------

def eos_favoured_logits(stop_token: int | None = None) -> torch.Tensor:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 10.0
    logits[0, 7] = 5.0
    if stop_token is not None:
        logits[0, stop_token] = 8.0
    return logits


def test_min_tokens_masks_eos_until_reached():
    params = greedy(min_tokens=2)
    assert sampler(eos_favoured_logits(), [make_request(params, output=(4,))])[0] == [7]
    assert sampler(eos_favoured_logits(), [make_request(params, output=(4, 4))])[0] == [EOS]


def test_min_tokens_masks_stop_token_ids_until_reached():
    params = greedy(min_tokens=1, stop_token_ids=[9], ignore_eos=True)
    logits = eos_favoured_logits(stop_token=9)
    logits[0, EOS] = -10.0
    assert sampler(logits, [make_request(params)])[0] == [7]
    assert sampler(logits, [make_request(params, output=(4,))])[0] == [9]


def test_min_tokens_leaves_eos_alone_when_eos_is_ignored():
    params = greedy(min_tokens=5, ignore_eos=True)
    assert sampler(eos_favoured_logits(), [make_request(params)])[0] == [EOS]


def test_logprobs_report_the_raw_distribution_and_sorted_top_n():
    logits = peaked_logits(1, VOCAB, seed=8)
    params = SamplingParams(temperature=0.6, repetition_penalty=1.5, logit_bias={2: 5.0}, logprobs=4, seed=3)
    tokens, entries = sampler(logits, [make_request(params, output=(1,), seed=3)])
    raw = torch.log_softmax(logits[0], dim=-1)
    entry = entries[0]
    assert entry["token_id"] == tokens[0]
    assert entry["logprob"] == pytest.approx(float(raw[tokens[0]]), abs=1e-6)
    assert list(entry["top_logprobs"]) == raw.topk(4).indices.tolist()
    values = list(entry["top_logprobs"].values())
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(raw.topk(4).values.tolist(), abs=1e-6)


def test_logprobs_zero_gives_the_sampled_token_only_and_none_gives_nothing():
    logits = peaked_logits(2, VOCAB, seed=9)
    reqs = [make_request(greedy(logprobs=0)), make_request(greedy())]
    tokens, entries = sampler(logits, reqs)
    assert entries[0]["top_logprobs"] == {} and entries[0]["token_id"] == tokens[0]
    assert entries[1] is None


# ---- through the engine -------------------------------------------------------------------------

def test_engine_min_tokens_holds_back_a_favoured_eos(tiny_engine):
    eos = min(tiny_engine.eos_token_ids)
    out = tiny_engine.generate(["Hi"], greedy(logit_bias={eos: 100.0}, min_tokens=3, max_tokens=10))[0]
    assert len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert eos not in out.token_ids[:3]
    assert out.finish_reason == "stop"


def test_engine_logprobs_cover_every_generated_token(tiny_engine):
    out = tiny_engine.generate(["Hi"], SamplingParams(temperature=1.0, seed=2, max_tokens=4, ignore_eos=True,
                                                      logprobs=2))[0]
    assert [e["token_id"] for e in out.logprobs] == out.token_ids
    assert all(len(e["top_logprobs"]) == 2 and e["logprob"] <= 0.0 for e in out.logprobs)


def test_n_gives_n_distinct_candidates_reproducible_with_a_seed(tiny_engine):
    params = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=3, ignore_eos=True)
    first = tiny_engine.generate(["Once upon a time"], params)
    again = tiny_engine.generate(["Once upon a time"], params)
    assert len(first) == 1
    candidates = [c.token_ids for c in first[0].candidates]
    assert len(candidates) == 3
    assert len({tuple(c) for c in candidates}) == 3
    assert [c.token_ids for c in again[0].candidates] == candidates


def test_n_without_a_seed_still_gives_n_candidates(tiny_engine):
    out = tiny_engine.generate(["Once upon a time"], SamplingParams(n=2, max_tokens=2, ignore_eos=True))[0]
    assert len(out.candidates) == 2
    assert all(len(c.token_ids) == 2 for c in out.candidates)


def test_bans_are_written_into_the_step_logits_and_plain_greedy_rows_are_left_alone():
    logits = eos_favoured_logits(stop_token=9).repeat(2, 1)
    before = logits.clone()
    banned = make_request(greedy(min_tokens=1, stop_token_ids=[9]))
    plain = make_request(greedy())
    tokens, _ = SAMPLER(logits, [banned, plain])
    assert tokens[0] not in (EOS, 9) and tokens[1] == int(before[1].argmax())
    assert logits[0, EOS] == logits[0, 9] == float("-inf")  # no [rows, vocab] copy per step
    assert torch.equal(logits[1], before[1])
