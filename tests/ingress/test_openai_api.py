"""The OpenAI API through the official `openai` client, against a real Serve app on real workers."""
import json

import pytest
import ray
import requests

from engine import SamplingParams
from tests.helpers import token_prompt
from tests.ingress.conftest import MODEL

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def sse_lines(response) -> list[str]:
    return [line for line in response.iter_lines(decode_unicode=True) if line]


def test_models_lists_the_served_model_with_its_context_window(main_app):
    models = main_app.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == 512


def test_greedy_completion_equals_the_engine_and_counts_usage(main_app, tiny_engine, tokenizer):
    prompt = "The quick brown fox jumps over the lazy dog"
    out = main_app.client().completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY)
    [ref] = tiny_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == "length"
    num_prompt = len(tokenizer.encode(prompt))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        num_prompt, 12, num_prompt + 12)


def test_long_prompt_is_prefilled_remotely_and_still_equals_the_engine(main_app, tiny_engine):
    prompt = token_prompt(100, seed=1)  # beyond max_local_prefill_length=48: prefilled on the prefill pool
    prefill = next(a for w, a in main_app.actors().items() if w.startswith("prefill"))
    before = ray.get(prefill.stats.remote()).prompt_tokens
    out = main_app.client().completions.create(model=MODEL, prompt=prompt, max_tokens=10, **GREEDY)
    [ref] = tiny_engine.generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert out.choices[0].text == ref.text
    assert out.usage.prompt_tokens == 100
    assert ray.get(prefill.stats.remote()).prompt_tokens == before + 100
    assert kv_transfer_failures(main_app) == 0  # the KV was pulled, not recomputed


def kv_transfer_failures(app) -> int:
    decode = [a for w, a in app.actors().items() if w.startswith("decode")]
    return sum(t["transfer_failures"] for t in ray.get([a.transfer_stats.remote() for a in decode]))


def test_streamed_completion_equals_the_whole_one_and_reports_usage_last(main_app):
    client, prompt = main_app.client(), token_prompt(70, seed=2)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=15, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (70, 15)
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_is_server_sent_events_ending_in_done(main_app):
    response = main_app.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 4,
                                                  "stream": True}, stream=True)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = sse_lines(response)
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert all(json.loads(line[6:])["object"] == "text_completion" for line in lines[:-1])


def test_chat_completion_streamed_and_whole_agree(main_app, tokenizer):
    client = main_app.client()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert whole.choices[0].message.role == "assistant"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    num_prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (num_prompt, 10)
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (num_prompt, 10)


def test_n_seeded_candidates_are_reproducible_and_each_is_seed_plus_index(main_app):
    client, prompt = main_app.client(), token_prompt(20, seed=3)
    sample = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 1.0,
              "extra_body": {"ignore_eos": True}}
    first = client.completions.create(n=3, seed=7, **sample)
    again = client.completions.create(n=3, seed=7, **sample)
    single = client.completions.create(n=1, seed=8, **sample)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.choices[1].text == single.choices[0].text
    assert len({c.text for c in first.choices}) > 1
    assert first.usage.completion_tokens == 24 and first.usage.prompt_tokens == 20


def test_unseeded_candidates_differ_even_on_different_workers(main_app):
    out = main_app.client().completions.create(model=MODEL, prompt=token_prompt(20, seed=4), max_tokens=8, n=4,
                                               temperature=1.0, extra_body={"ignore_eos": True})
    assert len({c.text for c in out.choices}) > 1


def test_several_prompts_get_one_choice_each_in_order(main_app):
    prompts = [token_prompt(10, seed=5), token_prompt(30, seed=6)]
    out = main_app.client().completions.create(model=MODEL, prompt=prompts, max_tokens=3, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 40 and out.usage.completion_tokens == 6


def test_completion_logprobs_list_each_token_with_its_top_alternatives(main_app):
    out = main_app.client().completions.create(model=MODEL, prompt="Once upon", max_tokens=5, logprobs=3, **GREEDY)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) <= 3 and lp <= 0
        assert lp == pytest.approx(max(top.values()))  # greedy picks the most likely token


def test_chat_logprobs_have_top_logprobs_per_token(main_app):
    out = main_app.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 2 and entry.bytes == list(entry.token.encode()) for entry in content)


def test_stop_string_ends_the_output_before_it(main_app):
    client, prompt = main_app.client(), token_prompt(12, seed=7)
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, stop=[stop], **GREEDY)
    assert out.choices[0].text == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop


def test_api_docs_follow_the_api_key_rule(main_app, aux_app):
    """With keys (main) the schema and its viewers need one like every route; without keys (aux) they are open.
    The schema names the app's route prefix, under which Serve mounts it."""
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert main_app.get(path).status_code == 401
        keyed = requests.get(f"{main_app.base_url}{path}", headers={"Authorization": "Bearer key-a"}, timeout=30)
        assert keyed.status_code == 200
        assert aux_app.get(path).status_code == 200
    schema = requests.get(f"{main_app.base_url}/openapi.json", headers={"Authorization": "Bearer key-a"}, timeout=30)
    assert "/v1/chat/completions" in schema.json()["paths"]
    assert schema.json()["servers"] == [{"url": "/main"}]


def test_health_counts_the_schedulable_workers(main_app):
    response = main_app.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ok", "decode_workers": 2, "prefill_workers": 1}
