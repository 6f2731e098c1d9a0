"""Sampling parameters from hostile clients: whatever SamplingParams accepts, the sampler turns into a
token of the vocabulary with finite logprobs, never inf/NaN or an exception on the engine thread.
Hypothesis runs derandomized, so a failure reproduces on every run."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from engine.errors import InvalidRequestError
from engine.request import Request
from engine.sampler import Sampler

VOCAB = 64
EOS = 0
sampler = Sampler(eos_token_ids={EOS})
FUZZ = settings(max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_request(params: SamplingParams, output=(3, 3, 5)) -> Request:
    generator = None if params.greedy else torch.Generator().manual_seed(params.seed or 0)
    req = Request("r", [1, 2, 3], params, max_tokens=1000, generator=generator)
    req.all_token_ids.extend(output)
    return req


def peaked_logits(seed: int) -> torch.Tensor:
    return torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(seed)) * 8


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-45, 1e-20, 1e-8, 1e-6, 1e-5, 1e-4])
def test_a_tiny_positive_temperature_samples_the_argmax_not_nan(temperature):
    logits = peaked_logits(seed=7)
    params = SamplingParams(temperature=temperature, seed=1, logprobs=3)
    tokens, logprobs = sampler(logits, [make_request(params)])
    assert tokens == [int(logits[0].argmax())]
    assert math.isfinite(logprobs[0]["logprob"]) and all(map(math.isfinite, logprobs[0]["top_logprobs"].values()))


def test_a_tiny_temperature_with_the_largest_logit_bias_still_samples_the_argmax():
    logits = peaked_logits(seed=3)
    target = int(logits[0].argmin())
    params = SamplingParams(temperature=1e-5, seed=2, logit_bias={target: 100.0})
    assert sampler(logits, [make_request(params)])[0] == [target]


finite = st.floats(allow_nan=True, allow_infinity=True)
sampling_fields = st.fixed_dictionaries({}, optional={
    "temperature": st.one_of(finite, st.floats(0, 1e-3), st.sampled_from([0.0, 5e-324, 1e-300, 1e-6, 100.0])),
    "top_p": st.one_of(finite, st.floats(0, 1)),
    "top_k": st.one_of(st.integers(), st.integers(-2, 2 * VOCAB), st.sampled_from([2**31 - 1, 2**63, -2**63])),
    "min_p": st.one_of(finite, st.floats(0, 1)),
    "presence_penalty": st.one_of(finite, st.floats(-2, 2)),
    "frequency_penalty": st.one_of(finite, st.floats(-2, 2)),
    "repetition_penalty": st.one_of(finite, st.floats(1e-300, 10)),
    "seed": st.one_of(st.integers(), st.sampled_from([2**63 - 1, -2**63, 2**63, 2**64, -2**63 - 1])),
    "logit_bias": st.dictionaries(st.integers(-2, VOCAB + 2), st.one_of(finite, st.floats(-100, 100)),
                                  max_size=8),
    "min_tokens": st.integers(-1, 8),
    "logprobs": st.integers(-1, 25),
    "stop_token_ids": st.lists(st.integers(-1, VOCAB + 1), max_size=4),
})


@FUZZ
@given(fields=sampling_fields, logits_seed=st.integers(0, 2**16))
def test_whatever_sampling_params_accept_samples_a_vocabulary_token(fields, logits_seed):
    try:
        params = SamplingParams(max_tokens=16, **fields)
        params.check_vocab(VOCAB)
    except InvalidRequestError as exc:
        assert exc.field in fields or exc.field == "min_tokens"
        return
    tokens, logprobs = sampler(peaked_logits(logits_seed), [make_request(params)])
    assert 0 <= tokens[0] < VOCAB
    if params.logprobs is not None:
        assert math.isfinite(logprobs[0]["logprob"])
