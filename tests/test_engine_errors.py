"""Bad input gets a typed InvalidRequestError naming the field, with a message that says what is wrong,
and the engine keeps serving the requests it already runs."""
import pytest

from engine import Engine, EngineConfig, EngineError, InvalidRequestError, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

INVALID_SAMPLING = [
    ("n", {"n": 0}), ("n", {"n": 129}),
    ("temperature", {"temperature": -0.5}), ("temperature", {"temperature": float("nan")}),
    ("top_p", {"top_p": 0.0}), ("top_p", {"top_p": 1.5}),
    ("top_k", {"top_k": -2}), ("top_k", {"top_k": 2.5}),
    ("min_p", {"min_p": -0.1}), ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}), ("frequency_penalty", {"frequency_penalty": -3.0}),
    ("repetition_penalty", {"repetition_penalty": 0.0}), ("repetition_penalty", {"repetition_penalty": 11.0}),
    ("seed", {"seed": "42"}),
    ("max_tokens", {"max_tokens": 0}), ("max_tokens", {"max_tokens": 2.0}),
    ("min_tokens", {"min_tokens": -1}), ("min_tokens", {"min_tokens": 20, "max_tokens": 10}),
    ("logprobs", {"logprobs": -1}), ("logprobs", {"logprobs": 21}),
    ("stop", {"stop": [""]}), ("stop", {"stop": ["x"] * 17}), ("stop", {"stop": [3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("logit_bias", {"logit_bias": {5: 101.0}}), ("logit_bias", {"logit_bias": {-3: 1.0}}),
]


@pytest.mark.parametrize("field, kwargs", INVALID_SAMPLING,
                         ids=[f"{f}={list(k.values())[0]!r}" for f, k in INVALID_SAMPLING])
def test_invalid_sampling_value_raises_naming_its_field(field, kwargs):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field
    assert field in str(info.value)


def test_invalid_request_error_is_an_engine_error_and_a_value_error():
    assert issubclass(InvalidRequestError, EngineError)
    assert issubclass(InvalidRequestError, ValueError)


def test_null_stop_and_stop_token_ids_mean_none():
    params = SamplingParams(stop=None, stop_token_ids=None)
    assert params.stop == [] and params.stop_token_ids == []
    assert SamplingParams(stop="END").stop == ["END"]


def rejected(engine: Engine, prompt, params=GREEDY, request_id="bad") -> InvalidRequestError:
    """Adds a request that must be refused; checks the engine kept no trace of it."""
    before = set(engine.requests)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(request_id, prompt, params)
    assert set(engine.requests) == before
    return info.value


@pytest.mark.parametrize("field, kwargs", [("stop_token_ids", {"stop_token_ids": [49152]}),
                                           ("logit_bias", {"logit_bias": {49152: 1.0}})])
def test_token_ids_outside_the_vocabulary_in_sampling_params_are_refused(tiny_engine, field, kwargs):
    assert tiny_engine.runner.vocab_size == 49152
    assert rejected(tiny_engine, "Hi", SamplingParams(**kwargs)).field == field


def test_prompt_longer_than_the_context_window_is_refused(tiny_engine):
    error = rejected(tiny_engine, [5] * 600)
    assert error.field == "prompt"
    assert "600" in str(error) and str(tiny_engine.max_model_len) in str(error)


def test_prompt_filling_the_whole_context_window_is_refused(tiny_engine):
    assert rejected(tiny_engine, [5] * tiny_engine.max_model_len).field == "prompt"


def test_max_tokens_beyond_the_context_window_is_refused(tiny_engine):
    error = rejected(tiny_engine, [5] * 500, SamplingParams(max_tokens=20))
    assert error.field == "max_tokens"
    assert "max_tokens=20" in str(error) and "500" in str(error)


def test_max_tokens_beyond_the_kv_cache_is_refused(tiny_llama_dir):
    engine = Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=4))
    error = rejected(engine, [5] * 40, SamplingParams(max_tokens=30))
    assert error.field == "max_tokens"
    assert "KV blocks" in str(error)


@pytest.mark.parametrize("prompt", [[1, 49152], [-1, 5], [5, "6"], [5, 2.0]],
                         ids=["past-vocab", "negative", "string", "float"])
def test_prompt_token_ids_outside_the_vocabulary_are_refused(tiny_engine, prompt):
    error = rejected(tiny_engine, prompt)
    assert error.field == "prompt"
    assert "vocabulary" in str(error)


@pytest.mark.parametrize("prompt", ["", []], ids=["text", "token-ids"])
def test_empty_prompt_is_refused(tiny_engine, prompt):
    assert rejected(tiny_engine, prompt).field == "prompt"


def test_duplicate_request_id_is_refused_and_the_first_request_is_untouched(tiny_engine):
    expected = tiny_engine.generate(["Hello"], GREEDY)[0].token_ids
    first = tiny_engine.add_request("dup", "Hello", GREEDY)
    tiny_engine.step()
    error = rejected(tiny_engine, "Other", request_id="dup")
    assert error.field == "request_id" and "dup" in str(error)
    assert tiny_engine.requests["dup"] is first
    while tiny_engine.has_unfinished_requests():
        tiny_engine.step()
    assert first.output_token_ids == expected


def test_a_finished_request_id_can_be_used_again(tiny_engine):
    expected = tiny_engine.generate(["Hello"], GREEDY)[0].token_ids
    for _ in range(2):
        tiny_engine.add_request("again", "Hello", GREEDY)
        tokens, finished = [], []
        while tiny_engine.has_unfinished_requests():
            for o in tiny_engine.step():
                tokens += o.new_token_ids
                finished += [(o.request_id, tokens, o.error)] if o.finished else []
        assert finished == [("again", expected, None)]
        assert "again" not in tiny_engine.requests


def test_running_requests_finish_normally_after_bad_ones_are_refused(tiny_engine):
    prompts = ["The weather today", [7, 8, 9, 10, 11]]
    expected = [o.token_ids for o in tiny_engine.generate(prompts, GREEDY)]
    for i, prompt in enumerate(prompts):
        tiny_engine.add_request(f"good-{i}", prompt, GREEDY)
    first = tiny_engine.step()
    for bad in ([], [5] * 600, [49152]):
        rejected(tiny_engine, bad)
    with pytest.raises(InvalidRequestError):
        tiny_engine.add_request("bad", "Hi", SamplingParams(temperature=-1.0))
    got: dict[str, list[int]] = {}
    for out in first:
        got.setdefault(out.request_id, []).extend(out.new_token_ids)
    while tiny_engine.has_unfinished_requests():
        for out in tiny_engine.step():
            assert out.error is None
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert [got["good-0"], got["good-1"]] == expected
