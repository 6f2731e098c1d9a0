"""n candidates and beam search through the OpenAI API: the candidates of a prompt run as one request on one
decode worker (prefilled once, on the prefill worker in disaggregated mode), beam search comes back in
score order as the offline engine finds it, and what beam search does not support is a 400."""
import pytest

from engine import Engine, EngineConfig, SamplingParams
from tests.helpers import token_prompt
from tests.ingress.conftest import MODEL

SAMPLE = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return Engine(EngineConfig(model=tiny_llama_dir, num_kv_blocks=128))


def prompt_tokens_by_pool(app) -> dict[str, int]:
    totals = {"prefill": 0, "decode": 0}
    for stats in app.stats().values():
        totals[stats.pool] += stats.prompt_tokens
    return totals


def test_n_candidates_are_prefilled_once_through_the_disaggregated_path(main_app):
    prompt = token_prompt(70, seed=21)  # over main's local-prefill limit: prefilled remotely
    client = main_app.client()
    before = prompt_tokens_by_pool(main_app)
    out = client.completions.create(prompt=prompt, n=4, seed=5, **SAMPLE)
    after = prompt_tokens_by_pool(main_app)
    assert (after["prefill"] - before["prefill"], after["decode"] - before["decode"]) == (70, 70)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 24 and out.usage.prompt_tokens == 70
    singles = [client.completions.create(prompt=prompt, n=1, seed=5 + i, **SAMPLE).choices[0].text for i in range(4)]
    assert [c.text for c in out.choices] == singles


def test_streamed_candidates_each_stream_as_their_own_choice(main_app):
    prompt, client = token_prompt(70, seed=22), main_app.client()
    whole = client.completions.create(prompt=prompt, n=3, seed=9, **SAMPLE)
    texts = {}
    for chunk in client.completions.create(prompt=prompt, n=3, seed=9, stream=True, **SAMPLE):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[i] for i in range(3)] == [c.text for c in whole.choices]


@pytest.mark.parametrize("stream", [False, True])
def test_beam_search_completions_match_the_offline_engine(main_app, offline, stream):
    prompt = token_prompt(30, seed=23)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "n": 2, "best_of": 3, "stream": stream,
            "extra_body": {"use_beam_search": True, "ignore_eos": True}}
    [expected] = offline.generate(prompt, SamplingParams(n=2, best_of=3, use_beam_search=True, max_tokens=5,
                                                         ignore_eos=True))
    out = main_app.client().completions.create(**body)
    chunks = list(out) if stream else [out]
    texts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
    assert [texts[0], texts[1]] == [c.text for c in expected.candidates]


def test_beam_search_chat_returns_n_beams(main_app):
    out = main_app.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_completion_tokens=4, n=2,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.completion_tokens == 8


@pytest.mark.parametrize("field, extra", [("stop", {"stop": ["x"]}), ("logprobs", {"logprobs": 2}),
                                          ("best_of", {"best_of": 1, "n": 2})])
def test_beam_search_refuses_what_it_does_not_support(main_app, field, extra):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "use_beam_search": True, **extra}
    response = main_app.post("/v1/completions", body)
    assert response.status_code == 400 and response.json()["error"]["param"] == field
